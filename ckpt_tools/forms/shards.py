"""The reader seam: lazy, rank-ordered access to a checkpoint's TP shards, and the full tensors joined
from them, whatever form the checkpoint is on disk in.

`Reader` is the interface every verb reads through (merge, reshard, verify, inspect, the trainer's
forward): `meta` (a typed description), `keys()`, `shards(key, field)`, `full(key, field)`,
`stage_state(rank)`, `validate()`, `has_optimizer()`, `release()`. One reader per on-disk form:
`ShardSet` here (our format, Contract 2, and the per-rank files of Megatron-LM's legacy `torch` format,
whose subclass lives in megatron_lm.py) and `forms.torch_dist.TorchDistShards` (Megatron-LM's default
`torch_dist`). `open_checkpoint` gives the one forms/readers.py finds the directory holds; verbs never ask which.
Files are opened with mmap on first use, so holding a reader costs address space, not RAM; `full()` reads
only the TP shards of one tensor and joins them with the layout table, and `release()` drops the
resident pages of everything handed out since the last call, so memory stays near one tensor.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from ckpt_tools import io, memory
from ckpt_tools.errors import FormatError
from ckpt_tools.forms import checkpoint as fmt
from ckpt_tools.model import layout, shard_ops
from ckpt_tools.model.ranks import Rank
from ckpt_tools.team import SOLO, Team

MODEL, OPTIMIZER = "model", "optimizer"
OPTIMIZER_FIELDS = fmt.OPTIMIZER_FIELDS


class Reader:
    """What every form's reader gives: the shared part (keys, joins, page release, file locations)."""

    def __init__(self, meta: fmt.Meta):
        self.meta = meta
        self._ranges: list[tuple[int, int, int]] = []
        self._handed: list = []
        self._where: dict[str, tuple[int, str, int | None]] = {}  # global key -> (pp_rank, file-local key, ep_rank)
        for rank in meta.grid.ranks():
            if rank.tp == 0:
                for local, global_key in meta.rank_keys(rank):  # a dense tensor from EP rank 0 (the others: replicas)
                    self._where.setdefault(global_key, (rank.pp, local, rank.ep))

    def shards(self, global_key: str, field: str | None = None) -> list:
        """The TP shards of one tensor, rank order; field picks optimizer state (master, exp_avg, ...)."""
        raise NotImplementedError

    def validate(self) -> list[str]:
        """Problems (one line each) that make the checkpoint unreadable as the layout table says."""
        raise NotImplementedError

    def has_optimizer(self) -> bool:
        return False

    def fresh_optimizer(self) -> bool:
        """The optimizer is the fresh one of iteration 0, recorded and not written (contract 2; our format only)."""
        return False

    def optimizer_extras(self) -> dict:
        """What an optimizer shard holds beside the per-parameter state (param groups, scheduler, scaler); for a
        Megatron-LM source, what `ckpt import` writes (its Megatron-LM param groups and scheduler are its own)."""
        return {"param_groups": [], "scheduler": {"iteration": self.meta.iteration}, "scaler": None}

    def megatron_optimizer(self) -> tuple[object, object, object, object] | None:
        """(where the param groups are, they, where the opt_param_scheduler state is, it) as a Megatron-LM source
        saved them beside its optimizer state; None for a source that is not Megatron-LM's."""
        return None

    def step(self) -> float:
        """Adam's step (the same for every parameter)."""
        key = next(k for k in self.keys() if layout.holds_weights(k, self.meta.spec, self.meta.pp_size))
        return float(self.shards(self.source_key(key), "step")[0])

    def unread_optimizer(self) -> str | None:
        """The optimizer state the checkpoint holds in a form this version does not read, in words; None if
        there is none (then no optimizer state is left behind by a verb that carries only what it reads)."""
        return None

    def check_hashes(self, team: Team = SOLO) -> None:
        """The content hash of every file the checkpoint records (merge/reshard --check-hashes, verify tier 1)."""

    def file_problems(self, team: Team = SOLO) -> tuple[int, list[str]]:
        """(files the checkpoint records sizes and hashes of, the problems found checking them; in a team, this
        process's run of the files, balanced by their bytes)."""
        return 0, []

    def rng_state(self):
        """The RNG and data position of rank (0, 0) in our format, to give every target rank; None if none."""
        return None

    def stage_state(self, rank: Rank) -> dict:
        """One rank's model state dict at the checkpoint's own layout (stage-local keys)."""
        state = {}
        for local, key in self.meta.rank_keys(rank):
            state[local] = self.shards(key)[rank.tp]
        return state

    def _map(self, path: Path) -> None:
        """Note the ranges where `path` is mapped (after the mapping is made), for release()."""
        self._ranges += memory.file_mappings(path)

    def keys(self) -> list[str]:
        """Global keys in megatron-core order (a tied output copy appears once, on the last stage)."""
        return list(self._where)

    def source_key(self, key: str) -> str:
        """The tensor that holds a key of another layout (layout.source_key)."""
        return layout.source_key(key, self._where)

    def full(self, global_key: str, field: str | None = None):
        return shard_ops.join(global_key, self.shards(global_key, field), self.meta.spec, self.meta.pp_size)

    def release(self) -> None:
        """Drop the resident pages of every shard tensor handed out since the last call."""
        memory.release_pages(self._handed, self._ranges)
        self._handed.clear()

    def close(self) -> None:
        self._handed.clear()
        self._ranges.clear()

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for key in self.keys():
            yield key, self.full(key)


