"""`ckpt merge`: sharded checkpoint -> one HuggingFace model dir, one safetensors file (megatron-core names), or
one `pytorch_model.bin` (a torch.save state dict with HF names).

Model-free and streaming, one path: the output files are planned from the layout table (ckpt_tools.verbs.plan: names,
dtypes, shapes) before any tensor is read; then, tensor by tensor, the source gives each output tensor's bytes
and they are written in plan order, two output files at once where every tensor is byte ranges. Memory stays near
the largest tensor (two of them then); the model is never built and the checkpoint is never held in RAM.

The source is `byte_ranges.ByteSource` wherever the files can be read as byte ranges without torch (our own
checkpoints, Megatron-LM's legacy and torch_dist files): bytes are copied file to file, joined in memory for
row-parallel tensors, converted as a last step when the output dtype differs; a tensor whose bytes are not the
layout table's (grouped or whole experts of a legacy file) made by the form's torch reader, the others still copied.
Where it declines (before anything is written: damaged input, master weights of a Megatron-LM optimizer, strided
tensors), `TensorSource` gives the same bytes through the torch reader, which also words what is wrong. --check-hashes is a step before
either. `CKPT_MERGE_TORCH=1` (or `via=TENSORS`) reads through the torch reader always, for comparisons.
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt_tools import durable, output
from ckpt_tools.errors import CkptError, LayoutError
from ckpt_tools.forms.dtypes import ELEMENT_SIZES
from ckpt_tools.model import conversions, families, hf, layout, shard_ops
from ckpt_tools.model.fp8 import FP8, SCALE, fp8_quantized, quantize_blocks
from ckpt_tools.team import SOLO, Team
from ckpt_tools.verbs.plan import DIRS, HF_BIN, TORCH, Entry, Job, tokenizer_dir

if TYPE_CHECKING:
    from ckpt_tools.forms.byte_ranges import ByteSource
    from ckpt_tools.forms.shards import Reader

TORCH_PATH = "CKPT_MERGE_TORCH"  # set to 1 in the environment: always read through the torch reader
AUTO, BYTES, TENSORS = "auto", "bytes", "tensors"  # merge(via=...): the source, or the byte source if it takes SRC
FILES_AT_ONCE = 2  # output files a merge writes at a time, each on its own thread
MAX_SHARD_SIZE = 5 * 10**9  # bytes of an HF output file, by default (the CLI's --max-shard-size 5GB)
WRITEBACK = 32 << 20  # bytes written between two calls that start their writeback (the final fsync waits less)

Data = list[tuple[int, int, int]] | memoryview  # an output tensor's bytes: file ranges (fd, offset, nbytes), or memory


class TensorSource:
    """Merge's source through the torch reader: each output tensor joined by the layout table, converted to HF."""

    def __init__(self, reader: Reader, from_master: bool, torch_threads: int | None):
        import torch
        if torch_threads:
            torch.set_num_threads(torch_threads)
        meta = reader.meta
        if from_master and not reader.has_optimizer():
            unread = reader.unread_optimizer()
            raise CkptError(f"{meta.dir}: no optimizer shards with fp32 master weights "
                            f"({f'its {unread} is not read by this version' if unread else 'saved without optimizer'}): "
                            f"merge without --from-master-weights")
        self.reader, self.meta, self.field = reader, meta, "master" if from_master else None
        self.note = _tied_copy_note(reader)

    def check_hashes(self, team: Team = SOLO) -> None:
        self.reader.check_hashes(team)

    def data(self, e: Entry, dtype: str) -> Iterator[tuple[str, tuple[int, ...], Data]]:
        from ckpt_tools.forms.byte_ranges import hf_bytes

        # a buffer (no optimizer state) is its own master
        field = self.field if layout.has_optimizer_state(e.key, self.meta.spec) else None
        yield from hf_bytes(e, self.reader.full(e.key, field), self.meta.spec, dtype)

    def release(self) -> None:
        self.reader.release()

    def close(self) -> None:
        self.reader.close()


def _tied_copy_note(shards: Reader) -> str | None:
    """At PP > 1 an aliased row's stage keeps a copy (the last stage's of a tied embedding); HF keeps one tensor. Say
    if they differ."""
    spec, notes = shards.meta.spec, []
    for copy, original in layout.aliases(spec).items():
        if copy not in shards.keys():
            continue
        a, b = (shards.full(k)[: spec.vocab_size] for k in (original, copy))
        shards.release()
        if not shard_ops.same_bits(a, b):
            diff = (a.float() - b.float()).abs().max().item()
            notes.append(f"note: the last stage's copy of the tied embedding differs from the first stage's (max abs "
                         f"{diff:.3g}); the merged model uses the first stage's embedding")
    return "\n".join(notes) or None


