"""Streaming writers: tensors go to disk as soon as they are made, never a whole state dict in RAM.

`safetensors_header` is a safetensors file's header for a plan of names, dtypes and shapes known up front (the
merge writes the tensors' bytes after it). `TorchFileWriter` writes a standard `torch.save` zip archive one
storage record at a time and pickles the small object tree (with references to those records)
last, so `torch.load(weights_only=True, mmap=True)` reads it like any other checkpoint file.
`safetensors_header` needs no torch (the torch-free merge writes with it, and with durable.copy_range); torch is
imported where tensors are handled.
"""
from __future__ import annotations

import collections
import json
import math
import os
import pickle
import struct
import sys
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpt_tools.durable import copy_range, fsync_file
from ckpt_tools.errors import LayoutError
from ckpt_tools.forms.dtypes import ELEMENT_SIZES, SAFETENSORS_NAMES
from ckpt_tools.forms.torchfile import record_offset

if TYPE_CHECKING:
    import torch



def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


# The data section's alignment in the safetensors files written here: the torch.save archives and torch_dist chunks
# they are copied from keep tensors 64-byte aligned, and the kernel copies a range 1.6x slower when its source and
# destination differ in their alignment to 16 bytes (0.63 against 0.38 s/GB page cache to page cache here; 8-byte
# alignment, safetensors' own, leaves half of all headers 8 bytes off)
DATA_ALIGNMENT = 64


def safetensors_header(plan: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None) -> bytes:
    """What a safetensors file holding `plan` [(name, dtype name, shape)], in order, has before its data:
    the header's length (8 bytes) and the JSON header, padded with spaces so that the data section starts
    DATA_ALIGNMENT-aligned (safetensors itself pads to 8; JSON takes any trailing spaces)."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, dtype, shape in plan:
        nbytes = math.prod(shape) * ELEMENT_SIZES[dtype]
        header[name] = {"dtype": SAFETENSORS_NAMES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % DATA_ALIGNMENT)
    return struct.pack("<Q", len(text)) + text


def contiguous_bytes(t: torch.Tensor) -> memoryview:
    """The tensor's bytes (little-endian, row-major) without a copy when it is already contiguous."""
    import torch
    t = t.detach().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.view(-1).view(torch.uint8).numpy())


class _StorageRef:
    def __init__(self, key: str, dtype: torch.dtype, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class _TensorRef:
    """Stands for a tensor already written; pickles exactly as torch.save pickles a tensor."""

    def __init__(self, storage: _StorageRef, shape: tuple[int, ...]):
        self.storage, self.shape = storage, shape

    def __reduce_ex__(self, protocol):
        import torch
        stride, acc = [], 1
        for n in reversed(self.shape):
            stride.append(acc)
            acc *= n
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, 0, tuple(self.shape), tuple(reversed(stride)), False, collections.OrderedDict()))


def _storage_type(dtype: torch.dtype) -> type:
    """torch.bfloat16 -> torch.BFloat16Storage, the class torch.save names for a storage of that dtype."""
    import torch
    return getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _StorageRef):
            return ("storage", _storage_type(obj.dtype), obj.key, "cpu", obj.numel)
        return None


