"""A checkpoint's tensors as byte ranges of its files, found without torch: the source `ckpt merge` copies from.

`ByteSource.open` takes the index of the checkpoint's form (formats/readers.py; the indexes are
forms/byte_index.py's: our own checkpoints, Megatron-LM's legacy per-rank files and torch_dist chunks); the TP
replicas of a replicated tensor must then be equal, and so must a tied embedding's last-stage copy. Where any of
that differs, or the index declines, `open` raises Declined, nothing is written yet, and merge reads through the
torch reader (shards.open_checked), which also words what is wrong.

Each output tensor is row ranges of a full tensor (conversions.hf_rows), and each full tensor is pieces of the
source shards (shard_ops.reshard_pieces to TP 1, vocab trimmed). `data` hands merge, for each output tensor,
either byte ranges of the shard files (dim-0 pieces in the output dtype: copied file to file in the kernel)
or its bytes in memory: a row-parallel tensor's shards read (preadv) straight into their place in the full
rows, GPT-2's transposed weights transposed with numpy, and a dtype conversion as the last step (torch is
imported for that step only). A tensor whose HF values are arithmetic on megatron-core's (a zero-centred norm's
offset) is joined from its bytes and made by torch as the torch path makes it, the other tensors of the model still
copied. A tensor whose bytes are not the layout table's (the index's `made`: grouped or whole experts) is made by the
form's torch reader (`maker`, opened and checked by `open`), tensor by tensor: merge takes its full tensor, and the
byte copies of reshard its shards, from memory. Nothing else here imports torch (nor numpy, for a Llama model).
"""
from __future__ import annotations

import os
import threading
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt_tools.errors import CkptError, LayoutError
from ckpt_tools.forms import checkpoint
from ckpt_tools.forms.byte_index import Declined, Range, Shard, Shards
from ckpt_tools.forms.dtypes import ELEMENT_SIZES
from ckpt_tools.forms.made import MadeFields
from ckpt_tools.forms.torchfile import Unreadable
from ckpt_tools.model import conversions, layout, shard_ops
from ckpt_tools.team import SOLO, Team

if TYPE_CHECKING:  # merge's output tensors, handed in
    from ckpt_tools.verbs.plan import Entry

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024  # buffers per preadv call


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
    """The source files, opened read-only on first use (by whichever thread asks first)."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    def fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            with self._lock:
                if path not in self._fds:
                    self._fds[path] = os.open(path, os.O_RDONLY)
                fd = self._fds[path]
        return fd

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
    """A checkpoint's tensors as byte ranges of its files, or made by its torch reader tensor by tensor (`made`; every
