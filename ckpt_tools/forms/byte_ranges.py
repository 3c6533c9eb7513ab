"""A checkpoint's tensors as byte ranges of its files, found without torch: the source `ckpt merge` copies from.

`ByteSource.open` describes our own checkpoints and Megatron-LM's (legacy per-rank files, torch_dist chunks)
from their pickles and indexes, read by `torchfile` without torch. Every shard file must pass the checks the
torch reader makes (the size meta.json records, checkpoint.extra_shards, checkpoint.shard_problems), the
TP replicas of a replicated tensor must be equal, and so must a tied embedding's last-stage copy. Where any
of that differs, or the files hold what only the torch reader decodes (a Megatron-LM optimizer, legacy QKV
rows to reorder, strided tensors), `open` raises Declined, nothing is written yet, and merge reads through the
torch reader (shards.open_checked), which also words what is wrong.

Each output tensor is row ranges of a full tensor (conversions.hf_rows), and each full tensor is pieces of the
source shards (shard_ops.reshard_pieces to TP 1, vocab trimmed). `data` hands merge, for each output tensor,
either byte ranges of the shard files (dim-0 pieces in the output dtype: copied file to file in the kernel)
or its bytes in memory: a row-parallel tensor's shards read (preadv) straight into their place in the full
rows, GPT-2's transposed weights transposed with numpy, and a dtype conversion as the last step (torch is
imported for that step only). A tensor whose HF values are arithmetic on megatron-core's (a zero-centred norm's
offset) is joined from its bytes and made by torch as the torch path makes it, the other tensors of the model still
copied. Nothing else here imports torch (nor numpy, for a Llama model).
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt_tools.errors import CkptError, LayoutError
from ckpt_tools.forms import checkpoint, megatron_lm
from ckpt_tools.forms.dtypes import ELEMENT_SIZES
from ckpt_tools.forms.torchfile import TensorInfo, Unreadable, read
from ckpt_tools.model import conversions, layout, shard_ops
from ckpt_tools.model.ranks import Rank
from ckpt_tools.team import SOLO, Team

if TYPE_CHECKING:  # merge's output tensors, handed in
    from ckpt_tools.verbs.plan import Entry

Range = tuple[Path, int, int]  # bytes of a file: (file, offset, nbytes)
IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024  # buffers per preadv call


class Declined(Exception):
    """These files are read through the torch reader instead (the reason in words)."""


@dataclass(frozen=True)
class Shard:
    """One TP shard of a tensor: its bytes in files, as parts along dim 0 (one part in a per-rank shard file;
    a torch_dist SwiGLU shard is two chunks, [gate_r; up_r])."""
    parts: tuple[tuple[Path, TensorInfo], ...]

    @property
    def dtype(self) -> str:
        return self.parts[0][1].dtype

    @property
    def rows(self) -> int:
        return sum(info.shape[0] for _, info in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for _, info in self.parts)

    @property
    def whole(self) -> list[Range]:
        return [(path, info.offset, info.nbytes) for path, info in self.parts]

    def byte_ranges(self, start: int, stop: int) -> list[Range]:
        """(file, offset, nbytes) of rows [start, stop) along dim 0, one per part they fall in."""
        out, first = [], 0
        for path, info in self.parts:
            row = info.nbytes // info.shape[0]
            lo, hi = max(start, first), min(stop, first + info.shape[0])
            if lo < hi:
                out.append((path, info.offset + (lo - first) * row, (hi - lo) * row))
            first += info.shape[0]
        return out


Shards = dict[str, list[Shard]]  # global key -> its TP shards, rank order


def _state(meta: checkpoint.Meta, name: str, entry: str) -> tuple[Path, dict]:
    """One shard file's `entry` dict, read without torch, when the file has the size meta.json records."""
    path = meta.dir / name
    if not path.is_file() or checkpoint.size_problem(meta, path):
        raise Declined(f"{path}: missing, or not of the size meta.json records")
    obj = read(path)
    if not (isinstance(obj, dict) and isinstance(obj.get(entry), dict)):
        raise Declined(f"{path}: holds no {entry!r} state dict")
    return path, obj[entry]


def _shard(path: Path, info: TensorInfo) -> Shard:
    if info.offset + info.nbytes > path.stat().st_size:
        raise Declined(f"{path}: a tensor beyond the end of the file")
    return Shard(((path, info),))


@dataclass
class Index:
    """A checkpoint's tensors as byte ranges: the model's shards and those to copy (the model's, or its fp32 master
    weights), the form's meta; `ours`: our format; `megatron_optimizer`: a Megatron-LM source that holds optimizer
    state (which the torch path decodes)."""
    meta: checkpoint.Meta
    model: Shards
    sources: Shards
    ours: bool = False
    megatron_optimizer: bool = False


