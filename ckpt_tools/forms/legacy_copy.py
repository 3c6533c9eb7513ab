"""`ckpt reshard / import ... --format torch` by copying bytes: each target rank's `model_optim_rng.pt` written as
torch.save lays it out, its tensors' bytes copied from the source's files (torch only for an HF tensor it makes).

A legacy file holds each TP rank's shard exactly, so unlike torch_dist (verbs/dist_copy.py) the source's shards
must be cut to the target's: `shard_ops.reshard_pieces` names the pieces of the source shards that make a target
shard. Pieces along dim 0 (column-parallel rows, QKV groups, SwiGLU halves, vocab rows) are byte ranges of the
source files, copied file to file in the kernel; a row-parallel shard (pieces along dim 1) is gathered in memory by
ByteSource.gather, as merge gathers one (one tensor at a time, in a reused buffer); new vocab
padding rows are zeros. The tensor records come first and `data.pkl` (args, checkpoint_version, iteration, the
model dict naming its tensors by record) last: torch.load finds records by name. Weights only: Megatron-LM's legacy
optimizer state is not written by this version (to_megatron.check_optimizer_form).

An HF model is read as a TP 1 source (`hf_source`): each megatron-core tensor's rows are row ranges of the HF
tensors that hold them (conversions.hf_rows: q, k and v rows per query group, gate and up halves, the true vocab's
rows); a tensor whose value is not its HF bytes is made by torch (verbs/hf_copy.made_by_torch), split as the torch
path splits it (shard_ops.split) and its rank's shard written from memory.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

from ckpt_tools import durable, output
from ckpt_tools.forms import megatron_lm, torchsave
from ckpt_tools.forms.byte_index import Shard, Shards
from ckpt_tools.forms.byte_ranges import ByteSource
from ckpt_tools.forms.checkpoint import Meta, file_record
from ckpt_tools.forms.dtypes import ELEMENT_SIZES
from ckpt_tools.forms.made import MadeFields
from ckpt_tools.forms.megatron_write import CHECKPOINT_VERSION
from ckpt_tools.forms.torchfile import TensorInfo
from ckpt_tools.model import conversions, layout, shard_ops
from ckpt_tools.model.ranks import Grid, Rank
from ckpt_tools.team import SOLO, Team

IN_FLIGHT = 16  # files whose copies and fsync may run at once, each on a thread of its own


def write(source: ByteSource, iter_dir: Path, tp: int, counts: list[int], padded: int, args, iteration: int,
          quiet: bool, label: str = "reshard", team: Team = SOLO) -> int:
    """Every target rank's file under iter_dir (in a team, this process's run of them, balanced by their bytes);
    the bytes of tensors written by every process. With an interleaved pipeline (args'
    virtual_pipeline_model_parallel_size) `counts` are the virtual stages, a file's model chunks."""
    spec, ep = source.meta.spec, args.expert_model_parallel_size or 1
    vpp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    pp = len(counts) // vpp
    ranks = Grid(tp, pp, ep).ranks()  # a dir per EP rank where EP > 1, its experts under local indices
    sizes = [sum(layout.rank_numel(spec, counts, padded, tp, c.pp, c.ep, ep) for c in megatron_lm.chunk_ranks(r, pp, vpp))
             for r in ranks]
    owners = team.split(sizes)
    mine = [rank for rank, owner in zip(ranks, owners) if owner == team.rank]

    header = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration}
    return sum(team.share(lambda: write_files(
        source, [(megatron_lm.model_path(iter_dir, rank, pp), megatron_lm.chunk_ranks(rank, pp, vpp)) for rank in mine],
        counts, padded, tp, ep, header, quiet, label)))


def write_files(source: ByteSource, targets: list[tuple[Path, list[Rank]]], counts: list[int], padded: int, tp: int,
                ep: int, header: dict, quiet: bool, label: str, records: dict | None = None) -> int:
    """Each (path, the ranks of its model chunks) of `targets`: a torch.save archive of `header` and the chunks' model
    dicts (`model`, or `model<v>` with several), its tensors' bytes copied from the source; the bytes of tensors
    written. Legacy Megatron-LM files, and our format's model files (`header` empty; `records`: each file's meta.json
    record by its path, made on its own thread once its copies are done, beside the next file's writing)."""
    return write_archives([(path, lambda put, chunks=chunks: model_dicts(source, chunks, counts, padded, tp, ep,
                                                                         header, put))
                           for path, chunks in targets], quiet, label, records)