tensor of a source read `through` it): the source of merge (`data(entry, dtype)` gives each output tensor) and of
the writers of reshard (verbs/dist_copy.py, verbs/ours_copy.py)."""

    def __init__(self, meta: checkpoint.Meta, model: Shards, sources: Shards, ours: bool):
        self.meta, self.model, self.shards, self.ours = meta, model, sources, ours
        self.megatron_optimizer = False  # a Megatron-LM source holding optimizer state (decoded by the torch path)
        self.made: Collection[str] = ()  # the keys torch makes, one by one (byte_index.Index.made)
        self.maker = None  # what makes them: the form's torch reader (shards.Reader)
        self.read_through = False  # every tensor made by the torch reader (`through`)
        self.files = _Files()
        self._scratch = threading.local()  # each thread's reused buffers (buffer, _skip)
        self.note = None  # a tied copy that differs is declined, so the torch reader words the note
        self.torch_threads: int | None = None  # torch's intra-op threads for a conversion step

    @classmethod
    def open(cls, src: str | Path, vocab_size: int | None, from_master: bool,
             carry_optimizer: bool = False) -> ByteSource:
        """The model shards and the shards to copy (model or master weights), or Declined; `carry_optimizer`: a
        Megatron-LM optimizer is to be carried: the form's torch reader decodes its fields, tensor by tensor
        (`made_fields`), where it reads them all (else Declined: the torch path carries it or words what it leaves)."""
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
        carried = carry_optimizer and index.megatron_optimizer
        try:
            source.check_replicas(index.sources)
            if not source.consistent():
                raise Declined("replicas that differ, or a tied copy that differs")
            if index.made or carried:  # the torch reader last: it reads every file
                source.made, source.maker = index.made, _checked_reader(form, Path(src), vocab_size)
            if carried and (source.maker.unread_optimizer() or not source.maker.has_optimizer()):
                raise Declined("a Megatron-LM optimizer in a form not read: the torch path says so")
        except BaseException:
            source.close()
            raise
        return source

    @classmethod
    def through(cls, reader) -> ByteSource:
        """A checkpoint read through its torch reader alone (shards.open_checked: the byte index declined it, or the
        torch path was asked for), for the same writers: every tensor made by the reader, tensor by tensor (`made`),
        its optimizer state too (`made_fields`). `reader`: its torch reader, closed with the source."""
        meta = reader.meta
        source = cls(meta, {}, {}, False)
        source.made = frozenset(k for k in reader.keys() if layout.holds_weights(k, meta.spec, meta.pp_size))
        source.maker, source.read_through = reader, True
        return source

    def held(self, key: str) -> str:
        """The source's tensor that holds `key`: itself, or the tensor an aliased copy copies where the source lacks
        the copy (a tied output layer at PP 1)."""
        return key if key in self.shards or key in self.made else layout.source_key(key, self.shards)

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
        return self._reused("sink", nbytes)

    def buffer(self, nbytes: int) -> memoryview:
        """Memory for one tensor, reused: its pages stay mapped from one tensor to the next (one buffer per thread:
        merge writes two output files at once)."""
        return self._reused("buf", nbytes)

    def _reused(self, name: str, nbytes: int) -> memoryview:
        buf = getattr(self._scratch, name, b"")
        if len(buf) < nbytes:
            buf = bytearray(nbytes)
            setattr(self._scratch, name, buf)
        return memoryview(buf)[:nbytes]

    def data(self, e: Entry, dtype: str) -> Iterator[tuple[str, tuple[int, ...], list[Range] | memoryview]]:
        """(name, shape, bytes) of each output tensor of one entry, in `dtype`: byte ranges of the shard files where
        the tensor is dim-0 pieces already in `dtype`, else its bytes in memory (joined, transposed, converted)."""
        if e.key in self.made:
            yield from hf_bytes(e, self.made_full(e.key), self.meta.spec, dtype)
            return
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
        meta, src = self.meta, self.shards[e.key][0].dtype
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        # the rows the pieces hold (a vocab tensor's true rows), all of them where the pieces are columns
        rows = sum(p.stop - p.start for p in pieces) if pieces[0].dim == 0 else full_rows
        shape = (rows,) + tuple(layout.full_shape(e.key, meta.spec, meta.padded_vocab, meta.pp_size)[1:])
        data = self.gather(self.shards[e.key], pieces, [(0, rows)], itemsize)
        yield from hf_bytes(e, torch.frombuffer(data, dtype=getattr(torch, src)).view(shape), meta.spec, dtype)

    def made_full(self, key: str):
        """The full tensor of a key torch makes (`made`), at the source's padded vocab."""
        if self.torch_threads:
            import torch
            torch.set_num_threads(self.torch_threads)
        return self.maker.full(key)

    def made_shard_cast(self, key: str, shard):
        """A shard of a made tensor in the dtype it is written in (a source's torch reader makes it so)."""
        return shard

    def made_shard(self, key: str, tp_rank: int):
        """TP rank `tp_rank`'s shard (at the source's TP) of a key torch makes, contiguous; a replicated tensor's TP
        copies must agree (shard_ops.join raises in words where they differ)."""
        shards, meta = self.maker.shards(key), self.meta
        if layout.is_replicated(key, meta.spec, meta.pp_size):
            shard_ops.join(key, shards, meta.spec, meta.pp_size)
        return shards[tp_rank].contiguous()

    def made_target_shard(self, key: str, held: str, rank: int, tp: int, padded: int, pp: int) -> tuple[str, tuple, list]:
        """Target TP rank `rank`'s shard of `key` (`held`: the source's tensor that holds it) at TP `tp`, gathered from
        the pieces of the source shards the torch reader makes (shard_ops.reshard_pieces: no full tensor, where the
        pieces are whole shards), a replicated tensor's copies checked: dtype, shape and its bytes."""
        return MadeFields(self, None).shard(key, held, rank, tp, padded, pp)

    def made_fields(self, field: str) -> MadeFields:
        """A Megatron-LM optimizer's field (master, exp_avg, exp_avg_sq, step) of every parameter, made by the torch
        reader (`open(..., carry_optimizer=True)`)."""
        return MadeFields(self, field)

    def release(self) -> None:
        """The torch reader's pages, where it made a tensor; the byte copies map none (the buffer is reused from one
        tensor to the next)."""
        if self.maker is not None:
            self.maker.release()

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
        if self.maker is not None:
            self.maker.close()


def _checked_reader(form, src: Path, vocab_size: int | None):
    """The form's torch reader, for the tensors it makes; Declined where it finds the checkpoint unreadable (the torch
    path then words it)."""
    reader = form.reader(src, vocab_size)
    try:
        if reader.validate():
            raise Declined(f"{src}: the torch reader finds problems")
    except CkptError as e:
        reader.close()
        raise Declined(str(e)) from e
    except BaseException:
        reader.close()
        raise
    return reader


def hf_bytes(e: Entry, full, spec, dtype: str) -> Iterator[tuple[str, tuple[int, ...], memoryview]]:
    """(name, shape, bytes) of each output tensor of one entry, from its full tensor through torch (conversions.to_hf,
    then the cast to `dtype`): how the torch path makes every tensor, and the byte path the tensors it leaves to
    torch."""
    import torch

    from ckpt_tools.forms.writers import contiguous_bytes
    for name, shape, t in zip(e.names, e.shapes, conversions.to_hf(e.kind, full, spec)):
        if tuple(t.shape) != tuple(shape):
            raise LayoutError(f"{name}: {tuple(t.shape)}, planned {tuple(shape)}")
        yield name, shape, contiguous_bytes(t.to(getattr(torch, dtype)))
