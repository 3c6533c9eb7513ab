"""Writing Megatron-LM's legacy torch form (`--format torch`): each rank's `mp_rank_TT[_PPP]/model_optim_rng.pt`
({args, checkpoint_version, iteration, model}), the local spec's state dict per rank, for `--transformer-impl local`;
an interleaved pipeline's model chunks `model<v>` in each PP rank's file. Its form's record (forms/forms.py) gives it.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt_tools.forms import megatron_lm
from ckpt_tools.forms.megatron_write import CHECKPOINT_VERSION, with_torch_globals
from ckpt_tools.model import layout
from ckpt_tools.model.ranks import Grid, Rank
from ckpt_tools.model.spec import ModelSpec
from ckpt_tools.team import SOLO, Team

if TYPE_CHECKING:
    import torch

    from ckpt_tools.forms.writers import TorchFileWriter


class LegacyWriter:
    """The torch form: each rank's model_optim_rng.pt, streamed tensor by tensor (every TP rank of a stage at once).
    With an interleaved pipeline (args.virtual_pipeline_model_parallel_size > 1) the writer's ranks are the virtual
    stages: stage s is model chunk `model<s // PP>` of PP rank s % PP's file, closed after its last chunk."""

    def __init__(self, iter_dir: Path, spec: ModelSpec, tp: int, counts: list[int], padded: int,
                 args: argparse.Namespace):
        self.dir, self.spec, self.tp, self.counts = iter_dir, spec, tp, counts
        self.args = with_torch_globals(args)  # pickled by pickle itself, which needs the real torch.<dtype>
        self.pp, self.ep = len(counts), args.expert_model_parallel_size or 1  # a dir per EP rank where EP > 1
        self.vpp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
        self._writers: dict[Rank, TorchFileWriter] = {}  # by the rank of the file
        self._state: dict[Rank, dict] = {}  # the file's model chunks
        self._local: dict[tuple[Rank, str], str] = {}
        self.nbytes = 0  # of the tensors this process writes; after close(), every process's
        self._mine: set[Rank] | None = None
        self.team = SOLO

    def only_ranks(self, ranks: set[Rank], team: Team) -> LegacyWriter:
        """Write these ranks' files only (a team's share; the others' tensors are never given)."""
        self._mine, self.team = ranks, team
        return self

    def _ranks(self, pp_rank: int) -> list[Rank]:
        return [r for r in Grid(self.tp, self.pp, self.ep).ranks(pp_rank) if self._mine is None or r in self._mine]

    def _file(self, rank: Rank) -> Rank:
        """The rank of the file holding a (virtual) stage's rank."""
        return Rank(rank.tp, rank.pp % (self.pp // self.vpp), rank.ep)

    def _model(self, rank: Rank) -> dict:
        """The model chunk of a (virtual) stage's rank, in its file's state; the file opened at its first chunk."""
        file, name = self._file(rank), megatron_lm.chunk_name(rank.pp // (self.pp // self.vpp), self.vpp)
        if file not in self._state:
            path = megatron_lm.model_path(self.dir, file, self.pp // self.vpp)
            path.parent.mkdir(parents=True)
            from ckpt_tools.forms.writers import TorchFileWriter
            self._writers[file] = TorchFileWriter(path)
            self._state[file] = {}
        if name not in self._state[file]:
            self._state[file][name] = {}
            for local, key in layout.stage_keys(self.spec, self.counts, rank.pp, rank.ep, self.ep):
                self._local[rank, key] = local  # experts under this EP rank's local indices
        return self._state[file][name]

    def weights_from_masters(self, key: str) -> bool:
        return False

    def put(self, rank: Rank, key: str, shard: torch.Tensor) -> None:
        model = self._model(rank)
        model[self._local[rank, key]] = self._writers[self._file(rank)].tensor(shard)
        self.nbytes += shard.nbytes

    def put_extra(self, pp_rank: int, key: str) -> None:
        for rank in self._ranks(pp_rank):
            model = self._model(rank)
            if (rank, key) in self._local:  # an expert's extra state: its EP rank's files only
                model[self._local[rank, key]] = None

    def end_stage(self, pp_rank: int, iteration: int) -> None:
        if pp_rank // (self.pp // self.vpp) != self.vpp - 1:
            return  # the file holds later chunks too
        for rank in self._ranks(pp_rank):
            file = self._file(rank)
            writer = self._writers.pop(file)
            writer.close({"args": self.args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                          **self._state.pop(file)})

    def close(self, iteration: int, common: dict | None = None) -> None:
        shared = self.team.share(lambda: self.nbytes, to_lead=True)
        self.nbytes = sum(shared) if self.team.lead else 0  # process 0 says the total

    def __enter__(self) -> LegacyWriter:
        return self

    def __exit__(self, *exc) -> None:
        self._writers.clear()  # unclosed archives of a failed write go with the staged output
