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
    """A torch.save-compatible zip file whose tensors are written one at a time by `tensor()` (merge's .bin output).

    `close(obj)` pickles `obj`, in which every tensor is a reference returned by `tensor()` or `tensor_from_files()`
    (or a plain tensor, written then); the storages are 64-byte aligned so the file loads with mmap.
    """

    def __init__(self, path: str | Path):
        import torch
        self.path = Path(path)
        self._zip = torch._C.PyTorchFileWriter(str(self.path), False, 64)  # integrity: the content hash in meta.json
        self._count = 0
        self.nbytes = 0
        self._holes: list[tuple[str, list[tuple[int, int, int]]]] = []  # (record, [(fd, offset, nbytes)])

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
        self._zip.write_record_metadata(f"data/{key}", nbytes)
        self._holes.append((f"{self._zip.archive_name()}/data/{key}", ranges))
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

    def close(self, obj: Any, fsync: bool = True) -> None:
        """Write the object tree and the archive's end, then fill the records reserved by tensor_from_files; fsync=False
        leaves the fsync to the caller."""
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
        if self._holes:
            self._fill_holes()
        if fsync:
            fsync_file(self.path)

    def _fill_holes(self) -> None:
        """Copy every reserved record's byte ranges into place; the records' places are read from the finished
        archive."""
        with zipfile.ZipFile(self.path) as z:
            where = {info.filename: info.header_offset for info in z.infolist()}
        fd = os.open(self.path, os.O_RDWR)
        try:
            for record, ranges in self._holes:
                pos = record_offset(fd, where[record])
                for src, offset, nbytes in ranges:
                    copy_range(src, offset, fd, pos, nbytes)
                    pos += nbytes
        finally:
            os.close(fd)
        self._holes.clear()