def _no_master(from_master: bool) -> None:
    if from_master:
        raise Declined("no optimizer state is read from a Megatron-LM checkpoint")


def dist_index(src: Path, vocab_size: int | None, from_master: bool) -> Index:
    """A torch_dist (torch_dcp, fsdp_dtensor) checkpoint's model shards as byte ranges of its chunks, read torch-free;
    every check the torch path's reader makes must pass."""
    _no_master(from_master)
    from ckpt_tools.forms.torch_dist import DistCheckpoint
    ckpt = DistCheckpoint.read(megatron_lm.resolve_iter_dir(src), vocab_size, load=read, load_embedded=read)
    if ckpt.validate():
        raise Declined("the checkpoint does not match the layout table")
    parts = ckpt.byte_parts()
    if parts is None:
        raise Declined("a TP shard that is not whole chunks")
    held = ckpt.optimizer_form is not None or bool(ckpt.common.get("optimizer"))
    model = {key: [Shard(tuple(p)) for p in ranks] for key, ranks in parts.items()}
    return Index(ckpt.meta, model, model, megatron_optimizer=held)


def legacy_index(src: Path, vocab_size: int | None, from_master: bool) -> Index:
    """A legacy (`--ckpt-format torch`) checkpoint's model shards as byte ranges of its rank files, read torch-free;
    every check the torch path's reader makes must pass."""
    _no_master(from_master)
    iter_dir = megatron_lm.resolve_iter_dir(src)
    meta = megatron_lm.read_meta(iter_dir, vocab_size, load=read)
    if meta.raw.get(megatron_lm.VIRTUAL, 1) > 1:
        raise Declined("an interleaved pipeline's model chunks")
    if meta.raw.get(megatron_lm.WHOLE_EXPERTS):
        raise Declined("experts held whole in every TP rank's file (ETP 1), to cut")
    shards: Shards = {}
    held = False
    for rank in meta.grid.ranks():
        path = megatron_lm.model_path(iter_dir, rank, meta.pp_size)
        obj = read(path)
        held = held or bool(obj.get("optimizer")) or (path.parent / megatron_lm.DISTRIB_OPTIM).is_file()
        if megatron_lm.qkv_order(path, obj) is not None:
            raise Declined(f"{path}: legacy QKV rows to reorder")
        if megatron_lm.grouped_experts(obj.get("model") or {}):
            raise Declined(f"{path}: grouped experts to transpose")
        state = megatron_lm.model_state(obj, path)
        if state is None or checkpoint.shard_problems(meta, path, state, rank, _is_tensor):
            raise Declined(f"{path}: does not match the layout table")
        _add_shards(shards, meta, rank, path, state)
    return Index(meta, shards, shards, megatron_optimizer=held)


def ours_index(src: Path, vocab_size: int | None, from_master: bool) -> Index:
    """Our checkpoint's model shards, and with `from_master` its fp32 master weights, as byte ranges of its shard
    files; every check the torch path's reader makes must pass."""
    meta = checkpoint.Meta.read(checkpoint.resolve(src))
    if vocab_size not in (None, meta.spec.vocab_size) or checkpoint.extra_shards(meta):
        raise Declined("--vocab-size differs from meta.json, or extra shard files")
    if from_master and meta.fresh_optimizer:
        raise Declined("a fresh optimizer's masters are made from the weights (contract 2)")
    model = _model_shards(meta)
    return Index(meta, model, {**model, **field_shards(meta)} if from_master else model, ours=True)


def _model_shards(meta: checkpoint.Meta) -> Shards:
    """The tensors of every model shard, which must pass the checks the torch path makes."""
    shards: Shards = {}
    for rank in meta.grid.ranks():
        path, state = _state(meta, checkpoint.model_file(rank), "model")
        if checkpoint.shard_problems(meta, path, state, rank, _is_tensor):
            raise Declined(f"{path}: does not match the layout table")
        _add_shards(shards, meta, rank, path, state)
    return shards


def _is_tensor(t: object) -> bool:
    return isinstance(t, TensorInfo)


def _add_shards(shards: Shards, meta: checkpoint.Meta, rank: Rank, path: Path, state: dict) -> None:
    """One rank's tensors appended to their keys' shard lists (files are visited in rank order)."""
    for local, key in meta.rank_keys(rank, owned=True):
        if isinstance(state.get(local), TensorInfo):
            shards.setdefault(key, []).append(_shard(path, state[local]))