class TorchFileWriter:
    """A torch.save-compatible zip file whose tensors are written one at a time by `tensor()`.

    `close(obj)` pickles `obj`, in which every tensor is a reference returned by `tensor()` (or a
    plain tensor, written then); the storages are 64-byte aligned so the file loads with mmap.
    """

    def __init__(self, path: str | Path):
        import torch
        self.path = Path(path)
        self._zip = torch._C.PyTorchFileWriter(str(self.path), False, 64)  # integrity: the content hash in meta.json
        self._count = 0
        self.nbytes = 0
        self._holes: list[tuple[str, list[tuple[int, int, int]]]] = []  # (record, [(fd, offset, nbytes)])
        self.growth: Growth | None = None

    def follow(self) -> Growth:
        """A Growth that says how far this file is final as it is written (a hash can start now)."""
        import weakref
        if self.growth is None:
            self.growth = Growth(self.path)
            weakref.finalize(self, self.growth.dropped)  # dropped unclosed (an error): the reader stops
        return self.growth

    def _wrote(self) -> None:
        if self.growth is not None:
            self.growth.wrote()

    def _key(self) -> str:
        self._count += 1
        return str(self._count - 1)

    def tensor_from_files(self, dtype: torch.dtype, shape: tuple[int, ...],
                          ranges: list[tuple[int, int, int]]) -> _TensorRef:
        """A tensor whose bytes are byte ranges [(fd, offset, nbytes)] of other files, in order. Its record
        is reserved now (the archive's bytes do not depend on the data) and filled file to file in the
        kernel (copy_file_range: the bytes never pass through this process) when the archive is closed."""
        import torch
        key, nbytes = self._key(), sum(n for _, _, n in ranges)
        if nbytes != torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size():
            raise LayoutError(f"{self.path}: {nbytes} bytes for a {dtype} tensor of shape {tuple(shape)}")
        if self.growth is not None:
            self.growth.reserving()
        self._zip.write_record_metadata(f"data/{key}", nbytes)
        self._holes.append((f"{self._zip.archive_name()}/data/{key}", ranges))
        self.nbytes += nbytes
        return _TensorRef(_StorageRef(key, dtype, torch.Size(shape).numel()), tuple(shape))

    def zeros(self, dtype: torch.dtype, shape: tuple[int, ...]) -> _TensorRef:
        """A tensor of zeros that is never made: its record is reserved and left unwritten, so the file reads zeros
        there, a hole that takes no disk where the filesystem has holes (a fresh optimizer's moments)."""
        import torch
        key, nbytes = self._key(), torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        self._zip.write_record_metadata(f"data/{key}", nbytes)
        self.nbytes += nbytes
        return _TensorRef(_StorageRef(key, dtype, torch.Size(shape).numel()), tuple(shape))

    def tensor(self, t: torch.Tensor) -> _TensorRef:
        t = t.detach().contiguous()
        key = self._key()
        storage = t.untyped_storage()
        if t.storage_offset() or storage.nbytes() != t.nbytes:  # a view: its own bytes only, no copy
            begin = t.storage_offset() * t.element_size()
            storage = storage[begin:begin + t.nbytes]
        self._zip.write_record(f"data/{key}", storage, t.nbytes)
        self.nbytes += t.nbytes
        self._wrote()
        return _TensorRef(_StorageRef(key, t.dtype, t.numel()), tuple(t.shape))

    def _refs(self, obj: Any) -> Any:
        import torch
        if torch.is_tensor(obj):
            return self.tensor(obj)
        if isinstance(obj, dict):
            return type(obj)((k, self._refs(v)) for k, v in obj.items())
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._refs(v) for v in obj)
        return obj

    def close(self, obj: Any, fsync: bool = True, background: bool = False) -> Filling | None:
        """Write the object tree and the archive's end; fsync=False leaves the fsync to the caller. With `background`
        the records reserved by tensor_from_files are filled on a thread of this file's own (durable.FileWorker): the
        returned Filling's wait() says when the file's bytes are complete (the caller waits for it before reading
        the file back or fsyncing it), and the caller goes on with the next file meanwhile; None: nothing to fill."""
        try:
            filling = self._close(obj, background)
        except BaseException:
            if self.growth is not None:  # its reader stops instead of waiting for the rest
                self.growth.dropped()
            raise
        if self.growth is not None:
            self.growth.closed(filling)
        if fsync:
            if filling is not None:
                filling = filling.wait()
            fsync_file(self.path)
        return filling

    def _close(self, obj: Any, background: bool) -> Filling | None:
        import io as _io
        buf = _io.BytesIO()
        _Pickler(buf, protocol=2).dump(self._refs(obj))
        data = buf.getvalue()
        self._zip.write_record("data.pkl", data, len(data))
        self._zip.write_record(".format_version", "1", 1)
        self._zip.write_record(".storage_alignment", "64", 2)
        self._zip.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        self._zip.write_end_of_file()
        del self._zip
        if not self._holes:
            return None
        filling = self._fill_holes(background)
        return filling if background else filling.wait()

    def _fill_holes(self, background: bool) -> Filling:
        """Copy every reserved record's byte ranges into place (in order, on a FileWorker with `background`, else
        here); the records' places are read from the finished archive."""
        from ckpt_tools.durable import FileWorker
        with zipfile.ZipFile(self.path) as z:
            where = {info.filename: info.header_offset for info in z.infolist()}
        fd = os.open(self.path, os.O_RDWR)
        try:
            places = [record_offset(fd, where[record]) for record, _ in self._holes]
        except BaseException:
            os.close(fd)
            raise
        # the bytes up to the first record still to fill are final now, and each filled record moves that mark to
        # the next one (they are filled in file order): a reader of the file (its hash) follows the copies
        ordered = all(a < b for a, b in zip(places, places[1:]))
        filling = Filling(fd, FileWorker() if background else None, os.fstat(fd).st_size,
                          places[0] if ordered else 0)
        worker = filling._worker
        try:
            for i, ((_, ranges), pos) in enumerate(zip(self._holes, places)):
                start = pos
                for src, offset, nbytes in ranges:
                    if worker is not None:
                        worker.copy(src, offset, fd, pos, nbytes)
                    else:
                        copy_range(src, offset, fd, pos, nbytes)
                    pos += nbytes
                if worker is not None:  # the record's pages on their way to the disk while the next ones are copied
                    worker.writeback(fd, start, pos - start)
                    if ordered and i + 1 < len(places):
                        worker.submit(filling._final, places[i + 1])
            if worker is not None:  # the rest (what torch's writer wrote) likewise
                worker.writeback(fd, 0, 0)
                worker.submit(filling._final, filling.size)
        except BaseException:
            if worker is not None:
                worker.abandon()
            os.close(fd)
            raise
        self._holes.clear()
        return filling