class ShardSet(Reader):
    """Per-rank shard files: our format (model and optimizer files per TP x PP rank)."""

    def __init__(self, meta: fmt.Meta):
        super().__init__(meta)
        self._files: dict[tuple[str, int, int], dict] = {}

    def path(self, kind: str, rank: Rank) -> Path:
        name = (fmt.model_file if kind == MODEL else fmt.optimizer_file)(rank)
        return self.meta.dir / name

    def _object(self, path: Path, rank: Rank):
        """A shard file's object as loaded (a form whose files hold several ranks' parts gives the rank's)."""
        return io.load_file(path)

    def _loaded(self, path: Path, kind: str, obj, rank: Rank) -> dict:
        """The object of a freshly loaded file, as the rest of the reader reads it (a form may rename keys or
        decode its optimizer state into ours)."""
        return obj

    def optimizer_extras(self) -> dict:
        """What an optimizer shard holds beside the per-parameter state (param groups, scheduler, scaler)."""
        if self.fresh_optimizer():
            return dict(fmt.FRESH_EXTRAS)
        return {k: v for k, v in self.file(OPTIMIZER, self.meta.grid.first).items() if k != OPTIMIZER}

    def fresh_optimizer(self) -> bool:
        """meta.json records the fresh optimizer of iteration 0, not written (its fp32 masters, where they carry more
        than the weights, are): `shards` makes each field from the weights."""
        return self.meta.fresh_optimizer

    def _optimizer_written(self, rank: Rank) -> bool:
        """Rank's optimizer file exists or meta.json records it (then a missing one is an error when read)."""
        path = self.path(OPTIMIZER, rank)
        return path.is_file() or path.name in self.meta.raw.get("files", {})

    def written_masters(self) -> set[str]:
        """The global keys whose fresh optimizer's fp32 master is written (it carries more than the weights)."""
        out = set()
        for rank in self.meta.grid.ranks():
            if self._optimizer_written(rank):
                state = self._state(OPTIMIZER, rank)
                out |= {key for local, key in self.meta.rank_keys(rank)
                        if isinstance(state.get(local), dict) and "master" in state[local]}
        return out

    def file(self, kind: str, rank: Rank) -> dict:
        """The whole (lazily mapped) object of one shard file."""
        slot = (kind, rank)
        if slot not in self._files:
            path = self.path(kind, rank)
            if not path.is_file():
                raise FormatError(f"{path}: missing shard ({rank}) of a {self.meta.grid} checkpoint: restore the file")
            self.check_size(path)
            obj = self._object(path, rank)
            if not isinstance(obj, dict) or not isinstance(obj.get(kind), dict):
                raise FormatError(f"{path}: holds no {kind!r} state dict: not a {kind} shard of this checkpoint; "
                                  f"restore it from the source checkpoint")
            self._files[slot] = self._loaded(path, kind, obj, rank)
            self._map(path)
        return self._files[slot]

    def check_size(self, path: Path) -> None:
        """The cheap integrity check every reader makes: the size meta.json recorded."""
        problem = fmt.size_problem(self.meta, path)
        if problem:
            raise FormatError(problem)

    def file_problems(self, team: Team = SOLO) -> tuple[int, list[str]]:
        files = self.meta.raw.get("files", {})
        owners = team.split([int(rec.get("size") or 0) for rec in files.values()])
        return len(files), fmt.check_files(self.meta, {n for n, o in zip(files, owners) if o == team.rank})

    def rng_state(self):
        path = self.meta.dir / fmt.rng_file(self.meta.grid.first)
        if not path.is_file():
            if path.name in self.meta.raw.get("files", {}):
                raise FormatError(f"{path}: missing, but meta.json records it: restore it from the source checkpoint")
            return None
        self.check_size(path)
        return io.load_file(path, mmap=False)

    def check_hashes(self, team: Team = SOLO) -> None:
        """The content hash of every file meta.json records (merge/reshard --check-hashes, verify tier 1)."""
        fmt.check_hashes(self.meta, team)

    def _state(self, kind: str, rank: Rank) -> dict:
        return self.file(kind, rank)[kind]

    def stage_state(self, rank: Rank) -> dict:
        state = dict(self._state(MODEL, rank))
        for local, key in self.meta.rank_keys(rank):
            if local not in state and not layout.holds_weights(key, self.meta.spec, self.meta.pp_size):
                state[local] = None  # a missing _extra_state holds no weights
        return state

    def shards(self, global_key: str, field: str | None = None) -> list:
        """The TP shards of one tensor, rank order; field picks optimizer state (master, exp_avg, ...)."""
        if global_key not in self._where:
            raise FormatError(f"{self.meta.dir}: no tensor {global_key} in this checkpoint's layout")
        if field is not None and self.fresh_optimizer():
            return self._fresh(global_key, field)
        pp_rank, local, ep_rank = self._where[global_key]
        kind = MODEL if field is None else OPTIMIZER
        out = []
        for rank in (r for r in self.meta.grid.ranks(pp_rank) if r.ep == ep_rank):
            state = self._state(kind, rank)
            if local not in state and field is None and \
                    not layout.holds_weights(global_key, self.meta.spec, self.meta.pp_size):
                out.append(None)  # a missing _extra_state holds no weights
                continue
            if local not in state:
                raise FormatError(f"{self.path(kind, rank)}: tensor {local} is missing: "
                                  f"the shard is incomplete; restore it from the source checkpoint")
            entry = state[local]
            if field is not None:
                if not isinstance(entry, dict) or field not in entry:
                    raise FormatError(f"{self.path(kind, rank)}: {local} has no {field!r} state: "
                                      f"the optimizer shard is incomplete")
                entry = entry[field]
            out.append(entry)
        self._handed += out
        return out

    def _fresh(self, global_key: str, field: str) -> list:
        """A fresh optimizer's field, shard by shard: the written fp32 master where there is one, else the weights in
        fp32; zero moments; step 0."""
        pp_rank, local, ep_rank = self._where[global_key]
        out = []
        for rank, weights in zip((r for r in self.meta.grid.ranks(pp_rank) if r.ep == ep_rank), self.shards(global_key)):
            written = self._state(OPTIMIZER, rank).get(local) if self._optimizer_written(rank) else None
            if field == "master":
                out.append(written["master"] if isinstance(written, dict) and "master" in written else weights.float())
            elif field == "step":
                out.append(torch.tensor(0.0))
            else:
                out.append(torch.zeros(weights.shape, dtype=torch.float32))
        self._handed += out
        return out

    def validate(self) -> list[str]:
        """Every model shard holds exactly its stage's keys, each of the layout table's shard shape and
        the recorded dtype; no shard files beyond the layout's. Problems as one-line messages."""
        meta, problems = self.meta, self._extra_files()
        for rank in meta.grid.ranks():
            try:
                state = self._state(MODEL, rank)
            except FormatError as e:
                problems.append(str(e))
                continue
            problems += fmt.shard_problems(meta, self.path(MODEL, rank), state, rank, torch.is_tensor)
        return problems

    def _extra_files(self) -> list[str]:
        return fmt.extra_shards(self.meta)

    def has_optimizer(self) -> bool:
        """Optimizer shards exist or meta.json records them (then a missing one is an error, not "no optimizer"), or
        meta.json records the fresh optimizer that is not written."""
        if self.fresh_optimizer():
            return True
        recorded = self.meta.raw.get("files", {})
        paths = [self.path(OPTIMIZER, rank) for rank in self.meta.grid.ranks()]
        return any(path.is_file() or path.name in recorded for path in paths)

    def close(self) -> None:
        self._files.clear()
        super().close()


