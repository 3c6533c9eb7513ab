"""Reading a torch.save zip archive without torch: its object tree, each tensor a `TensorInfo` that says
where its bytes are in the file, so they can be copied file to file.

Only what our shard files and Megatron-LM's files hold is understood: dicts, lists, tuples, numbers, strings,
None, tensors (`torch._utils._rebuild_tensor_v2` of a `torch.<Type>Storage` record, stored uncompressed),
torch dtypes (read as their names), Megatron-LM's `argparse.Namespace` of arguments (a `Record` with its
attributes) and numpy RNG states (opaque `Record`s). The pickle is read by an Unpickler whose find_class
knows only those names and collections.OrderedDict, and maps them to plain records; any other global, a
compressed record, a non-contiguous tensor or a damaged archive raises `Unreadable`. Nothing is ever executed. Record CRCs are not checked, as torch does not check
them. The caller then takes the torch path, which loads the file with its allow-list and reports what
is wrong in its own words.
"""
from __future__ import annotations

import collections
import io
import math
import os
import pickle
import pickletools
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_tools.forms.dtypes import ELEMENT_SIZES, STORAGE_DTYPES

STORAGE_ALIGNMENT = 64  # torch.save (PyTorchStreamWriter) starts every tensor record's data on this boundary
_LOCAL_HEADER = 30
_DATA_DESCRIPTOR = 24  # at most, after a record's data (zip64)  # bytes of a zip local file header before its name and extra field


class Unreadable(Exception):
    """The file is not one this reader understands (or is damaged): read it with torch instead."""


@dataclass(frozen=True, slots=True)  # slots: unpickling cannot alter one
class TensorInfo:
    """A contiguous tensor inside a torch.save archive: its bytes are file[offset:offset + nbytes]."""
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ELEMENT_SIZES[self.dtype]


@dataclass(frozen=True, slots=True)
class _StorageType:
    dtype: str


@dataclass(frozen=True, slots=True)
class _Storage:
    dtype: str
    numel: int
    offset: int  # of its record's data in the file


def record_offset(fd: int, header_offset: int, pread=os.pread) -> int:
    """Where the data of the zip record whose local header is at `header_offset` starts: after the header,
    its name and its extra field (whose lengths the local header gives; they may differ from the central
    directory's). `pread`: what reads the file (os.pread's arguments)."""
    header = pread(fd, _LOCAL_HEADER, header_offset)
    if len(header) != _LOCAL_HEADER or header[:4] != b"PK\x03\x04":
        raise Unreadable(f"no zip local header at byte {header_offset}")
    return header_offset + _LOCAL_HEADER + sum(struct.unpack("<HH", header[26:30]))