def field_shards(meta: checkpoint.Meta, field: str = "master") -> Shards:
    """One optimizer field (the fp32 master weights, exp_avg or exp_avg_sq) of every optimizer shard, each of its
    parameter's shard shape."""
    shards: Shards = {}
    for rank in meta.grid.ranks():
        path, state = _state(meta, checkpoint.optimizer_file(rank), "optimizer")
        for local, key in meta.rank_keys(rank, owned=True):
            shape = layout.shard_shape(key, meta.spec, meta.padded_vocab, meta.tp_size, meta.pp_size)
            if shape is None or not layout.has_optimizer_state(key, meta.spec, meta.pp_size):
                continue
            entry = state.get(local)
            master = entry.get(field) if isinstance(entry, dict) else None
            if not (isinstance(master, TensorInfo) and master.shape == shape):
                raise Declined(f"{path}: no {field} of shape {shape} for {local}")
            shards.setdefault(key, []).append(_shard(path, master))
    return shards


# ---------------------------------------------------------------- HF rows -> full rows -> source shards
def _full_pieces(key: str, meta: checkpoint.Meta, src_tp: int) -> list[shard_ops.Piece]:
    """The full (TP 1) tensor of `key`, vocab rows trimmed to the true vocab, as pieces of the source shards (at
    TP `src_tp`, ByteSource.tp_of)."""
    spec = meta.spec
    vocab = layout.has_padded_rows(key, spec, meta.pp_size)
    return shard_ops.reshard_pieces(key, spec, src_tp, meta.padded_vocab, 1,
                                 spec.vocab_size if vocab else meta.padded_vocab, 0, meta.pp_size)


def _byte_ranges(shards: list[Shard], pieces: list[shard_ops.Piece], rows: shard_ops.Rows) -> list[Range]:
    """Rows of a full tensor made of dim-0 pieces -> byte ranges (file, offset, nbytes) of the shard files."""
    out = []
    for a, b in rows:
        pos = 0
        for p in pieces:
            lo, hi = max(a, pos), min(b, pos + p.stop - p.start)
            if lo < hi:
                out += shards[p.rank].byte_ranges(p.start + lo - pos, p.start + hi - pos)
            pos += p.stop - p.start
    return out


class _Files:
    """The source files, opened read-only on first use."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}

    def fd(self, path: Path) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def read_into(self, views: list[memoryview], path: Path, offset: int) -> None:
        """Fill `views`, in order, with the file's bytes from `offset` on (preadv: a scatter read)."""
        fd, i = self.fd(path), 0
        while i < len(views):
            chunk = views[i:i + IOV_MAX]
            n = os.preadv(fd, chunk, offset)
            if n <= 0:
                raise OSError(f"{path}: ended at byte {offset}")
            offset += n
            if n == sum(map(len, chunk)):
                i += len(chunk)
                continue
            while n >= len(views[i]):  # a short read: skip the views it filled, trim the one it ended in
                n -= len(views[i])
                i += 1
            views[i] = views[i][n:]

    def same(self, a: Range, b: Range, chunk: int = 1 << 24) -> bool:
        if a[2] != b[2]:
            return False
        return all(os.pread(self.fd(a[0]), min(chunk, a[2] - k), a[1] + k)
                   == os.pread(self.fd(b[0]), min(chunk, a[2] - k), b[1] + k) for k in range(0, a[2], chunk))

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)


def _transposed(data: memoryview, shape: tuple[int, int], itemsize: int) -> memoryview:
    """The bytes of a [b, a] tensor -> those of its [a, b] transpose (GPT-2's Conv1D weights): moved, not
    converted. numpy is imported only here."""
    import numpy as np
    arr = np.frombuffer(data, np.dtype(f"<u{itemsize}")).reshape(shape[::-1])
    return memoryview(np.ascontiguousarray(arr.T)).cast("B")


def _converted(data: memoryview, src: str, dst: str, threads: int | None = None) -> memoryview:
    """The bytes of a tensor in dtype `src` -> those of the same values in `dst`, as torch's `.to` rounds them (the
    one step that imports torch; `threads`: its intra-op threads)."""
    import torch
    if threads:
        torch.set_num_threads(threads)
    if not len(data):
        return data
    t = torch.frombuffer(data, dtype=getattr(torch, src)).to(getattr(torch, dst))
    return memoryview(t.view(torch.uint8).numpy())


