"""`ckpt reshard ... --format torch_dist|fsdp_dtensor|torch` from a source's bytes, and `ckpt import`'s torch_dist
writer loop beside it (`shared_dist`).

torch_dist stores each global tensor as chunks that need not follow the loading run's layout: megatron-core reads
any chunking at any TP x PP x DP (that is what the form is for). So the source's own shards become the chunks: each
TP shard, at its place in the global tensor (the layout table's pieces of it, `shard_ops.reshard_pieces` from TP 1),
is one chunk (a SwiGLU fc1 shard two: its gate and up rows) whose bytes are copied from the shard file into the
`.distcp` of the source rank that holds it, in the kernel, or written from memory where the source's torch reader
makes the tensor (byte_ranges.ByteSource: `made`, a Megatron-LM optimizer's `made_fields`; every tensor of a source
read `through` it). Only the target's args, padded vocab and layer split depend on the target TP x PP. When the
padded vocab changes, the vocab tensors' chunks stop at the true vocab and a zero chunk covers the new padding.
Megatron-FSDP's fsdp_dtensor is the same files through its writer (forms/fsdp_write.py); the legacy form's rank files
are cut to the target's TP by forms/legacy_copy.py.

`reshard` returns None, having written nothing, where the bytes do not hold what it needs (paths.reshard then reads
the source through its torch reader, which words what is wrong, and calls it again). tests/test_megatron_write.py
loads what it writes with megatron-core; tests/test_gpu.py resumes megatron-core from it.
"""
from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable
from pathlib import Path

from ckpt_tools import io, output
from ckpt_tools.errors import CkptError
from ckpt_tools.forms import checkpoint, forms, legacy_copy, megatron_lm
from ckpt_tools.forms.byte_index import Declined, Shard, field_shards, has_optimizer
from ckpt_tools.forms.byte_ranges import ByteSource
from ckpt_tools.forms.dtypes import ELEMENT_SIZES
from ckpt_tools.forms.made import MadeShard
from ckpt_tools.forms.megatron_resume import ResumeState, from_ours, resume_state
from ckpt_tools.forms.megatron_write import DistWriter
from ckpt_tools.forms.torchfile import TensorInfo, Unreadable, read
from ckpt_tools.model import hf, layout, shard_ops
from ckpt_tools.model.ranks import Rank
from ckpt_tools.team import SOLO, Team
from ckpt_tools.verbs import to_megatron
from ckpt_tools.verbs.request import Layout, Request

STEP_FORMATS = {"float32": "<f", "float64": "<d", "int64": "<q", "int32": "<i"}


def reshard(source: ByteSource, out: str | Path, want: Request, force: bool = False, quiet: bool = False,
            check_hashes: bool = False, no_preflight: bool = False, team: Team = SOLO) -> str | None:
    """paths.reshard(..., `want` of a Megatron-LM form) from `source`: its byte ranges copied, its tensors that torch
    makes (ByteSource.made, made_fields) written from memory. None (nothing written) where the bytes do not hold what
    the copy needs (paths.reshard then reads the source through its torch reader, ByteSource.through, which this
    always takes). `team`: the processes writing the output's files between them (ckpt_tools.team)."""
    start = time.perf_counter()
    go = _reshard(source, out, want, force, quiet, check_hashes, no_preflight, start, team)
    if not team.all(go is not None):  # one path for all: a process that declined sends every one through torch
        return None
    return go()


def _reshard(source: ByteSource, out: str | Path, want: Request, force: bool, quiet: bool, check_hashes: bool,
             no_preflight: bool, start: float, team: Team = SOLO) -> Callable[[], str] | None:
    """None where the copy does not apply, else what writes the output and returns the summary."""
    meta, reader = source.meta, source.maker
    if source.read_through:
        with_opt, unread = want.optimizer and reader.has_optimizer(), reader.unread_optimizer()
    else:  # a Megatron-LM optimizer: its fields made by the form's torch reader (ByteSource.open(..., carry_optimizer))
        with_opt, unread = want.optimizer and (has_optimizer(meta) if source.ours else source.megatron_optimizer), None
    fresh = with_opt and meta.iteration == 0  # Megatron-LM loads no iter_0000000: weights only
    carried = with_opt and not fresh
    try:
        fields, step = {}, None
        if carried and forms.get(want.form).optimizer and not source.ours:
            fields = {f: source.made_fields(f) for f in checkpoint.OPTIMIZER_FIELDS}
        elif carried and forms.get(want.form).optimizer:
            fields = {f: field_shards(meta, f) for f in checkpoint.OPTIMIZER_FIELDS}
            for shards in fields.values():
                source.check_replicas(shards)
            step = _step(meta)
        if source.read_through:
            dropped = fresh and reader.fresh_optimizer() and bool(reader.written_masters())
        else:
            dropped = fresh and meta.fresh_optimizer and bool(field_shards(meta, "master", written=True))
    except (Declined, Unreadable, CkptError, OSError):
        if source.read_through:  # the torch reader's own words
            raise
        return None
    return lambda: _reshard_copy(source, out, want, force, quiet, check_hashes, no_preflight, start, team, fields,
                                 step, fresh, carried, unread) + (to_megatron.MASTERS_NOT_WRITTEN if dropped else "")