def open_source(src: str | Path, vocab_size: int | None, from_master: bool, check_hashes: bool, via: str = AUTO,
                torch_threads: int | None = None, team: Team = SOLO) -> ByteSource | TensorSource:
    """The source a merge reads SRC through (see the module docstring), its files' hashes checked if asked."""
    from ckpt_tools.forms.byte_index import Declined
    from ckpt_tools.forms.byte_ranges import ByteSource
    if via == AUTO and os.environ.get(TORCH_PATH, "0") not in ("", "0"):
        via = TENSORS
    source: ByteSource | TensorSource | None = None
    if via != TENSORS:
        try:
            source = ByteSource.open(src, vocab_size, from_master)
        except Declined:
            if via == BYTES:
                raise
    if source is None:
        from ckpt_tools.forms.shards import open_checked
        source = TensorSource(open_checked(src, vocab_size, check_hashes, team), from_master, torch_threads)
    else:
        source.torch_threads = torch_threads  # for a conversion step
        if check_hashes:
            try:
                source.check_hashes(team)
            except BaseException:
                source.close()
                raise
    return source


def merge(src: str | Path, out: str | Path, *, fmt: str = "hf", dtype: str | None = None,
          from_master: bool = False, max_shard_size: int = MAX_SHARD_SIZE, tokenizer: str | Path | None = None,
          vocab_size: int | None = None, force: bool = False, quiet: bool = False, check_hashes: bool = False,
          no_preflight: bool = False, via: str = AUTO, torch_threads: int | None = None, team: Team = SOLO,
          fp8_blocks: tuple[int, int] | None = None, mxfp4: bool = False) -> str:
    """Write the merged model; returns the one-line summary. `via` picks the source (AUTO: the byte source when
    it takes SRC); `torch_threads` sets torch's intra-op threads where torch is used (per file thread); `team`: the
    processes that write the output files between them (ckpt_tools.team); `fp8_blocks`: the decoder layers' linear
    weights in block-scaled FP8 (DeepSeek-V3's published layout, quantize_blocks), read through torch; `mxfp4`: the
    experts' weights in MXFP4 (GPT-OSS's, ckpt_tools.model.mxfp4), read through torch."""
    start = time.perf_counter()
    out = output.check_target(out, force)
    leftover = output.note_leftovers(out)
    source = open_source(src, vocab_size, from_master, check_hashes, TENSORS if fp8_blocks or mxfp4 else via,
                         torch_threads, team)
    try:
        job = Job.make(source.meta, fmt, dtype, from_master, max_shard_size, fp8_blocks, mxfp4)
        tok_dir = tokenizer_dir(source.meta.dir, tokenizer) if fmt in DIRS else None
        output.preflight(out, job.total, no_preflight)
        # two output files at once where every tensor is byte ranges (none made by the torch reader), in one process
        # (a team was measured as it was): docs/benchmarks.md, the cold merge at 20 GB
        bytes_only = not isinstance(source, TensorSource) and not source.made and source.maker is None
        at_once = FILES_AT_ONCE if bytes_only and team.size == 1 else 1
        if at_once > 1:
            _import_first(job, source)
        job.write(out, force, quiet, tok_dir, lambda path, group, bar: _write_file(path, group, bar, job, source),
                  team, at_once)
    finally:
        source.close()
    return job.summary(out, time.perf_counter() - start, source.note, leftover)


def _import_first(job: Job, source: ByteSource) -> None:
    """What the job's conversion steps import (torch: a dtype cast, a norm's offset, .bin archives; numpy: GPT-2's
    transposes), imported here before the files' threads start: two threads importing torch first at once is not
    safe."""
    import importlib
    entries = [e for group in job.files for e in group]
    if job.fmt in (TORCH, HF_BIN) or any(e.kind in conversions.ARITHMETIC or
                                         job.entry_dtype(e) != source.shards[e.key][0].dtype for e in entries):
        importlib.import_module("torch")
    if any(e.kind in conversions.TRANSPOSED for e in entries):
        importlib.import_module("numpy")