def write_archives(targets: list[tuple[Path, object]], quiet: bool, label: str, records: dict | None = None) -> int:
    """Each (path, fill) of `targets`: a torch.save archive of the object `fill(put)` returns, where `put(ref, dtype,
    shape, data)` adds a tensor record (data: byte ranges of other files, or memory) as it is made and returns its
    reference; the bytes of tensors written. Each file's byte ranges are copied, its record for meta.json made
    (`records`, by path) and its fsync run on a thread of its own (durable.FileWorker), beside the next file's
    writing."""
    nbytes, bar = 0, output.progress(len(targets), label, quiet, unit="file")
    files: list[tuple[durable.FileWorker, int, Path]] = []  # written, their copies and fsync still running

    def finish_oldest() -> None:
        worker, fd, path = files[0]
        try:
            worker.finish()
        finally:
            files.pop(0)
            os.close(fd)
        durable.fsync_dir(path.parent)
    try:
        for path, fill in targets:
            nbytes += _write_archive(path, fill, files, records)
            bar.update(1)
            while len(files) > IN_FLIGHT:  # a descriptor and a thread each: the oldest finished first
                finish_oldest()
        while files:
            finish_oldest()
    finally:  # a write that failed: stop the other files' threads before their descriptors close
        for worker, fd, _ in files:
            worker.abandon()
            os.close(fd)
    bar.close()
    return nbytes


def _write_archive(path: Path, fill, files: list, records: dict | None) -> int:
    """One file: its headers, pickles and in-memory tensors written here, its byte ranges copied and its fsync run on
    a thread of its own (durable.FileWorker), added to `files` with its descriptor (closed by the caller)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    worker = durable.FileWorker()
    files.append((worker, fd, path))
    archive, nbytes, flushed = torchsave.Archive(fd, 0, path.stem, copy=worker.copy), 0, 0

    def put(ref: str, dtype: str, shape: tuple, data: torchsave.Data) -> torchsave.TensorRef:
        nonlocal nbytes, flushed
        archive.add(f"data/{ref}", data)
        nbytes += torchsave.data_size(data)
        archive.flush()
        worker.writeback(fd, flushed, archive.pos - flushed)  # the final fsync finds little left to wait for
        flushed = archive.pos
        return torchsave.TensorRef(ref, dtype, shape)
    torchsave.finish(archive, torchsave.dumps(fill(put)))
    if records is not None:  # its hash from the page cache, then its fsync
        worker.submit(lambda: records.__setitem__(path, file_record(path)))
    worker.submit(os.fsync, fd)
    return nbytes


def model_dicts(source: ByteSource, chunks: list[Rank], counts: list[int], padded: int, tp: int, ep: int,
                 header: dict, put) -> dict:
    """One target rank's archive object: `header` and its model chunks' dicts (the ranks of `chunks`, one without an
    interleaved pipeline), each tensor put as it is made."""
    spec, models = source.meta.spec, {}
    base = 0  # the records of a file's earlier chunks: names stay unique
    for v, rank in enumerate(chunks):
        base += len(models[megatron_lm.chunk_name(v - 1, len(chunks))]) if v else 0
        model = models[megatron_lm.chunk_name(v, len(chunks))] = {}
        for local, key in layout.stage_keys(spec, counts, rank.pp, rank.ep, ep):
            if not layout.holds_weights(key, spec, len(counts)):
                model[local] = None  # an extra-state entry, as megatron-core's local spec saves it
                continue
            dtype, shape, data = shard(source, key, rank.tp, tp, padded, len(counts))
            source.release()  # the pages of a tensor the torch reader made (its bytes are held by `data`)
            model[local] = put(str(base + len(model)), dtype, shape, data)
    return {**header, **models}


def shard(source: ByteSource, key: str, rank: int, tp: int, padded: int, pp: int,
          fields: Shards | MadeFields | None = None) -> tuple[str, tuple, torchsave.Data]:
    """Target TP rank `rank`'s shard of `key`: dtype, shape and its bytes (ranges of the source files, or memory);
    `fields`: an optimizer field's shards (byte_index.field_shards, or made by a Megatron-LM source's torch reader)
    instead of the model's."""
    meta, spec = source.meta, source.meta.spec
    held = source.held(key)
    if held in source.made and fields is None:
        return _made_shard(source, key, held, rank, tp, padded, pp)
    if isinstance(fields, MadeFields):  # a Megatron-LM optimizer's field, decoded by the torch reader
        return fields.shard(key, held, rank, tp, padded, pp)
    shards = (source.shards if fields is None else fields)[held]
    dtype, itemsize = shards[0].dtype, ELEMENT_SIZES[shards[0].dtype]
    shape = layout.shard_shape(key, spec, padded, tp, pp)
    if layout.is_replicated(key, spec, pp):
        return dtype, shape, [(source.files.fd(p), o, n) for p, o, n in shards[0].whole]
    pieces = shard_ops.reshard_pieces(key, spec, source.tp_of(held), meta.padded_vocab,
                                   tp, padded, rank, pp)
    if pieces[0].dim == 0:
        row = math.prod(shape[1:]) * itemsize
        data: list = []
        for p in pieces:
            if p.rank is None:
                data.append(bytes((p.stop - p.start) * row))
            else:
                data += [(source.files.fd(f), o, n) for f, o, n in shards[p.rank].byte_ranges(p.start, p.stop)]
        return dtype, shape, data
    return dtype, shape, [source.gather(shards, pieces, [(0, shape[0])], itemsize)]