def _reshard_copy(source: ByteSource, out: str | Path, want: Request, force: bool, quiet: bool, check_hashes: bool,
                  no_preflight: bool, start: float, team: Team, fields: dict, step: float | None, fresh: bool,
                  carried: bool, unread: str | None) -> str:
    meta, spec = source.meta, source.meta.spec
    out, leftover, target = begin(source, out, want, force, check_hashes, no_preflight, team)
    if carried:
        to_megatron.check_optimizer_form(target.form, meta.dir)
    resume = None
    if fields and not source.ours:
        resume = resume_state(source.maker)
    elif fields:
        consumed = int(meta.raw.get("consumed_samples") or 0)
        resume = from_ours(meta.dir / "meta.json", dict(meta.raw.get("config") or {}),
                           meta.raw.get("parallel", {}).get("dp_size"), meta.iteration, step, consumed)
    args = to_megatron.check(spec, target, meta.params_dtype, resume, meta.dir)
    nbytes = _write(source, fields, out, target, args, resume, force, quiet, team)
    summary = to_megatron.resharded(meta, out, target, resume, fresh, unread, nbytes, time.perf_counter() - start)
    return summary + (f"\n{leftover}" if leftover else "")


def begin(source: ByteSource, out: str | Path, want: Request, force: bool, check_hashes: bool, no_preflight: bool,
          team: Team) -> tuple[Path, str | None, Layout]:
    """A reshard's first steps, before anything is written (either writer's): OUT refused where it exists (unless
    `force`), what an interrupted run left noted, the source's hashes checked (`check_hashes`), the target resolved at
    the source's model, the disk's room checked: (OUT, the note, the target)."""
    meta = source.meta
    out = output.check_target(out, force)
    leftover = output.note_leftovers(out)
    if check_hashes and not source.read_through:  # shards.open_checked checked them
        source.check_hashes(team)
    target = want.resolve(meta.spec, meta.padded_vocab, meta.ep_size, meta)
    output.preflight(out, sum(f.stat().st_size for f in meta.dir.iterdir() if f.is_file()), no_preflight)
    return out, leftover, target


def _write(source: ByteSource, fields: dict, out: Path, target: Layout, args, resume: ResumeState | None, force: bool,
           quiet: bool, team: Team) -> int:
    tp, counts, padded = target.tp, target.counts, target.padded
    iteration = resume.iteration if resume is not None else 0
    name = f"iter_{iteration:07d}" if resume is not None else megatron_lm.RELEASE
    with output.staged(out, force, team=team) as tmp:
        iter_dir = tmp / name
        iter_dir.mkdir(exist_ok=True)
        if forms.get(target.form).chunks:
            nbytes = _write_dist(source, fields, iter_dir, target.form, tp, counts, padded, args, resume,
                                 iteration, quiet, team)
        else:
            nbytes = legacy_copy.write(source, iter_dir, tp, counts, padded, args, iteration, quiet, team=team)
        if team.lead:
            hf.copy_carried(source.meta.dir, iter_dir)
            io.write_text_atomic(tmp / megatron_lm.TRACKER,
                                 str(iteration) if resume is not None else megatron_lm.RELEASE)
    return nbytes


def shared_dist(team: Team, make: Callable[[], DistWriter], run: Callable[[DistWriter, object], None], units: int,
                label: str, quiet: bool, unit: str = "file") -> DistWriter:
    """`run(writer, bar)` puts every chunk of the output into `make()`'s writer. In a team it runs twice: first
    counting alone (every .distcp's size), then writing this process's run of the files (team.split by those
    sizes) and counting the rest, so that every process's index is the whole one; process 0 writes it."""
    if team.size > 1:
        with make().only(None, dry=True) as dry:
            run(dry, output.progress(0, label, True))
        names = sorted(dry.ends, key=lambda n: int(n[2:].split("_")[0]))  # the saving ranks' order
        owners = team.split([dry.ends[n] for n in names])
        mine = {n for n, owner in zip(names, owners) if owner == team.rank}
        make_all = make
        make = lambda: make_all().only(mine, team)  # noqa: E731
    bar = output.progress(units, label, quiet, unit=unit)
    with make() as writer:
        run(writer, bar)
    bar.close()
    return writer