def _write_file(path: Path, group: list[Entry], bar, job: Job, source: ByteSource | TensorSource) -> None:
    """One output file of the plan: a safetensors file, or for .bin outputs a torch.save archive."""
    if job.fmt in (TORCH, HF_BIN):
        _write_archive(path, group, bar, job, source)
        return
    from ckpt_tools.forms.writers import safetensors_header
    header = safetensors_header(job.tensors(group), job.metadata())
    offsets = job.offsets(group)
    with open(path, "wb") as f:
        f.write(header)
        f.flush()
        dst = f.fileno()
        high = written = len(header)
        worker = durable.FileWorker()  # the byte ranges copied, and the writeback started, on a thread of their own
        try:
            for e in group:
                dtype = job.entry_dtype(e)
                quantized = job.fp8 or job.mxfp4
                for name, shape, data in _quantized(source.data(e, "float32"), job, e) if quantized else \
                        source.data(e, dtype):
                    itemsize, pos = ELEMENT_SIZES[dtype], len(header) + offsets[name]
                    if isinstance(data, _Bytes):  # the FP8 path's tensors, each of its own dtype
                        data, itemsize = data.view, ELEMENT_SIZES[data.dtype_name]
                    if isinstance(data, memoryview):
                        n = _pwrite(dst, data, pos)
                    else:
                        n = 0
                        for fd, offset, nbytes in data:
                            worker.copy(fd, offset, dst, pos + n, nbytes)
                            n += nbytes
                    if n != math.prod(shape) * itemsize:
                        raise LayoutError(f"{name}: wrote {n} bytes, planned {math.prod(shape) * itemsize}")
                    high = max(high, pos + n)
                source.release()
                bar.update(job.entry_bytes(e))
                if high - written >= WRITEBACK:
                    worker.writeback(dst, written, high - written)
                    written = high
            worker.submit(os.fsync, dst)
        except BaseException:
            worker.abandon()
            raise
        worker.finish()


def _quantized(tensors: Iterator[tuple[str, tuple[int, ...], Data]], job: Job,
               e: Entry) -> Iterator[tuple[str, tuple[int, ...], Data]]:
    """The entry's fp32 output tensors, the FP8-block ones as their e4m3 weight and fp32 scales, the MXFP4 ones as
    their blocks and scales (others in job.dtype)."""
    import torch

    from ckpt_tools.forms.writers import contiguous_bytes
    from ckpt_tools.model.mxfp4 import quantize, quantized
    from ckpt_tools.verbs.plan import packed_names
    family = families.get(job.meta.spec.architecture)
    for name, shape, data in tensors:
        t = torch.frombuffer(data, dtype=torch.float32).view(shape) if len(data) else torch.empty(shape)
        if job.fp8 and fp8_quantized(name, shape):
            q, inv = quantize_blocks(t, job.fp8)
            yield name, shape, _Bytes(contiguous_bytes(q), FP8)
            yield name + SCALE, tuple(inv.shape), _Bytes(contiguous_bytes(inv), "float32")
        elif job.mxfp4 and quantized(name, family):
            for packed, part in zip(packed_names(name), quantize(t)):
                yield packed, tuple(part.shape), _Bytes(contiguous_bytes(part), "uint8")
        else:
            dtype = job.entry_dtype(e)
            yield name, shape, _Bytes(contiguous_bytes(t.to(getattr(torch, dtype))), dtype)


class _Bytes:
    """Bytes in memory with their dtype name: written as a memoryview is."""

    def __init__(self, view: memoryview, dtype_name: str):
        self.view, self.dtype_name = view, dtype_name


def _write_archive(path: Path, group: list[Entry], bar, job: Job, source: ByteSource | TensorSource) -> None:
    """A .bin: streamed record by record (file ranges filled in the kernel), the dict of references pickled last."""
    import torch

    from ckpt_tools.forms.writers import TorchFileWriter
    writer, state = TorchFileWriter(path), {}
    slices: list[torch.Tensor] = []  # a stacked tensor's slices so far (hf.part_of), written as one when complete
    counts = {name: shape[0] for name, _, shape in job.tensors(group)}
    for e in group:
        target = getattr(torch, job.entry_dtype(e))
        for name, shape, data in source.data(e, job.entry_dtype(e)):
            base, part = hf.part_of(name)
            if part is not None:
                slices.append(_in_memory(data, target, shape).clone())
                if len(slices) == counts[base]:
                    state[base] = writer.tensor(torch.stack(slices))
                    slices = []
            elif isinstance(data, memoryview):
                state[name] = writer.tensor(_in_memory(data, target, shape))
            else:
                state[name] = writer.tensor_from_files(target, shape, data)
        source.release()
        bar.update(job.entry_bytes(e))
    writer.close(state)


def _in_memory(data: Data, dtype, shape: tuple[int, ...]):
    """An output tensor's bytes (in memory, or file ranges read) as a tensor of `dtype` and `shape`."""
    import torch
    if not isinstance(data, memoryview):
        data = memoryview(b"".join(os.pread(fd, n, offset) for fd, offset, n in data))
    t = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    return t.view(dtype).view(shape)


def _pwrite(fd: int, data: memoryview, pos: int) -> int:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], pos + done)
    return done
