"""`ckpt reshard SRC OUT --format torch_dist` at the speed of copying the bytes: no torch, no tensor in memory.

torch_dist stores each global tensor as chunks that need not follow the loading run's layout: megatron-core reads
any chunking at any TP x PP x DP (that is what the form is for). So the source's own shards become the chunks: each
TP shard, at its place in the global tensor (the layout table's pieces of it, `layout.reshard_pieces` from TP 1),
is one chunk (a SwiGLU fc1 shard two: its gate and up rows) whose bytes are copied from the shard file into the
`.distcp` of the source rank that holds it, in the kernel. Only the target's args, padded vocab and layer split
depend on the target TP x PP. When the padded vocab changes, the vocab tensors' chunks stop at the true vocab and a
zero chunk covers the new padding, as the torch path re-pads them.

It takes what `byte_ranges.ByteSource` reads (our checkpoints, with their optimizer state; Megatron-LM's legacy
and torch_dist files with --no-optimizer). `reshard` returns None, having written nothing, where the torch path
(reshard._reshard_to_megatron) must do it: other sources, a Megatron-LM optimizer to decode, input the byte
source declines (the torch path then words what is wrong). Output files, their chunks' values, args and common.pt
hold what the torch path writes for the same target; tests/test_megatron_write.py loads both with megatron-core.
"""
from __future__ import annotations

import os
import struct
import time
from pathlib import Path

from ckpt_tools import checkpoint, hf, io, layout, megatron_lm, output, to_megatron
from ckpt_tools.byte_ranges import ByteSource, Declined, Shard, _master_shards
from ckpt_tools.formats.megatron_resume import ResumeState, from_ours, state_key
from ckpt_tools.formats.megatron_write import TORCH_DIST, DistWriter
from ckpt_tools.formats.torch_dist import stacked_key
from ckpt_tools.ranks import Rank
from ckpt_tools.torchfile import ELEMENT_SIZES, TensorInfo, read

STEP_FORMATS = {"float32": "<f", "float64": "<d", "int64": "<q", "int32": "<i"}


def reshard(src: str | Path, out: str | Path, tp: int, pp: int, layers: list[int] | None = None,
            vocab_size: int | None = None, force: bool = False, quiet: bool = False, check_hashes: bool = False,
            no_preflight: bool = False, optimizer: bool = True) -> str | None:
    """reshard.reshard(..., form="torch_dist") by copying bytes; None (nothing written) where it does not apply."""
    start = time.perf_counter()
    if optimizer and megatron_lm.is_megatron_lm(Path(src)):
        return None  # a Megatron-LM optimizer is decoded with torch
    try:
        source = ByteSource.open(src, vocab_size, False)
    except Declined:
        return None
    try:
        return _reshard(source, out, tp, pp, layers, force, quiet, check_hashes, no_preflight, optimizer, start)
    finally:
        source.close()


def _reshard(source: ByteSource, out: str | Path, tp: int, pp: int, layers: list[int] | None, force: bool,
             quiet: bool, check_hashes: bool, no_preflight: bool, optimizer: bool, start: float) -> str | None:
    meta, spec = source.meta, source.meta.spec
    with_opt = optimizer and _has_optimizer(meta)
    fresh = with_opt and meta.iteration == 0  # Megatron-LM loads no iter_0000000: weights only, as the torch path
    try:
        fields = {f: _master_shards(meta, f) for f in checkpoint.OPTIMIZER_FIELDS} if with_opt and not fresh else {}
        step = _step(meta) if fields else None
    except Declined:
        return None
    # from here on, what is refused is refused as the torch path refuses it, in its words
    out = output.check_target(out, force)
    leftover = output.note_leftovers(out)
    if check_hashes:
        source.check_hashes()
    counts, padded = layout.target_layout(spec, tp, pp, layers, meta.padded_vocab)
    output.preflight(out, sum(f.stat().st_size for f in meta.dir.iterdir() if f.is_file()), no_preflight)
    resume = None
    if fields:
        consumed = int(meta.raw.get("consumed_samples") or 0)
        resume = from_ours(meta.dir / "meta.json", dict(meta.raw.get("config") or {}),
                           meta.raw.get("parallel", {}).get("dp_size"), meta.iteration, step, consumed)
    args = to_megatron.check(spec, tp, counts, padded, meta.params_dtype, TORCH_DIST, resume, meta.dir)
    nbytes = _write(source, fields, out, tp, counts, padded, args, resume, force, quiet)
    summary = to_megatron.resharded(meta, out, TORCH_DIST, tp, counts, resume, fresh, None, nbytes,
                                    time.perf_counter() - start)
    return summary + (f"\n{leftover}" if leftover else "")


