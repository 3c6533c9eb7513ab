"""Lazy, rank-ordered access to a checkpoint's shards, and the full tensors joined from them.

Files are opened with mmap on first use, so holding a ShardSet costs address space, not RAM;
`full()` reads only the TP shards of one tensor and joins them with the layout table.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from ckpt_tools import checkpoint as fmt
from ckpt_tools import io, layout
from ckpt_tools.errors import FormatError


class ShardSet:
    def __init__(self, meta: fmt.Meta):
        self.meta = meta
        self._open: dict[tuple[str, int, int], dict] = {}
        self._where: dict[str, tuple[int, str]] = {}  # global key -> (pp_rank, stage-local key)
        for pp_rank in range(meta.pp_size):
            for local, global_key in layout.stage_keys(meta.spec, meta.layer_counts, pp_rank):
                self._where[global_key] = (pp_rank, local)

    def keys(self) -> list[str]:
        """Global keys in megatron-core order (a tied output copy appears once, on the last stage)."""
        return list(self._where)

    def _state(self, kind: str, tp_rank: int, pp_rank: int) -> dict:
        slot = (kind, tp_rank, pp_rank)
        if slot not in self._open:
            name = (fmt.model_file if kind == "model" else fmt.optimizer_file)(tp_rank, pp_rank)
            path = self.meta.dir / name
            if not path.is_file():
                raise FormatError(f"{path}: missing shard (TP rank {tp_rank}, PP rank {pp_rank}) of a "
                                  f"TP{self.meta.tp_size} x PP{self.meta.pp_size} checkpoint: restore the file")
            obj = io.load_file(path)
            self._open[slot] = obj["model"] if kind == "model" else obj["optimizer"]
        return self._open[slot]

    def shards(self, global_key: str, field: str | None = None) -> list:
        """The TP shards of one tensor, rank order; field picks optimizer state (master, exp_avg, ...)."""
        if global_key not in self._where:
            raise FormatError(f"{self.meta.dir}: no tensor {global_key} in this checkpoint's layout")
        pp_rank, local = self._where[global_key]
        out = []
        for tp_rank in range(self.meta.tp_size):
            state = self._state("model" if field is None else "optimizer", tp_rank, pp_rank)
            if local not in state:
                what = fmt.model_file(tp_rank, pp_rank) if field is None else fmt.optimizer_file(tp_rank, pp_rank)
                raise FormatError(f"{self.meta.dir / what}: tensor {local} is missing: the shard is incomplete")
            out.append(state[local] if field is None else state[local][field])
        return out

    def full(self, global_key: str, field: str | None = None):
        return layout.join(global_key, self.shards(global_key, field), self.meta.spec, self.meta.pp_size)

    def has_optimizer(self) -> bool:
        return (self.meta.dir / fmt.optimizer_file(0, 0)).is_file()

    def close(self) -> None:
        self._open.clear()

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for key in self.keys():
            yield key, self.full(key)


def open_checkpoint(src: str | Path) -> ShardSet:
    return ShardSet(fmt.Meta.read(fmt.resolve(src)))
