"""The tests' reference writer of our format, through torch (what `ckpt reshard` and `ckpt import` wrote before
verbs/ours_copy.py wrote every reshard and import into our format): `Target` (its files, every TP rank's of a stage
open together, or one file at a time) and `finish` (carried files, meta.json, `latest`). Each file is hashed and
fsynced on a pool once it is closed.
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ckpt_tools import durable, io
from ckpt_tools.forms import checkpoint as fmt
from ckpt_tools.forms.shards import MODEL, OPTIMIZER_FIELDS
from ckpt_tools.forms.writers import TorchFileWriter
from ckpt_tools.model import hf, layout, shard_ops
from ckpt_tools.model.ranks import Grid, Rank
from ckpt_tools.model.spec import ModelSpec
from ckpt_tools.team import SOLO, Team


class Scratch:
    """One reused buffer for a tensor that is written as soon as it is made (a gathered shard, an fp32 master, a
    contiguous copy): no fresh pages to fault in per tensor, each fault a page zeroed by the kernel."""

    def __init__(self):
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The buffer as a tensor of this shape and dtype, valid until the next call."""
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self._buffer[:nbytes].view(dtype).view(shape)

    def contiguous(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """`t` (in `dtype`) contiguous: itself where it is, else copied into the buffer."""
        dtype = dtype or t.dtype
        if t.dtype == dtype and t.is_contiguous():
            return t
        out = self.empty(tuple(t.shape), dtype)
        out.copy_(t)
        return out


class Target:
    """One checkpoint in our format, written stage by stage with every TP rank's files open together."""

    def __init__(self, ckpt_dir: Path, spec: ModelSpec, tp: int, counts: list[int], padded: int, optimizer: bool,
                 ep: int = 1):
        self.dir, self.spec, self.tp, self.counts, self.padded, self.ep = ckpt_dir, spec, tp, counts, padded, ep
        self.mine: set[Rank] | None = None  # the ranks whose files this process writes (a team's share; None: all)
        self.pp = len(counts)
        self.optimizer = optimizer
        # hashes and fsyncs finished files while the next ones are written
        self._pool = ThreadPoolExecutor(min(8, max(2, os.cpu_count() or 2)))
        self._hashes: dict[str, Future] = {}  # file name (in the checkpoint dir) -> its meta.json record
        self._scratch = Scratch()
        self.nbytes = 0

    def begin_stage(self, pp_rank: int) -> None:
        self.pp_rank = pp_rank
        self._ranks = [r for r in Grid(self.tp, self.pp, self.ep).ranks(pp_rank)  # file order
                       if self.mine is None or r in self.mine]
        self._model = [self.open_file(fmt.model_file(rank)) for rank in self._ranks]
        self._model_state: list[dict] = [{} for _ in self._ranks]
        self._optim = [self.open_file(fmt.optimizer_file(rank)) for rank in self._ranks] if self.optimizer else []
        self._optim_state: list[dict] = [{} for _ in self._ranks]
        self._local = {}  # global key -> [(file index, file-local key)] of this stage's files
        for i, rank in enumerate(self._ranks):
            for local, key in layout.stage_keys(self.spec, self.counts, pp_rank, rank.ep, self.ep):
                self._local.setdefault(key, []).append((i, local))

    def open_file(self, name: str) -> TorchFileWriter:
        """A file of the checkpoint, hashed on the pool once it is closed (`close_file`)."""
        return TorchFileWriter(self.dir / name)

    def _split(self, key: str, full: torch.Tensor) -> list[torch.Tensor]:
        if layout.has_padded_rows(key, self.spec, self.pp) and full.shape[0] != self.padded:
            full = shard_ops.pad_vocab(key, full, self.spec, self.padded)
        return shard_ops.split(key, full, self.spec, self.tp, self.pp)

    def holds(self, key: str) -> bool:
        """Whether a file of this stage that this process writes holds `key`."""
        return key in self._local

    def _files(self, key: str) -> list[tuple[int, str, int]]:
        """(file index, file-local key, TP rank) of every file of this stage that holds `key` (an expert: the files of
        its EP rank; anything else: every EP rank's)."""
        return [(i, local, self._ranks[i].tp) for i, local in self._local[key]]

    def put(self, key: str, value: Any, master: bool | torch.Tensor = False) -> None:
        """One model tensor (full, TP=1; `key` global), split and written to every file that holds it; with `master`
        each shard's fp32 copy too, as the optimizer's master weight (a tensor: the master's own full values, where
        they carry more than the weights). A shard that is not contiguous, and the fp32 copy, are made in one reused
        buffer (each is written before the next is made): no fresh pages per tensor."""
        if not layout.holds_weights(key, self.spec, self.pp):
            for i, local, _ in self._files(key):
                self._model_state[i][local] = value
            return
        shards = self._split(key, value)
        masters = self._split(key, master) if torch.is_tensor(master) else shards
        for i, local, t in self._files(key):
            self._model_state[i][local] = self._model[i].tensor(self._scratch.contiguous(shards[t]))
            if master is not False:
                self._optim_state[i].setdefault(local, {})["master"] = \
                    self._optim[i].tensor(self._scratch.contiguous(masters[t], torch.float32))

    def put_state(self, key: str, field: str, value: torch.Tensor) -> None:
        """One optimizer field of a parameter: a full tensor (exp_avg, exp_avg_sq), or the replicated step. Fields
        come one at a time, so one full tensor is in memory, not four."""
        shards = [value] * self.tp if field == "step" else self._split(key, value)
        for i, local, t in self._files(key):
            self._optim_state[i].setdefault(local, {})[field] = self._optim[i].tensor(shards[t])

    def end_stage(self, optimizer_extras: dict) -> None:
        for i in range(len(self._ranks)):
            self.close_file(self._model[i], {"model": self._model_state[i]})
            if self.optimizer:
                self.close_file(self._optim[i], {"optimizer": self._optim_state[i], **optimizer_extras})

    def close_file(self, writer: TorchFileWriter, obj: dict) -> None:
        """Close a file of open_file(), then hash and fsync it on the pool."""
        writer.close(obj, fsync=False)
        self.nbytes += writer.path.stat().st_size
        self.add_file(writer.path)

    def add_file(self, path: Path) -> None:
        """Hash and fsync a finished file written otherwise (carried along, copied) in the background; `records()`
        waits for all of them."""
        self._hashes[path.relative_to(self.dir).as_posix()] = self._pool.submit(_record_and_sync, path)

    def records(self) -> dict[str, dict]:
        out = {name: fut.result() for name, fut in sorted(self._hashes.items())}
        self._pool.shutdown()
        return out

    def file_bytes(self, rank: Rank, kind: str, itemsize: int) -> int:
        """About the bytes of one of its files (model tensors of `itemsize`, or their fp32 master and moments): what
        a team balances."""
        numel = layout.rank_numel(self.spec, self.counts, self.padded, self.tp, rank.pp, rank.ep, self.ep)
        return numel * (itemsize if kind == MODEL else 4 * len(OPTIMIZER_FIELDS))

    def share(self, team: Team, kinds: tuple[str, ...], itemsize: int) -> list[tuple[str, Rank]]:
        """The (kind, rank) files this process writes, in the order one process writes them all; sets `mine`."""
        files = [(kind, rank) for kind in kinds for rank in Grid(self.tp, self.pp, self.ep).ranks()]
        owners = team.split([self.file_bytes(rank, kind, itemsize) for kind, rank in files])
        mine = [f for f, owner in zip(files, owners) if owner == team.rank]
        self.mine = {rank for _, rank in mine}
        return mine


def _record_and_sync(path: Path) -> dict:
    """The file's record for meta.json, then its fsync."""
    record = fmt.file_record(path)
    durable.fsync_file(path)
    return record


def finish(tmp: Path, iteration: int, target: Target, meta: dict, carried_from: Path | None,
            hf_dir: bool = False, team: Team = SOLO) -> int:
    """Tokenizer, chat templates, generation and HF config carried along; meta.json (the records of every process's
    files); `latest`. The bytes of the shard files, every process's."""
    ckpt = target.dir
    for f in hf.copy_carried(carried_from, ckpt, hf_dir) if team.lead and carried_from is not None else []:
        target.add_file(f)
    shared = team.share(lambda: (target.records(), target.nbytes), to_lead=True)
    if team.lead:
        meta["files"] = dict(sorted((name, r) for records, _ in shared for name, r in records.items()))
        fmt.write_meta(ckpt / fmt.META, meta)
        durable.fsync_dir(ckpt)
        io.write_text_atomic(tmp / fmt.LATEST, fmt.checkpoint_name(iteration) + "\n")
        return sum(nbytes for _, nbytes in shared)
    return 0  # process 0 says the total