def _is_contiguous(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for n, s in zip(reversed(shape), reversed(stride)):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


class Record:
    """Stands for an object of an allow-listed class: keeps what it was built with (constructor arguments
    in `_args`, pickled state as attributes), runs nothing."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Record:
        obj = super().__new__(cls)
        obj.__dict__["_args"] = args
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            state = {**(state[0] or {}), **(state[1] or {})}  # (dict, slots)
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["_state"] = state


class Namespace(Record):
    """Megatron-LM's `args`: its attributes, read as an argparse.Namespace's."""


_OPAQUE = {("_io", "BytesIO"),  # Transformer Engine's _extra_state (older TE versions)
           ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
           ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
           ("numpy._core.multiarray", "scalar")}
# what Megatron-LM keeps in its args (and common state) beside plain values: enums, a signal, paths, its optimizer
# config; each read as an inert Record of its constructor arguments, never built
MEGATRON_INERT = frozenset(
    [("megatron.core.enums", n) for n in ("ModelType", "Fp8Recipe", "Fp4Recipe")]
    + [("megatron.core.transformer.enums", n) for n in ("ModelType", "LayerType", "AttnType", "AttnMaskType",
                                                         "AttnBackend", "CudaGraphScope")]
    + [("megatron.core.rerun_state_machine", n) for n in ("RerunDiagnostic", "RerunMode", "RerunState",
                                                          "RerunValidationStatus")]
    + [("megatron.core.optimizer.optimizer_config", "OptimizerConfig"), ("megatron.core.optimizer", "OptimizerConfig"),
       ("signal", "Signals"), ("pathlib", "PosixPath"), ("pathlib", "Path"), ("types", "SimpleNamespace")])
TORCH_DTYPES = set(STORAGE_DTYPES.values())  # the dtypes a pickle names as torch.<name> (those with a storage class)


def _latin1(text: Any, encoding: Any = "latin1") -> bytes:
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise Unreadable("an encoded byte string of an unknown form")
    return text.encode("latin1")


class _Unpickler(pickle.Unpickler):
    def __init__(self, archive: _Archive, data: bytes):
        super().__init__(io.BytesIO(data))
        self.archive = archive

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if (module, name) == ("torch._tensor", "_rebuild_from_type_v2"):
            return _rebuild_from_type
        if (module, name) == ("torch", "Tensor"):
            return _TENSOR
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageType(STORAGE_DTYPES[name])
        if module == "torch" and name in TORCH_DTYPES:
            return name
        if (module, name) == ("argparse", "Namespace"):
            return Namespace
        if (module, name) in _OPAQUE or (module, name) in MEGATRON_INERT or (
                module.startswith("numpy.dtypes") and name.endswith("DType")):
            return Record
        if (module, name) == ("_codecs", "encode"):  # protocol 2 pickles bytes (numpy's) as latin-1 text
            return _latin1
        raise Unreadable(f"global {module}.{name} is not one of a plain checkpoint's")

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str) and isinstance(pid[4], int)):
            raise Unreadable(f"persistent id {pid!r:.80} is not a storage")
        return self.archive.storage(pid[2], pid[1].dtype, pid[4])


_TENSOR = object()  # stands for the class torch.Tensor


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> TensorInfo:
    """Stands for torch._tensor._rebuild_from_type_v2: a plain tensor that carried Python attributes (Megatron-LM's
    fp32 masters); the attributes are dropped, nothing else is allowed."""
    if func is not _rebuild_tensor or new_type is not _TENSOR or not isinstance(args, tuple):
        raise Unreadable("a tensor of a subclass, or rebuilt by an unknown function")
    return _rebuild_tensor(*args)


def _rebuild_tensor(storage: Any, offset: Any, shape: Any, stride: Any, requires_grad: Any = False,
                    hooks: Any = None, metadata: Any = None) -> TensorInfo:
    """Stands for torch._utils._rebuild_tensor_v2: the tensor's place in the file, checked."""
    if not (isinstance(storage, _Storage) and isinstance(shape, tuple) and isinstance(stride, tuple)
            and len(shape) == len(stride) and not hooks and metadata is None
            and all(type(n) is int and n >= 0 for n in (offset, *shape, *stride))):
        raise Unreadable("a tensor record of an unknown form")
    if not _is_contiguous(shape, stride) or offset + math.prod(shape) > storage.numel:
        raise Unreadable(f"a tensor of shape {shape} that is not a contiguous part of its storage")
    return TensorInfo(storage.dtype, shape, storage.offset + offset * ELEMENT_SIZES[storage.dtype])


class _Window(io.RawIOBase):
    """Bytes [base, base + length) of an open file, as a file of their own (a torch.save archive embedded in
    a larger file: a chunk of a torch.distributed.checkpoint .distcp file).

    Its first and last bytes (EDGE each: a tensor archive's headers, pickle and small records before its data, the
    records and zip directory after it) are read once, up front (`edges`: whether they were), and every read that
    falls inside them is served from them and logged in `reads` (where, how many bytes, in order); `outside` says
    whether a read went elsewhere."""

    EDGE = 4096

    def __init__(self, f, base: int, length: int, size: int):
        self.f, self.base, self.length, self.pos = f, base, length, 0
        self.outside, self.edges, self.reads = False, False, []
        if base + length <= size:  # a window past the file's end (a truncated file) is read as it is
            fd = f.fileno()
            self._head = os.pread(fd, min(self.EDGE, length), base)
            self._tail_at = max(0, length - self.EDGE)
            self._tail = os.pread(fd, length - self._tail_at, base + self._tail_at)
            self.edges = len(self._head) == min(self.EDGE, length) and len(self._tail) == length - self._tail_at

    def at(self, rel: int, n: int) -> bytes | None:
        """Bytes [rel, rel + n) of the window from its edges; None where they do not hold them all."""
        if self.edges and n >= 0:
            if 0 <= rel and rel + n <= len(self._head):
                return self._head[rel:rel + n]
            if self._tail_at <= rel and rel + n <= self.length:
                return self._tail[rel - self._tail_at:rel - self._tail_at + n]
        return None

    def pread(self, fd: int, n: int, at: int) -> bytes:
        """os.pread of the file (an absolute offset), from the edges where they hold the bytes."""
        if fd == self.f.fileno() and (data := self.at(at - self.base, n)) is not None:
            self.reads.append((at - self.base, n))
            return data
        self.outside = True
        return os.pread(fd, n, at)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.length + offset}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), self.length - self.pos))
        data = self.pread(self.f.fileno(), n, self.base + self.pos)
        b[:len(data)] = data
        self.pos += len(data)
        return len(data)