class Growth:
    """How far a TorchFileWriter's file is final while it is still being written, for a hash that follows the writer
    (hashing.hash_file(ready=...)) instead of reading the file after it is closed. torch's zip writer only appends (its
    write callback refuses any write that is not at the end): each record in order, a reserved record skipped over
    forward, the end of the archive last. So the bytes before the file's current end are final, up to the first record
    reserved for copies (tensor_from_files); from the close on, the Filling of those copies says how far. The writer
    reports each step, and a writer that fails or is dropped unclosed stops the reader with an error instead of
    leaving it waiting. It holds no descriptor: the file's end is read by its path."""

    def __init__(self, path: Path):
        import threading
        self.path = path
        self._changed = threading.Condition()
        self._frozen: int | None = None  # the file's end before its first record reserved for copies
        self._closed = self._dropped = self._finished = False
        self._size = 0
        self._filling: Filling | None = None

    def _end(self) -> int:
        return os.stat(self.path).st_size

    def reserving(self) -> None:
        """The writer is about to reserve a record that copies fill at the close: nothing from here on is final yet."""
        with self._changed:
            if self._frozen is None:
                self._frozen = self._end()

    def wrote(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def closed(self, filling: Filling | None) -> None:
        with self._changed:
            self._closed, self._size, self._filling = True, self._end(), filling
            orphaned = self._finished  # the reader already gave up (it failed): nobody else waits for the copies
            self._changed.notify_all()
        if orphaned and filling is not None:
            filling.wait()

    def dropped(self) -> None:
        with self._changed:
            self._dropped = True
            self._changed.notify_all()

    def ready(self, pos: int) -> int:
        """As Filling.ready: how far the bytes are final once that is beyond `pos`; the final size once all are."""
        with self._changed:
            while not self._closed:
                if self._dropped:
                    raise OSError(f"{self.path}: its writer stopped before the file was complete")
                end = self._end()
                mark = end if self._frozen is None else min(end, self._frozen)
                if mark > pos:
                    return mark
                self._changed.wait(0.05)
        if self._filling is not None:
            return self._filling.ready(pos)
        return self._size

    def finish(self) -> None:
        """After the reader, done or failed: waits for the copies still filling the file (raising their error)."""
        with self._changed:
            self._finished = True
            filling = self._filling
        if filling is not None:
            filling.wait()


class Filling:
    """The copies into one TorchFileWriter file still running on its FileWorker (or done: no worker). ready() lets a
    reader follow them; wait() waits for them all, closes the file's descriptor and raises the first error a copy
    raised; it returns None."""

    def __init__(self, fd: int, worker, size: int, final: int):
        import threading
        self._fd, self._worker, self.size = fd, worker, size
        self._upto = size if worker is None else final  # the bytes before this are final
        self._changed = threading.Condition()

    def _final(self, upto: int) -> None:
        with self._changed:
            self._upto = upto
            self._changed.notify_all()

    def ready(self, pos: int) -> int:
        """How far the file's bytes are final, once that is beyond `pos` (the size: all of them, and at once when `pos`
        is there). A failed copy stops the worker: then this waits for it and raises its error."""
        if pos >= self.size:
            return self.size
        with self._changed:
            while self._upto <= pos:
                if self._worker is None or self._worker._error is not None or not self._worker._thread.is_alive():
                    break
                self._changed.wait(0.05)
            upto = self._upto
        if upto <= pos:
            self.wait()  # raises what stopped the copies
            return self.size
        return upto

    def wait(self) -> None:
        if self._fd is None:
            return None
        try:
            if self._worker is not None:
                self._worker.finish()
        finally:
            os.close(self._fd)
            self._fd = None
        return None