def open_checkpoint(src: str | Path, vocab_size: int | None = None) -> Reader:
    """Our checkpoint dir or save dir, or a Megatron-LM checkpoint dir in any of its forms (then `vocab_size`
    may be needed): the reader of its form (forms/readers.py tells which)."""
    from ckpt_tools.forms import readers
    return readers.detect(src, sharded=True).reader(Path(src), vocab_size)


def open_ours(src: str | Path, vocab_size: int | None = None) -> ShardSet:
    """The reader of our checkpoint dir or save dir."""
    meta = fmt.Meta.read(fmt.resolve(src))
    if vocab_size is not None and vocab_size != meta.spec.vocab_size:
        raise FormatError(f"{meta.path}: records a true vocab of {meta.spec.vocab_size}, --vocab-size says "
                          f"{vocab_size}: drop --vocab-size (it is for inputs that do not record it)")
    return ShardSet(meta)


def open_checked(src: str | Path, vocab_size: int | None = None, check_hashes: bool = False,
                 team: Team = SOLO) -> Reader:
    """open_checkpoint, then refuse (before any output exists) a checkpoint whose shards do not
    match the layout table, and with `check_hashes` one whose files differ from meta.json."""
    from ckpt_tools.errors import collect
    shards = open_checkpoint(src, vocab_size)
    if check_hashes:
        shards.check_hashes(team)
    collect(shards.validate()[:5], FormatError)
    return shards
