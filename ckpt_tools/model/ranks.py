"""Rank coordinates: where a shard sits in a parallel layout, as a record over named axes (tp, pp, ep).

`Rank` is one shard's place: its tensor-parallel, pipeline and expert-parallel coordinates. `Grid` is a
layout's size along each axis and lists its ranks in file order (stage by stage, TP rank within a stage, EP
rank within that). A layout without expert parallelism has `ep` None on every rank, and its file names and
messages carry no EP part, so every checkpoint written so far keeps its names. The layout table's rules name
the axes each tensor is split over (`layout.Rule.axes`); verbs ask a Grid for its ranks instead of nesting
loops over positional (tp_rank, pp_rank) pairs, so a new axis arrives here and in the table, not in every verb.
"""
from __future__ import annotations

from dataclasses import dataclass

TP, PP, EP = "tp", "pp", "ep"


@dataclass(frozen=True)
class Rank:
    """One shard's coordinates; `ep` None: the layout has no expert-parallel axis."""
    tp: int
    pp: int
    ep: int | None = None

    @property
    def tag(self) -> str:
        """The part of a shard file's name that says where it sits: tp_1_pp_0 (tp_1_pp_0_ep_2 with EP)."""
        return f"tp_{self.tp}_pp_{self.pp}" + (f"_ep_{self.ep}" if self.ep is not None else "")

    def __str__(self) -> str:
        return f"TP rank {self.tp}, PP rank {self.pp}" + (f", EP rank {self.ep}" if self.ep is not None else "")


@dataclass(frozen=True)
class Grid:
    """A layout's size along each axis."""
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def ranks(self, pp: int | None = None) -> list[Rank]:
        """Every rank in file order, or those of one pipeline stage."""
        stages = range(self.pp) if pp is None else (pp,)
        eps: list[int | None] = list(range(self.ep)) if self.ep > 1 else [None]
        return [Rank(t, p, e) for p in stages for t in range(self.tp) for e in eps]

    @property
    def first(self) -> Rank:
        """The first rank in file order (TP 0, PP 0, EP 0 where there is EP): the one whose shared state is read."""
        return Rank(0, 0, 0 if self.ep > 1 else None)

    @property
    def size(self) -> int:
        return self.tp * self.pp * self.ep

    def __str__(self) -> str:
        return f"TP{self.tp} x PP{self.pp}" + (f" x EP{self.ep}" if self.ep > 1 else "")
