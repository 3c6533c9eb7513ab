"""Writing Megatron-LM checkpoints that Megatron-LM loads (`--format torch_dist | torch`).

    OUT/latest_checkpointed_iteration.txt    "release"
    OUT/release/  torch_dist: metadata.json, common.pt ({args, checkpoint_version, iteration}), .metadata, and one
                  __<rank>_0.distcp per TP x PP rank holding that rank's chunks (each a torch.save archive)
                  torch:      mp_rank_TT[_PPP]/model_optim_rng.pt ({args, checkpoint_version, iteration, model})

The weights only, as a `release` checkpoint: Megatron-LM loads it as a pretrained model (iteration 0, a fresh
optimizer, no RNG state) with no extra flags, whatever TP x PP the run uses for torch_dist, at the written one for
torch. With optimizer state (torch_dist only): `iter_NNNNNNN/` at the source's iteration, the fp32 masters and
Adam's moments in the distributed optimizer's `fully_reshardable` form beside the weights, and what resuming needs
in common.pt (formats/megatron_resume.py); no RNG state (args.no_save_rng, so Megatron-LM does not ask for it).

torch_dist keys are megatron-core's `sharded_state_dict` keys (layers stacked on a leading axis, norms in
Transformer Engine's names, a SwiGLU fc1 as two chunks per rank, a tied output layer saved only as the embedding,
each linear layer's `_extra_state` as one object per layer); the legacy form has the local spec's state dict
per rank, for `--transformer-impl local`. What goes where is the layout table's split (`layout.reshard_pieces`
from TP 1), the same plan the reader (formats/torch_dist.py) reads with.
"""
from __future__ import annotations

import argparse
import io as _io
import json
import os
import pickle
from pathlib import Path

import torch

from ckpt_tools import layout, megatron_lm
from ckpt_tools.formats import megatron_resume
from ckpt_tools.formats.torch_dist import stacked_key
from ckpt_tools.ranks import TP, Grid, Rank
from ckpt_tools.spec import ModelSpec
from ckpt_tools.writers import TorchFileWriter

TORCH, TORCH_DIST = megatron_lm.TORCH, megatron_lm.TORCH_DIST
FORMS = (TORCH_DIST, TORCH)
CHECKPOINT_VERSION = 3.0
DIST_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                 "common_backend_version": 1}