def _write_dist(source: ByteSource, fields: dict, iter_dir: Path, form: str, tp: int, counts: list[int], padded: int,
                args,
                resume: ResumeState | None, iteration: int, quiet: bool, team: Team = SOLO) -> int:
    meta, spec = source.meta, source.meta.spec
    ranks = meta.grid.ranks()

    def run(writer: DistWriter, bar) -> None:
        for i, rank in enumerate(ranks):
            for _, key in meta.rank_keys(rank, owned=True):
                if not layout.holds_weights(key, spec, meta.pp_size):
                    if rank.tp == 0:
                        writer.put_extra(rank.pp, key)
                elif writer.saves(key, rank):
                    trained = fields.items() if layout.has_optimizer_state(key, spec, meta.pp_size) else ()
                    if writer.weights_from_masters(key):
                        pass  # its fp32 master is its model entry (Megatron-FSDP's main weights)
                    elif key in source.made:  # a tensor the torch reader makes: its shard at the source's TP, in memory
                        _put(writer, source, rank, key, None, MadeShard(source.made_shard(key, rank.tp)), padded,
                             meta.tp_size)
                        source.release()
                    else:
                        trained = ((None, source.shards), *trained)
                    for field, shards in trained:  # optimizer fields: byte ranges, or made by the torch reader
                        if rank.tp < len(shards[key]):  # a tensor held whole (ByteSource.tp_of): TP rank 0's
                            _put(writer, source, rank, key, field, shards[key][rank.tp], padded, len(shards[key]))
                    source.release()
            bar.update(1)
            if i + 1 == len(ranks) or ranks[i + 1].pp != rank.pp:
                writer.end_stage(rank.pp, iteration)
        writer.close(iteration, resume.common() if resume is not None else None)
    writer = forms.get(form).writer
    return shared_dist(team, lambda: writer(iter_dir, spec, tp, counts, padded, args, resume, saving_tp=meta.tp_size,
                                            saving_ep=meta.ep_size), run, len(ranks), "reshard", quiet).nbytes


def _put(writer: DistWriter, source: ByteSource, rank: Rank, key: str, field: str | None, shard: Shard | MadeShard,
         padded: int, src_tp: int) -> None:
    """One source shard (of `src_tp`) as the chunks of the global tensor it is part of, its bytes copied from its
    file (or from memory, a shard torch made)."""
    meta, spec = source.meta, source.meta.spec
    fqn, layer = writer.stored(key)
    fqn = writer.entry(fqn, field)
    src_padded = meta.padded_vocab
    full = layout.full_shape(key, spec, padded, meta.pp_size)  # at the target's padded vocab
    repad = layout.has_padded_rows(key, spec, meta.pp_size) and padded != src_padded
    at = 0  # rows of the shard taken so far (dim-0 pieces follow one another in the shard)
    for p in shard_ops.reshard_pieces(key, spec, 1, src_padded, src_tp, src_padded, rank.tp, meta.pp_size):
        stop = min(p.stop, spec.vocab_size) if repad else p.stop
        if stop > p.start:
            ranges = shard.byte_ranges(at, at + stop - p.start) if p.dim == 0 else shard.whole
            stored, offsets, sizes, shape = writer.placed(key, fqn, layer, full,
                                                          shard_ops.Piece(p.rank, p.dim, p.start, stop), field)
            writer.put_chunk(rank, stored, shard.dtype, shape, offsets, sizes,
                             [r if isinstance(r, memoryview) else (source.files.fd(r[0]), r[1], r[2]) for r in ranges])
        at += p.stop - p.start
    if repad and rank.tp == 0:  # the new padding rows: zeros, as pad_vocab makes them
        stored, offsets, sizes, shape = writer.placed(key, fqn, layer, full,
                                                      shard_ops.Piece(None, 0, spec.vocab_size, padded), field)
        row = full[1] * ELEMENT_SIZES[shard.dtype]
        writer.put_chunk(rank, stored, shard.dtype, shape, offsets, sizes, bytes((padded - spec.vocab_size) * row))


def _step(meta: checkpoint.Meta) -> float:
    """Adam's step, from rank (0, 0)'s optimizer shard (the same for every parameter), read without torch."""
    path = meta.dir / checkpoint.optimizer_file(meta.grid.first)
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


# ---------------------------------------------------------------- import: an HF model's tensors as chunks