class _Archive:
    def __init__(self, fd: int, z: zipfile.ZipFile, base: int = 0, end: int | None = None, pread=os.pread):
        self.fd, self.z, self.base, self.end, self.pread = fd, z, base, end, pread
        starts = sorted(info.header_offset for info in z.infolist()) + [z.start_dir]
        self._next = {info.filename: starts[starts.index(info.header_offset) + 1] for info in z.infolist()}
        pickles = [n for n in z.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise Unreadable("not a torch.save archive (no single <name>/data.pkl)")
        self.prefix = pickles[0][: -len("data.pkl")]
        self._storages: dict[str, _Storage] = {}

    def load(self) -> Any:
        order = self.prefix + "byteorder"
        if order in self.z.namelist() and self._read(order) != b"little":
            raise Unreadable("big-endian tensors")
        data = self._read(self.prefix + "data.pkl")
        for op, _, _ in pickletools.genops(data):  # torch.save pickles with protocol 2: nothing newer is read
            if op.proto > 2:
                raise Unreadable(f"pickle opcode {op.name} (protocol {op.proto}), which torch.save does not write")
        return _Unpickler(self, data).load()

    def _record(self, name: str) -> tuple[int, int]:
        """(offset, nbytes) of a stored record's data in the file."""
        info = self.z.getinfo(name)
        if info.compress_type != zipfile.ZIP_STORED:
            raise Unreadable(f"record {name} is compressed")
        offset = record_offset(self.fd, self.base + info.header_offset, self.pread)
        if "/data/" in name and (offset - self.base) % STORAGE_ALIGNMENT:
            raise Unreadable(f"record {name} starts at byte {offset - self.base} of the archive, not on the "
                             f"{STORAGE_ALIGNMENT}-byte boundary torch.save puts tensor data on: a damaged zip header")
        if self.end is not None and offset + info.file_size > self.end:
            raise Unreadable(f"record {name} ends beyond its archive")
        gap = self.base + self._next[name] - (offset + info.file_size)
        if not 0 <= gap <= _DATA_DESCRIPTOR:  # torch.save writes records back to back (each + its descriptor)
            raise Unreadable(f"record {name} does not end where the next one begins ({gap} bytes apart): a damaged "
                             f"zip header")
        return offset, info.file_size

    def _read(self, name: str) -> bytes:
        """A record's bytes, its CRC not checked: torch does not check it (our writer leaves it 0; the
        integrity check is meta.json's content hash), and this reader must read what torch reads."""
        offset, nbytes = self._record(name)
        data = self.pread(self.fd, nbytes, offset)
        if len(data) != nbytes:
            raise Unreadable(f"record {name} ends beyond the file")
        return data

    def storage(self, key: str, dtype: str, numel: int) -> _Storage:
        if key not in self._storages:
            offset, nbytes = self._record(f"{self.prefix}data/{key}")
            if nbytes != numel * ELEMENT_SIZES[dtype]:
                raise Unreadable(f"storage record {key} is not of its {numel} {dtype} elements")
            self._storages[key] = _Storage(dtype, numel, offset)
        if self._storages[key].dtype != dtype:
            raise Unreadable(f"storage record {key} is read as two dtypes")
        return self._storages[key]


# Embedded archives parsed (tensor chunks of torch_dist files): by the archive's length, the reads the parse made
# (where in the archive, how many bytes, in order), the bytes they read, and the tensor it found (its offset relative
# to the archive). The parse reads nothing else, and where it reads next depends only on what it has read, so an
# archive of that length with those bytes at those places parses the same, checks included: it is not parsed again.
# A torch_dist checkpoint's hundreds of chunks come in a few shapes, and torch.save's offsets are relative to the
# archive's start, so the chunks of one shape and dtype differ in their data alone, which the parse never reads.
_PARSED: dict[int, list[tuple[tuple[tuple[int, int], ...], bytes, TensorInfo]]] = {}
_PARSED_PER_LENGTH = 8


def read(path: str | Path, offset: int = 0, length: int | None = None) -> Any:
    """The object a torch.save archive holds, with a TensorInfo for each tensor (offsets in the file);
    Unreadable for anything this reader does not understand (the file is then for torch to read, or to
    refuse). `offset` and `length` name an archive embedded in a larger file."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if length is None:
                length = size - offset
            if (offset, length) == (0, size):
                with zipfile.ZipFile(f) as z:
                    return _Archive(f.fileno(), z, offset, offset + length).load()
            window = _Window(f, offset, length, size)
            for reads, read_bytes, known in _PARSED.get(length, ()) if window.edges else ():
                if b"".join(window.at(rel, n) or b"" for rel, n in reads) == read_bytes:
                    return TensorInfo(known.dtype, known.shape, offset + known.offset)
            with zipfile.ZipFile(window) as z:
                obj = _Archive(f.fileno(), z, offset, offset + length, window.pread).load()
            if window.edges and not window.outside and type(obj) is TensorInfo:
                known = _PARSED.setdefault(length, [])
                if len(known) < _PARSED_PER_LENGTH:
                    known.append((tuple(window.reads), b"".join(window.at(rel, n) for rel, n in window.reads),
                                  TensorInfo(obj.dtype, obj.shape, obj.offset - offset)))
            return obj
    except (Unreadable, FileNotFoundError):
        raise
    except Exception as e:  # noqa: BLE001 - a damaged zip or pickle fails in any way; torch will say how
        raise Unreadable(f"{path}: {type(e).__name__}: {e}") from None
