"""Writing Megatron-LM checkpoints that Megatron-LM loads (`--format torch_dist | torch`).

    OUT/latest_checkpointed_iteration.txt    "release"
    OUT/release/  torch_dist: metadata.json, common.pt ({args, checkpoint_version, iteration}), .metadata, and one
                  __<rank>_0.distcp per TP x PP rank holding that rank's chunks (each a torch.save archive)
                  torch:      mp_rank_TT[_PPP]/model_optim_rng.pt ({args, checkpoint_version, iteration, model})

The weights only, as a `release` checkpoint: Megatron-LM loads it as a pretrained model (iteration 0, a fresh
optimizer, no RNG state) with no extra flags, whatever TP x PP the run uses for torch_dist, at the written one for
torch. With optimizer state (torch_dist only): `iter_NNNNNNN/` at the source's iteration, the fp32 masters and
Adam's moments in the distributed optimizer's `fully_reshardable` form beside the weights, and what resuming needs
in common.pt (forms/megatron_resume.py); no RNG state (args.no_save_rng, so Megatron-LM does not ask for it).

torch_dist keys are megatron-core's `sharded_state_dict` keys (layers stacked on a leading axis, norms in
Transformer Engine's names, a SwiGLU fc1 as two chunks per rank, a tied output layer saved only as the embedding,
each linear layer's `_extra_state` as one object per layer); the legacy form has the local spec's state dict
per rank, for `--transformer-impl local`. What goes where is the layout table's split (`shard_ops.reshard_pieces`
from TP 1), the same plan the reader (forms/torch_dist.py) reads with.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from ckpt_tools import durable
from ckpt_tools.errors import LayoutError
from ckpt_tools.forms import megatron_resume, torchsave
from ckpt_tools.forms.dtypes import ELEMENT_SIZES
from ckpt_tools.forms.torch_dist_names import Placed, part_of, stored_candidates, te_alias, te_norm_extra
from ckpt_tools.model import hybrid, layout, shard_ops
from ckpt_tools.model.ranks import TP, Rank
from ckpt_tools.model.spec import ModelSpec
from ckpt_tools.team import SOLO, Team

CHECKPOINT_VERSION = 3.0
WRITEBACK = 32 << 20  # bytes written to a .distcp between two starts of its writeback
DIST_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                 "common_backend_version": 1}


DCP = "torch.distributed.checkpoint.metadata"


class DistWriter:
    """The torch_dist files: chunks streamed into one .distcp per saving rank, the index (.metadata) written last.

    Torch-free (ckpt_tools.forms.torchsave writes the archives and pickles): `put_chunk` takes a chunk's bytes, from
    memory or as byte ranges of other files copied in the kernel. `put` takes a target rank's shard as a tensor
    (the callers that made it have torch) and puts its chunks.
    """

    def __init__(self, iter_dir: Path, spec: ModelSpec, tp: int, counts: list[int], padded: int,
                 args: argparse.Namespace, saving_tp: int | None = None, saving_ep: int = 1):
        """`saving_tp`, `saving_ep`: the TP and EP sizes of the ranks that save the chunks, where they are not the
        target's (chunks copied from a source's shards are saved by the source's ranks); they number the .distcp
        files."""
        self.dir, self.spec, self.tp, self.counts, self.padded, self.args = iter_dir, spec, tp, counts, padded, args
        self.pp = len(counts)
        self.by_pattern = hybrid.pattern_of(args) is not None  # a HybridModel's keys: one per layer index
        self._saving_tp, self._saving_ep = saving_tp or tp, saving_ep
        self._files: dict[Rank, list] = {}  # rank -> [file name, fd, end, end at the last writeback start]
        self._tensors: dict[str, tuple[str, tuple[int, ...], list]] = {}  # fqn -> dtype, global shape, chunks
        self._objects: dict[str, tuple[str, int, int]] = {}  # fqn -> (file, offset, length)
        self._opened: set[str] = set()  # the .distcp files this process writes
        self._workers: dict[str, durable.FileWorker] = {}  # each open .distcp's copies and writeback, on its own thread
        self._ending: list[tuple[durable.FileWorker, int]] = []  # ended files: fsync submitted, the fd closed at close()
        self.nbytes = 0  # of the chunks this process writes; after close(), every process's
        self.writes: set[str] | None = None  # the .distcp files this process writes (None: all it is given)
        self.team, self.dry = SOLO, False
        self._normed = False  # whether the norms' extra states are written
        self.ends: dict[str, int] = {}  # each .distcp's size, once it is ended

    def only(self, names: set[str] | None, team: Team = SOLO, dry: bool = False) -> DistWriter:
        """Write these .distcp files (None: every file given chunks) and only count the others (their sizes and
        chunks' places); `team`: the processes writing the rest, whose index entries process 0 gathers at close;
        `dry`: a pass that only counts (every file's size, in `ends`), writing nothing at all."""
        self.writes, self.team, self.dry = (set() if dry else names), team, dry
        return self

    def writes_rank(self, rank: Rank) -> bool:
        return self.writes is None or self._name(rank) in self.writes

    def _name(self, rank: Rank) -> str:
        # the saving process's global rank (TP fastest, then EP over the data-parallel ranks, then PP); EP rank 0
        # saves what a layout without EP saves
        return f"__{rank.tp + self._saving_tp * ((rank.ep or 0) + self._saving_ep * rank.pp)}_0.distcp"

    def _file(self, rank: Rank) -> list:
        rank = Rank(rank.tp, rank.pp, rank.ep or None)
        if rank not in self._files:
            name = self._name(rank)
            fd = os.open(self.dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644) \
                if self.writes is None or name in self.writes else None
            self._files[rank] = [name, fd, 0, 0]  # name, fd (None: counted only), end, end at the last writeback
            if fd is not None:
                self._opened.add(name)
                self._workers[name] = durable.FileWorker()
        return self._files[rank]

    def _written(self, entry: list) -> None:
        """Start the writeback of what was written since the last start, every WRITEBACK bytes: the disk writes
        overlap the copying, and the stage's final fsync has little left to wait for."""
        if entry[1] is not None and entry[2] - entry[3] >= WRITEBACK:
            self._workers[entry[0]].writeback(entry[1], entry[3], entry[2] - entry[3])
            entry[3] = entry[2]

    def put_chunk(self, rank: Rank, fqn: str, dtype: str, shape: tuple[int, ...], offsets: tuple[int, ...],
                  sizes: tuple[int, ...], data: torchsave.Data) -> None:
        """One chunk of the global tensor `fqn` (dtype name, global shape): its `sizes` at `offsets`, its bytes
        (row-major) `data`, into the .distcp of the rank that saves it."""
        entry = self._file(rank)
        name, fd, start, _ = entry
        entry[2] = torchsave.save_tensor(fd, start, dtype, sizes, data,
                                         self._workers[name].copy if fd is not None else durable.copy_range)
        self._written(entry)
        known = self._tensors.setdefault(fqn, (dtype, tuple(shape), []))
        if known[:2] != (dtype, tuple(shape)):
            raise LayoutError(f"{fqn}: a chunk of a {dtype} {tuple(shape)} tensor, earlier ones of a {known[0]} "
                              f"{known[1]} one")
        known[2].append((tuple(offsets), tuple(sizes), (name, start, entry[2] - start)))
        if fd is not None:
            self.nbytes += math.prod(sizes) * ELEMENT_SIZES[dtype]

    def put_object(self, rank: Rank, fqn: str, obj) -> None:
        """An object entry (torch.save of `obj`)."""
        entry = self._file(rank)
        name, fd, start, _ = entry
        entry[2] = torchsave.save_object(fd, start, obj)
        self._objects[fqn] = (name, start, entry[2] - start)

    def entry(self, fqn: str, field: str | None) -> str:
        """The stored name of a tensor's entry (`fqn`, as `stored` gives it), or of its optimizer `field`'s."""
        return fqn if field is None else megatron_resume.state_key(field, fqn)

    def weights_from_masters(self, key: str) -> bool:
        """Whether the fp32 master of `key` stands for its weights (not given them: Megatron-FSDP's main weights)."""
        return False

    def saves(self, key: str, rank: Rank) -> bool:
        """Whether `rank` saves (a part of) key: megatron-core saves an aliased row (a tied output layer) and its
        optimizer state only as the tensor it copies, and a tensor replicated over TP from TP rank 0."""
        if layout.alias_of(key, self.spec):
            return False
        return TP in layout.find_rule(key, self.spec, self.pp).axes or rank.tp == 0

    def stored(self, key: str) -> tuple[str, Placed]:
        """The key of a layout-table key in megatron-core's sharded state dict, and its place on the stacked leading
        axes (GPTModel: layer, expert; HybridModel: an MoE layer's expert)."""
        return stored_candidates(key, self.spec, self.by_pattern)[0]

    def placed(self, key: str, fqn: str, layer: Placed, full: tuple[int, ...], p: shard_ops.Piece,
               field: str | None = None) -> tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(stored tensor, offsets, sizes, global shape) of the chunk holding piece `p` of the full tensor of `key`,
        stored as `fqn` (its `entry`; layer: its (index, size) on the stacked leading axes, as `stored` gives it;
        `field`: the optimizer field it holds, None for the weights). A tensor megatron-core saves in parts (Mamba's
        in_proj, conv1d): the piece's part, `<fqn>.<part>`."""
        name, start, size = part_of(key, self.spec, full, p.dim, p.start, p.stop)
        full = tuple(size if d == p.dim else n for d, n in enumerate(full))
        lead = tuple(i for i, _ in layer)
        shape = tuple(n for _, n in layer) + full
        offsets = lead + tuple(start if d == p.dim else 0 for d in range(len(full)))
        sizes = (1,) * len(lead) + tuple(p.stop - p.start if d == p.dim else n for d, n in enumerate(full))
        return (f"{fqn}.{name}" if name else fqn), offsets, sizes, shape

    def alias(self, fqn: str) -> str | None:
        """A second index entry over a stored tensor's bytes, the name the other spec loads it by (None: none)."""
        return te_alias(fqn, self.spec, self.by_pattern)

    def put_extra(self, pp_rank: int, key: str) -> None:
        """A layer's `_extra_state` (None for megatron-core's own layers): one object per layer, TP rank 0's."""
        if layout.layer_index(key) is None and layout.mtp_index(key) is None and not self.by_pattern:
            return  # GPTModel's sharded state dict holds no output layer's extra state (HybridModel's does)
        self._put_none_object(pp_rank, *self.stored(key))

    def _put_none_object(self, pp_rank: int, fqn: str, layer: Placed) -> None:
        """An `_extra_state` object `fqn` holding None (what megatron-core's own layers save, and what Transformer
        Engine's layers load as "no FP8 metadata"). megatron-core stores an object as the list of its (one) local
        values, named by its place on the stacked axes: shard_<layer>_<layers>, an expert's
        shard_<layer>.<expert>_<layers>.<experts>; a HybridModel's layer (one key per index) shard_0_1, its expert's
        shard_<expert>_<experts>."""
        where = ".".join(str(i) for i, _ in layer) or "0", ".".join(str(n) for _, n in layer) or "1"
        self.put_object(Rank(0, pp_rank), f"{fqn}/shard_{where[0]}_{where[1]}", [None])

    def put_norm_extras(self, pp_rank: int) -> None:
        """Each norm that is a module of its own under Transformer Engine's spec holds an `_extra_state` that a
        Transformer Engine model asks for when it loads (torch_dist_names.te_norm_extra): megatron-core's load fails on
        an entry it asks for and does not find. One None object each, as for a linear layer, all into the first stage
        file that ends (the index says where each is: a byte-copying writer's files are the source's, whose stages
        need not be the target's). megatron-core's local spec asks for none: an entry not asked for is no error under
        its default strictness (Megatron-LM's --dist-ckpt-strictness assume_ok_unexpected)."""
        if self._normed:
            return
        self._normed = True
        for _, key in (k for p in range(len(self.counts)) for k in layout.stage_keys(self.spec, self.counts, p)):
            if key.endswith("norm.weight"):
                fqn, layer = self.stored(key)
                for name in {fqn, self.alias(fqn)} - {None}:
                    if (extra := te_norm_extra(name, self.spec)) is not None:
                        self._put_none_object(pp_rank, extra, layer)

    def end_stage(self, pp_rank: int, iteration: int) -> None:
        """The stage's files are complete: each is fsynced on its thread once its copies are done (the next stage's
        files fill meanwhile); close() waits for them. The first stage to end also takes every norm's extra state
        (put_norm_extras)."""
        if any(r.pp == pp_rank for r in self._files):
            self.put_norm_extras(pp_rank)
        for rank in [r for r in self._files if r.pp == pp_rank]:
            name, fd, end, _ = self._files.pop(rank)
            self.ends[name] = end
            if fd is not None:
                worker = self._workers.pop(name)
                worker.submit(os.fsync, fd)
                self._ending.append((worker, fd))

    def _finish_files(self) -> None:
        """Wait for every ended file's copies and fsync; close them (the first error raised after all are closed)."""
        error = None
        while self._ending:
            worker, fd = self._ending.pop(0)
            try:
                worker.finish()
            except BaseException as e:  # noqa: BLE001 - raised once every file is closed
                error = error or e
            os.close(fd)
        if error is not None:
            raise error

    def __enter__(self) -> DistWriter:
        return self

    def __exit__(self, *exc) -> None:
        """Close every .distcp still open (a write that failed: the staged output is removed), once its thread has
        stopped writing."""
        for worker in [*self._workers.values(), *(w for w, _ in self._ending)]:
            worker.abandon()
        for fd in [fd for _, fd, _, _ in self._files.values()] + [fd for _, fd in self._ending]:
            if fd is not None:
                os.close(fd)
        self._files.clear()
        self._workers.clear()
        self._ending.clear()

    def close(self, iteration: int, common: dict | None = None) -> None:
        for pp_rank in sorted({r.pp for r in self._files}):
            self.end_stage(pp_rank, iteration)
        if self.dry:
            return
        if self.team.size > 1:  # a failed copy is said before the team gathers the index
            self._finish_files()
        tensors, objects = self._gathered_index()
        if not self.team.lead:
            return
        state, storage = {}, []
        for fqn, (dtype, shape, chunks) in tensors.items():  # each entry pickled as it is made: bytes, not objects
            state[fqn] = torchsave.pickled(_tensor_metadata(dtype, shape, [(o, s) for o, s, _ in chunks]))
            storage += [(torchsave.pickled(_index(fqn, o)), torchsave.pickled(_storage(*where)))
                        for o, _, where in chunks]
        for fqn, where in objects.items():
            state[fqn] = torchsave.New(torchsave.Global(DCP, "BytesStorageMetadata"))
            storage.append((_index(fqn, None), _storage(*where)))
        metadata = torchsave.New(torchsave.Global(DCP, "Metadata"), {
            "state_dict_metadata": state, "planner_data": None, "storage_data": torchsave.Items(storage),
            "storage_meta": None, "version": None})
        durable.write_bytes_durable(self.dir / ".metadata", torchsave.dumps(metadata))
        self.write_common(iteration, common)
        self._finish_files()  # the index was written while the last files' copies ran
        durable.fsync_dir(self.dir)  # the files' names too, before the staged dir is renamed into place

    def write_common(self, iteration: int, common: dict | None) -> None:
        """dist_checkpointing's files beside the index: common.pt (args, iteration, ...) and metadata.json."""
        _save_common(self.dir / "common.pt", {"args": self.args, "checkpoint_version": CHECKPOINT_VERSION,
                                               "iteration": iteration, **(common or {})})
        durable.write_bytes_durable(self.dir / "metadata.json", json.dumps(DIST_METADATA).encode())

    def _gathered_index(self) -> tuple[dict, dict]:
        """Every process's chunks and objects in the files it wrote, gathered by process 0 (whose `nbytes` becomes
        the team's; the others get nothing): each tensor's chunks in order of their offsets and the tensors and
        objects in the order of their names, the same index however the files were shared out."""
        mine = self._opened
        tensors = {fqn: (dtype, shape, [c for c in chunks if c[2][0] in mine])
                   for fqn, (dtype, shape, chunks) in self._tensors.items()}
        objects = {fqn: where for fqn, where in self._objects.items() if where[0] in mine}
        shared = self.team.share(lambda: ({f: t for f, t in tensors.items() if t[2]}, objects, self.nbytes),
                                 to_lead=True)
        if not self.team.lead:
            return {}, {}
        self.nbytes = sum(n for _, _, n in shared)
        merged: dict[str, tuple[str, tuple[int, ...], list]] = {}
        for part, _, _ in shared:
            for fqn, (dtype, shape, chunks) in part.items():
                known = merged.setdefault(fqn, (dtype, shape, []))
                if known[:2] != (dtype, shape):
                    raise LayoutError(f"{fqn}: chunks of a {dtype} {shape} tensor and of a {known[0]} {known[1]} one")
                known[2].extend(chunks)
        aliases = {self.alias(fqn): t for fqn, t in merged.items()}  # either spec loads its norms
        merged.update({fqn: t for fqn, t in aliases.items() if fqn is not None})
        tensors = {fqn: (d, s, sorted(c)) for fqn, (d, s, c) in sorted(merged.items())}
        return tensors, dict(sorted(kv for _, part, _ in shared for kv in part.items()))


def _tensor_metadata(dtype: str, shape: tuple[int, ...], chunks: list) -> torchsave.New:
    """torch.distributed.checkpoint's TensorStorageMetadata of one global tensor, as a pickle stand-in."""
    g = torchsave.Global
    properties = torchsave.New(g(DCP, "TensorProperties"), (  # its __setstate__ takes this tuple
        torchsave.dtype_global(dtype), torchsave.Call(g("torch.serialization", "_get_layout"), ("torch.strided",)),
        False, torchsave.Call(g(DCP, "_MEM_FORMAT_ENCODING"), (0,)), False))
    return torchsave.New(g(DCP, "TensorStorageMetadata"), {
        "properties": properties, "size": torchsave.size(shape),
        "chunks": [torchsave.New(g(DCP, "ChunkStorageMetadata"), {"offsets": torchsave.size(o),
                                                                   "sizes": torchsave.size(s)}) for o, s in chunks]})


def _index(fqn: str, offsets: tuple[int, ...] | None) -> torchsave.New:
    return torchsave.New(torchsave.Global(DCP, "MetadataIndex"), {
        "fqn": fqn, "offset": None if offsets is None else torchsave.size(offsets), "index": None})


def _storage(name: str, offset: int, length: int) -> torchsave.New:
    return torchsave.New(torchsave.Global("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                         {"relative_path": name, "offset": offset, "length": length})


def _save_common(path: Path, obj: dict) -> None:
    """common.pt: written without torch where every value has a pickle here; a value only torch pickles (carried
    from a Megatron-LM source's optimizer, say) through torch.save."""
    try:
        data = torchsave.dumps(obj)
    except torchsave.Unpicklable:
        import torch
        torch.save({**obj, "args": with_torch_globals(obj["args"])}, path)
        durable.fsync_file(path)
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        torchsave.save_pickled(fd, 0, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def with_torch_globals(args: argparse.Namespace) -> argparse.Namespace:
    """args with each stand-in for a torch constant (torchsave.Global, e.g. params_dtype) replaced by the constant."""
    import torch
    return argparse.Namespace(**{k: getattr(torch, v.name) if isinstance(v, torchsave.Global) and v.module == "torch"
                                 else v for k, v in vars(args).items()})