class HFSource(ByteSource):
    """An HF model as a source of rank files (`hf_source`): the row ranges of its copied tensors, and the tensors torch
    makes instead (`made`: key -> (conversion kind, HF names, dtype); `maker`: verbs/hf_copy.TorchMade)."""

    def __init__(self, meta: Meta, shards: dict, made: dict[str, tuple], maker):
        super().__init__(meta, shards, shards, False)
        self.made, self.maker = made, maker

    def made_full(self, key: str):
        """In its HF tensors' dtype: `made_shard_cast` casts each rank's shard alone."""
        kind, names, _ = self.made[key]
        return self.maker.tensor(kind, names, None)

    def made_shard_cast(self, key: str, shard):
        import torch
        return shard.to(getattr(torch, self.made[key][2]))

    def release(self) -> None:
        """Nothing mapped: the HF tensors torch makes are read anew each time."""

    def close(self) -> None:
        self.files.close()


def _made_shard(source: ByteSource, key: str, held: str, rank: int, tp: int, padded: int,
                pp: int) -> tuple[str, tuple, list]:
    """Target TP rank `rank`'s shard of a tensor torch makes (`held`: the tensor that holds `key`): from a checkpoint's
    torch reader, the pieces of its shards; from an HF model, split from the full tensor as the layout table splits
    it. Rank files are written one after another, so each file's shard of an HF tensor is made from the full tensor
    anew (only that shard laid out contiguously, and cast)."""
    if not isinstance(source, HFSource):  # a checkpoint's torch reader: the pieces of its shards
        return source.made_target_shard(key, held, rank, tp, padded, pp)
    from ckpt_tools.forms.writers import dtype_name
    full, spec = source.made_full(held), source.meta.spec
    if layout.has_padded_rows(key, spec, pp) and full.shape[0] != padded:  # another TP's padding: re-padded
        full = shard_ops.pad_vocab(key, full, spec, padded)
    shard = shard_ops.split(key, full, spec, tp, pp)[rank]
    shard = source.made_shard_cast(held, shard).contiguous()
    return dtype_name(shard.dtype), tuple(shard.shape), [as_bytes(shard)]


def as_bytes(t) -> memoryview:
    """A contiguous tensor's bytes, without a copy."""
    import torch
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")


def hf_source(hf_dir: Path, spec, index: dict, rows: dict, maker, made: dict[str, tuple]) -> HFSource:
    """An HF model's safetensors as a TP 1 x PP 1 source whose vocab is unpadded: each megatron-core tensor one shard,
    made of the row ranges of its HF tensors in the order they take in it. `index`: name -> (file, dtype, shape,
    data offset, bytes); `rows`: key -> (hf.Name, HF names), as hf_copy.import_hf checked them; `made`: the tensors
    `maker` (hf_copy.TorchMade) makes instead, key -> (conversion kind, HF names, dtype)."""
    shards = {}
    for key, (row, names) in rows.items():
        if key in made:
            continue
        full_rows = layout.full_shape(key, spec, spec.vocab_size)[0]
        parts = []
        for name, runs in zip(names, conversions.hf_rows(row.kind, spec, full_rows)):
            path, dtype, shape, offset, _ = index[name]
            row_bytes = ELEMENT_SIZES[dtype] * math.prod(shape[1:])
            at = 0  # rows of the HF tensor taken so far
            for a, b in runs:
                parts.append((a, (path, TensorInfo(dtype, (b - a, *shape[1:]), offset + at * row_bytes))))
                at += b - a
        shards[key] = [Shard(tuple(part for _, part in sorted(parts, key=lambda p: p[0])))]
    meta = Meta(path=hf_dir / "config.json", raw={}, spec=spec, tp_size=1, pp_size=1, layer_counts=[spec.num_layers],
                padded_vocab=spec.vocab_size, iteration=0, source="hf", root=hf_dir)
    return HFSource(meta, shards, made, maker)