class ByteSource:
    """Merge's source when the files can be read as byte ranges: `data(entry, dtype)` gives each output tensor."""

    def __init__(self, meta: checkpoint.Meta, model: Shards, sources: Shards, ours: bool):
        self.meta, self.model, self.shards, self.ours = meta, model, sources, ours
        self.megatron_optimizer = False  # a Megatron-LM source holding optimizer state (decoded by the torch path)
        self.files = _Files()
        self._buf, self._sink = bytearray(), bytearray()
        self.note = None  # a tied copy that differs is declined, so the torch reader words the note
        self.torch_threads: int | None = None  # torch's intra-op threads for a conversion step

    @classmethod
    def open(cls, src: str | Path, vocab_size: int | None, from_master: bool) -> ByteSource:
        """The model shards and the shards to copy (model or master weights), or Declined."""
        from ckpt_tools.forms import readers
        try:
            form = readers.detect(src, sharded=True)
            if form.byte_index is None:
                raise Declined(f"{form.name}: read through torch only")
            index = form.byte_index(Path(src), vocab_size, from_master)
        except (Unreadable, CkptError) as e:
            raise Declined(str(e)) from e
        source = cls(index.meta, index.model, index.sources, index.ours)
        source.megatron_optimizer = index.megatron_optimizer
        try:
            source.check_replicas(index.sources)
            if not source.consistent():
                raise Declined("replicas that differ, or a tied copy that differs")
        except BaseException:
            source.close()
            raise
        return source

    def check_replicas(self, shards: Shards) -> None:
        """Declined unless the TP shards of each tensor have one dtype and a replicated tensor's are equal (the
        torch path refuses replicas that differ, and converts dtypes)."""
        if any(s.dtype != ts[0].dtype or s.dtype not in ELEMENT_SIZES for ts in shards.values() for s in ts):
            raise Declined("TP shards of one tensor in different dtypes")
        if not all(self.files.same(a, b) for a, b in self._replica_pairs(shards)):
            raise Declined("replicated tensors that differ between TP ranks")

    def _replica_pairs(self, shards: Shards) -> list[tuple[Range, Range]]:
        meta = self.meta
        return [(a, b) for key, ts in shards.items() if layout.is_replicated(key, meta.spec, meta.pp_size)
                for s in ts[1:] for a, b in zip(s.whole, ts[0].whole)]

    def check_hashes(self, team: Team = SOLO) -> None:
        """--check-hashes: the content hash of every file meta.json records (Megatron-LM records none)."""
        if self.ours:
            checkpoint.check_hashes(self.meta, team)

    def tp_of(self, key: str) -> int:
        """The TP its shards of `key` are at: the checkpoint's, or 1 where a tensor split over TP is held whole (a
        row-parallel tensor that a torch_dist save holds as whole rows)."""
        shards = self.shards[key]
        return 1 if len(shards) == 1 else self.meta.tp_size

    def _skip(self, nbytes: int) -> memoryview:
        """Scratch bytes a scatter read drops (columns no output piece takes), reused."""
        if len(self._sink) < nbytes:
            self._sink = bytearray(nbytes)
        return memoryview(self._sink)[:nbytes]

    def buffer(self, nbytes: int) -> memoryview:
        """Memory for one tensor, reused: its pages stay mapped from one tensor to the next."""
        if len(self._buf) < nbytes:
            self._buf = bytearray(nbytes)
        return memoryview(self._buf)[:nbytes]

    def data(self, e: Entry, dtype: str) -> Iterator[tuple[str, tuple[int, ...], list[Range] | memoryview]]:
        """(name, shape, bytes) of each output tensor of one entry, in `dtype`: byte ranges of the shard files where
        the tensor is dim-0 pieces already in `dtype`, else its bytes in memory (joined, transposed, converted)."""
        meta, src_dtype = self.meta, self.shards[e.key][0].dtype
        itemsize = ELEMENT_SIZES[src_dtype]
        pieces = _full_pieces(e.key, meta, self.tp_of(e.key))
        full_rows = layout.full_shape(e.key, meta.spec, meta.padded_vocab, meta.pp_size)[0]
        if len(pieces) == 1 and pieces[0].dim == 1:  # a tensor held whole: its rows, as a dim-0 piece
            pieces = [shard_ops.Piece(pieces[0].rank, 0, 0, full_rows)]
        if e.kind in conversions.ARITHMETIC:
            yield from self._made(e, dtype, pieces, full_rows, itemsize)
            return
        for name, rows, shape in zip(e.names, conversions.hf_rows(e.kind, meta.spec, full_rows), e.shapes):
            transpose = e.kind in conversions.TRANSPOSED and len(shape) == 2
            if pieces[0].dim == 0 and not transpose and src_dtype == dtype:
                yield name, shape, [(self.files.fd(p), o, n) for p, o, n in _byte_ranges(self.shards[e.key], pieces, rows)]
                continue
            data = self.gather(self.shards[e.key], pieces, rows, itemsize)
            if transpose:
                data = _transposed(data, shape, itemsize)
            yield name, shape, data if src_dtype == dtype else _converted(data, src_dtype, dtype, self.torch_threads)

    def _made(self, e: Entry, dtype: str, pieces: list[shard_ops.Piece], full_rows: int,
              itemsize: int) -> Iterator[tuple[str, tuple[int, ...], memoryview]]:
        """An entry whose HF values are arithmetic on the full tensor (a zero-centred norm's offset): the full tensor's
        bytes joined, then made by torch as the torch path makes them (conversions.to_hf on the full tensor in its own
        dtype, then the cast). torch is imported here, for these tensors only."""
        import torch

        from ckpt_tools.forms.writers import contiguous_bytes
        meta, src = self.meta, self.shards[e.key][0].dtype
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        # the rows the pieces hold (a vocab tensor's true rows), all of them where the pieces are columns
        rows = sum(p.stop - p.start for p in pieces) if pieces[0].dim == 0 else full_rows
        shape = (rows,) + tuple(layout.full_shape(e.key, meta.spec, meta.padded_vocab, meta.pp_size)[1:])
        data = self.gather(self.shards[e.key], pieces, [(0, rows)], itemsize)
        full = torch.frombuffer(data, dtype=getattr(torch, src)).view(shape)
        for name, shape, t in zip(e.names, e.shapes, conversions.to_hf(e.kind, full, meta.spec)):
            if tuple(t.shape) != tuple(shape):
                raise LayoutError(f"{name}: {tuple(t.shape)}, planned {tuple(shape)}")
            yield name, shape, contiguous_bytes(t.to(getattr(torch, dtype)))

    def release(self) -> None:
        """Nothing to release: no pages are mapped (the buffer is reused from one tensor to the next)."""

    def gather(self, shards: list[Shard], pieces: list[shard_ops.Piece], rows: shard_ops.Rows, itemsize: int) -> memoryview:
        """Rows of a tensor made of `pieces` of the shards, in memory: dim-0 pieces one after another; on dim 1
        the pieces side by side, each a shard's columns [start, stop), read straight into their place in the output
        rows by one scatter read (the columns of other pieces, where a piece is some of a shard's, land in a reused
        scratch buffer and are dropped)."""
        if pieces[0].dim == 0:
            ranges = _byte_ranges(shards, pieces, rows)
            buf, pos = self.buffer(sum(n for _, _, n in ranges)), 0
            for path, offset, n in ranges:
                self.files.read_into([buf[pos:pos + n]], path, offset)
                pos += n
            return buf
        widths = [(p.stop - p.start) * itemsize for p in pieces]  # bytes of each piece's part of a row
        width, nrows = sum(widths), sum(b - a for a, b in rows)
        buf, col = self.buffer(nrows * width), 0
        for p, w in zip(pieces, widths):
            shard = shards[p.rank]
            src_width, at, out_row = shard.nbytes // shard.rows, p.start * itemsize, 0
            if any(info.nbytes != info.shape[0] * src_width for _, info in shard.parts):
                raise LayoutError(f"{shard.parts[0][0]}: a row-parallel shard in chunks of other widths than its "
                                  f"rows: the file is damaged or not Megatron-LM's; restore it from the source")
            before, after = self._skip(at), self._skip(src_width - at - w)
            for a, b in rows:
                for path, offset, n in shard.byte_ranges(a, b):  # a run of whole rows in one chunk each
                    views = []
                    for x in range(out_row * width + col, (out_row + n // src_width) * width + col, width):
                        views += [v for v in (before, buf[x:x + w], after) if len(v)]
                    self.files.read_into(views, path, offset)
                    out_row += n // src_width
            col += w
        return buf

    def consistent(self) -> bool:
        """Whether the torch path would take these bytes as they are (beside check_replicas): at PP > 1 each aliased
        row's copy (a tied output layer) equal to the tensor it copies in the true vocab rows (it notes a difference)."""
        meta, model = self.meta, self.model
        pairs = []
        for copy, original in layout.aliases(meta.spec).items():
            if copy not in model:
                continue
            rows = [(0, meta.spec.vocab_size)]
            a, b = (_byte_ranges(model[k], _full_pieces(k, meta, self.tp_of(k)), rows) for k in (original, copy))
            pairs += list(zip(a, b))  # the same pieces: both are vocab tensors of one shape (checked)
        return all(self.files.same(a, b) for a, b in pairs)

    def close(self) -> None:
        self.files.close()