class DistWriter:
    """The torch_dist files: chunks streamed into one .distcp per rank, the index (.metadata) written last."""

    def __init__(self, iter_dir: Path, spec: ModelSpec, tp: int, counts: list[int], padded: int,
                 args: argparse.Namespace):
        self.dir, self.spec, self.tp, self.counts, self.padded, self.args = iter_dir, spec, tp, counts, padded, args
        self.pp = len(counts)
        self._files: dict[Rank, object] = {}
        self._tensors: dict[str, tuple[torch.dtype, tuple[int, ...], list]] = {}  # fqn -> dtype, shape, chunks
        self._objects: dict[str, tuple[str, int, int]] = {}  # fqn -> (file, offset, length)
        self.nbytes = 0

    def _file(self, rank: Rank):
        if rank not in self._files:
            name = f"__{rank.pp * self.tp + rank.tp}_0.distcp"  # the saving process's global rank
            self._files[rank] = (name, open(self.dir / name, "wb"))  # noqa: SIM115 (closed per stage)
        return self._files[rank]

    def _write(self, rank: Rank, blob) -> tuple[str, int, int]:
        name, f = self._file(rank)
        start = f.tell()
        if torch.is_tensor(blob):
            torch.save(blob, f)
        else:
            f.write(blob)
        return name, start, f.tell() - start

    def put(self, rank: Rank, key: str, shard: torch.Tensor, field: str | None = None) -> None:
        """`rank`'s shard of global key `key` (or of its optimizer `field`: master, exp_avg, exp_avg_sq), as the
        chunks of the stored global tensor."""
        spec = self.spec
        if key == "output_layer.weight" and spec.tie_word_embeddings:
            return  # megatron-core saves the tied output layer (and its optimizer state) only as the embedding
        rule = layout.find_rule(key, spec, self.pp)
        if TP not in rule.axes and rank.tp > 0:
            return  # replicated over TP: TP rank 0's copy is the one saved
        fqn, layer = stacked_key(key)
        if field is not None:
            fqn = megatron_resume.state_key(field, fqn)
        full = layout.full_shape(key, spec, self.padded, self.pp)
        pieces = layout.reshard_pieces(key, spec, 1, self.padded, self.tp, self.padded, rank.tp, self.pp)
        lead = () if layer is None else (layer,)
        shape = full if layer is None else (spec.num_layers,) + full
        dtype, _, chunks = self._tensors.setdefault(fqn, (shard.dtype, shape, []))
        at = 0
        for p in pieces:
            length = p.stop - p.start
            part = shard.narrow(p.dim, at, length) if len(pieces) > 1 else shard
            at += length
            offsets = lead + tuple(p.start if d == p.dim else 0 for d in range(len(full)))
            sizes = (1,) * len(lead) + tuple(length if d == p.dim else n for d, n in enumerate(full))
            data = part.contiguous()
            if data.untyped_storage().nbytes() != data.nbytes:
                data = data.clone()  # torch.save writes a view's whole storage
            where = self._write(rank, data.view(sizes))
            chunks.append((offsets, sizes, where))
            self.nbytes += data.nbytes

    def put_extra(self, pp_rank: int, key: str) -> None:
        """A layer's `_extra_state` (None for megatron-core's own layers): one object per layer, TP rank 0's."""
        fqn, layer = stacked_key(key)
        if layer is None:
            return  # the output layer's extra state is not part of megatron-core's sharded state dict
        buf = _io.BytesIO()
        torch.save([None], buf)  # megatron-core stores an object as the list of its (one) local values
        self._objects[f"{fqn}/shard_{layer}_{self.spec.num_layers}"] = self._write(Rank(0, pp_rank), buf.getvalue())

    def end_stage(self, pp_rank: int, iteration: int) -> None:
        for rank in Grid(self.tp, self.pp).ranks(pp_rank):
            if rank in self._files:
                _, f = self._files.pop(rank)
                f.flush()
                os.fsync(f.fileno())
                f.close()

    def close(self, iteration: int, common: dict | None = None) -> None:
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                           MetadataIndex, TensorProperties, TensorStorageMetadata)
        state, storage = {}, {}
        for fqn, (dtype, shape, chunks) in self._tensors.items():
            state[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype), size=torch.Size(shape),
                chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _ in chunks])
            for o, _, (name, offset, length) in chunks:
                storage[MetadataIndex(fqn=fqn, offset=torch.Size(o), index=None)] = _StorageInfo(name, offset, length)
        for fqn, (name, offset, length) in self._objects.items():
            state[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn=fqn, offset=None, index=None)] = _StorageInfo(name, offset, length)
        (self.dir / ".metadata").write_bytes(pickle.dumps(
            Metadata(state_dict_metadata=state, planner_data=None, storage_data=storage)))
        torch.save({"args": self.args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                    **(common or {})}, self.dir / "common.pt")
        (self.dir / "metadata.json").write_text(json.dumps(DIST_METADATA))


class LegacyWriter:
    """The torch form: each rank's model_optim_rng.pt, streamed tensor by tensor (every TP rank of a stage at once)."""

    def __init__(self, iter_dir: Path, spec: ModelSpec, tp: int, counts: list[int], padded: int,
                 args: argparse.Namespace):
        self.dir, self.spec, self.tp, self.counts, self.args = iter_dir, spec, tp, counts, args
        self.pp = len(counts)
        self._writers: dict[Rank, TorchFileWriter] = {}
        self._state: dict[Rank, dict] = {}
        self._local: dict[tuple[int, str], str] = {}
        self.nbytes = 0

    def _writer(self, rank: Rank) -> TorchFileWriter:
        if rank not in self._state:
            path = megatron_lm.model_path(self.dir, rank, self.pp)
            path.parent.mkdir(parents=True)
            self._writers[rank] = TorchFileWriter(path)
            self._state[rank] = {}
            for local, key in layout.stage_keys(self.spec, self.counts, rank.pp):
                self._local[rank.pp, key] = local
        return self._writers[rank]

    def put(self, rank: Rank, key: str, shard: torch.Tensor) -> None:
        ref = self._writer(rank).tensor(shard)
        self._state[rank][self._local[rank.pp, key]] = ref
        self.nbytes += shard.nbytes

    def put_extra(self, pp_rank: int, key: str) -> None:
        for rank in Grid(self.tp, self.pp).ranks(pp_rank):
            self._writer(rank)
            self._state[rank][self._local[pp_rank, key]] = None

    def end_stage(self, pp_rank: int, iteration: int) -> None:
        for rank in Grid(self.tp, self.pp).ranks(pp_rank):
            writer = self._writers.pop(rank)
            writer.close({"args": self.args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
                          "model": self._state.pop(rank)})

    def close(self, iteration: int, common: dict | None = None) -> None:
        pass


def writer_for(form: str, iter_dir: Path, spec: ModelSpec, tp: int, counts: list[int], padded: int,
               args: argparse.Namespace):
    return (DistWriter if form == TORCH_DIST else LegacyWriter)(iter_dir, spec, tp, counts, padded, args)