def _write(source: ByteSource, fields: dict, out: Path, tp: int, counts: list[int], padded: int, args,
           resume: ResumeState | None, force: bool, quiet: bool) -> int:
    meta, spec = source.meta, source.meta.spec
    iteration = resume.iteration if resume is not None else 0
    name = f"iter_{iteration:07d}" if resume is not None else megatron_lm.RELEASE
    ranks = meta.grid.ranks()
    with output.staged(out, force) as tmp:
        iter_dir = tmp / name
        iter_dir.mkdir()
        writer = DistWriter(iter_dir, spec, tp, counts, padded, args, saving_tp=meta.tp_size)
        bar = output.progress(len(ranks), "reshard", quiet, unit="file")
        for i, rank in enumerate(ranks):
            for _, key in layout.stage_keys(spec, meta.layer_counts, rank.pp):
                if not layout.holds_weights(key, spec, meta.pp_size):
                    if rank.tp == 0:
                        writer.put_extra(rank.pp, key)
                elif writer.saves(key, rank):
                    for field, shards in ((None, source.shards), *fields.items()):
                        _put(writer, source, rank, key, field, shards[key][rank.tp], padded)
            bar.update(1)
            if i + 1 == len(ranks) or ranks[i + 1].pp != rank.pp:
                writer.end_stage(rank.pp, iteration)
        writer.close(iteration, resume.common() if resume is not None else None)
        bar.close()
        hf.copy_carried(meta.dir, iter_dir)
        io.write_text_atomic(tmp / megatron_lm.TRACKER, str(iteration) if resume is not None else megatron_lm.RELEASE)
    return writer.nbytes


def _put(writer: DistWriter, source: ByteSource, rank: Rank, key: str, field: str | None, shard: Shard,
         padded: int) -> None:
    """One source shard as the chunks of the global tensor it is part of, its bytes copied from its file."""
    meta, spec = source.meta, source.meta.spec
    fqn, layer = stacked_key(key)
    if field is not None:
        fqn = state_key(field, fqn)
    src_padded = meta.padded_vocab
    full = layout.full_shape(key, spec, padded, meta.pp_size)  # at the target's padded vocab
    repad = layout.has_padded_rows(key, spec, meta.pp_size) and padded != src_padded
    at = 0  # rows of the shard taken so far (dim-0 pieces follow one another in the shard)
    for p in layout.reshard_pieces(key, spec, 1, src_padded, meta.tp_size, src_padded, rank.tp, meta.pp_size):
        stop = min(p.stop, spec.vocab_size) if repad else p.stop
        if stop > p.start:
            ranges = shard.byte_ranges(at, at + stop - p.start) if p.dim == 0 else shard.whole
            offsets, sizes, shape = writer.placed(key, layer, full, layout.Piece(p.rank, p.dim, p.start, stop))
            writer.put_chunk(rank, fqn, shard.dtype, shape, offsets, sizes,
                             [(source.files.fd(path), offset, n) for path, offset, n in ranges])
        at += p.stop - p.start
    if repad and rank.tp == 0:  # the new padding rows: zeros, as pad_vocab makes them
        offsets, sizes, shape = writer.placed(key, layer, full, layout.Piece(None, 0, spec.vocab_size, padded))
        row = full[1] * ELEMENT_SIZES[shard.dtype]
        writer.put_chunk(rank, fqn, shard.dtype, shape, offsets, sizes, bytes((padded - spec.vocab_size) * row))


def _has_optimizer(meta: checkpoint.Meta) -> bool:
    """Optimizer shards exist or meta.json records them (as the torch reader's has_optimizer)."""
    recorded = meta.raw.get("files", {})
    return any((meta.dir / checkpoint.optimizer_file(r)).is_file() or checkpoint.optimizer_file(r) in recorded
               for r in meta.grid.ranks())


def _step(meta: checkpoint.Meta) -> float:
    """Adam's step, from rank (0, 0)'s optimizer shard (the same for every parameter), read without torch."""
    path = meta.dir / checkpoint.optimizer_file(Rank(0, 0))
    state = read(path).get("optimizer") if path.is_file() else None
    key = next((local for local, k in layout.stage_keys(meta.spec, meta.layer_counts, 0)
                if layout.holds_weights(k, meta.spec, meta.pp_size)), None)
    entry = state.get(key) if isinstance(state, dict) else None
    info = entry.get("step") if isinstance(entry, dict) else None
    if not (isinstance(info, TensorInfo) and info.shape == () and info.dtype in STEP_FORMATS):
        raise Declined(f"{path}: no scalar step for {key}")
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, info.nbytes, info.offset)
    finally:
        os.close(fd)
    return float(struct.unpack(STEP_FORMATS[info.dtype], data)[0])
