"""torch.save archives and pickles written without torch: the files of a torch_dist checkpoint at copy speed.

A torch_dist checkpoint is pickles and zip archives around raw tensor bytes: each chunk in a `.distcp` file is a
torch.save archive of one tensor, `common.pt` is one of a plain object tree, `.metadata` a pickle of
torch.distributed.checkpoint's index classes. Importing torch and its checkpoint package costs seconds, more than
copying a gigabyte; nothing here imports either.

`dumps` writes pickle protocol 2, as torch.save does, for plain Python values and for stand-ins of the few torch
objects these files hold: `Global` (a class or function by name, e.g. torch.bfloat16), `New` (an instance made by
its class's __new__ with its state set, as pickle does for dataclasses and argparse.Namespace), `Call` (a value a
function returns, e.g. torch.Size((4, 8))) and `TensorRef` (a tensor whose bytes are an archive record). The
loader resolves those names to the real objects; this module never needs them.

`Archive` writes one zip archive as torch.save lays it out (records stored, not compressed, data 64-byte aligned,
zip64 where a size or offset needs it, no CRCs: torch does not check them, and `TorchFileWriter` writes none
either) at any position of a file, so several can follow one another in a `.distcp`. A record's bytes come from
memory or from byte ranges of other files, copied file to file in the kernel.
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import pickle
import struct
import sys
from dataclasses import dataclass
from typing import Any

from ckpt_tools.durable import copy_range
from ckpt_tools.forms.dtypes import ELEMENT_SIZES, STORAGE_CLASSES

ALIGNMENT = 64  # torch.save's storage alignment (its .storage_alignment record)
ZIP64_LIMIT = 0xFFFFFFFF  # a size or offset at least this needs zip64 fields (a module value: tests lower it)
ZIP64_MARK = 0xFFFFFFFF  # what a 32-bit field holds when its value is in the zip64 fields
SMALL_WRITE = 1 << 16  # writes below this are gathered in memory and written together


class Unpicklable(TypeError):
    """A value `dumps` has no pickle for (the caller words it)."""


@dataclass(frozen=True)
class Global:
    """A module-level name, pickled as GLOBAL: a class, a function or a constant such as torch.bfloat16."""
    module: str
    name: str


@dataclass(frozen=True)
class New:
    """An instance of `cls` made by cls.__new__(cls, *args), then given `state` (BUILD: its __dict__, or what its
    __setstate__ takes), as pickle writes dataclasses, argparse.Namespace and most plain classes."""
    cls: Global
    state: Any = None
    args: tuple = ()


@dataclass(frozen=True)
class Call:
    """The value func(*args) returns (REDUCE), e.g. torch.Size((4, 8)) or an enum member."""
    func: Global
    args: tuple = ()


@dataclass(frozen=True)
class Items:
    """A dict given as its (key, value) pairs: for keys that are stand-ins (New), which Python cannot hash."""
    pairs: list


@dataclass(frozen=True)
class TensorRef:
    """A contiguous tensor whose bytes are the archive record data/<key>."""
    key: str
    dtype: str
    shape: tuple[int, ...]


class Pickled(bytes):
    """A value already pickled (`pickled`): its opcodes, put as they are where it stands in a larger tree."""


def pickled(obj: Any) -> Pickled:
    """OBJ's pickle opcodes alone (no protocol header, no STOP), to stand in a tree given to dumps: a large index
    (10^5 chunk records) held as bytes, not as an object tree of stand-ins, until it is written."""
    out = _Pickle()
    _save(obj, out)
    return Pickled(out)


def dtype_global(dtype: str) -> Global:
    """torch.<dtype>, as a pickle names it ("bfloat16" -> torch.bfloat16)."""
    return Global("torch", dtype)


def size(shape) -> Call:
    """torch.Size(shape)."""
    return Call(Global("torch", "Size"), (tuple(int(n) for n in shape),))


class _Pickle(bytearray):
    """A pickle's bytes as they are made, in one buffer: `append` adds an opcode and its argument. (A list of the
    pieces, joined at the end, held an object per piece: a torch_dist index of 10^5 chunks took 100+ MB that way.)"""

    append = bytearray.extend


def dumps(obj: Any) -> bytes:
    """The protocol-2 pickle of `obj` (see the module docstring for what it may hold)."""
    out = _Pickle(pickle.PROTO + b"\x02")
    _save(obj, out)
    out.append(pickle.STOP)
    return bytes(out)


def _save(obj: Any, out: _Pickle) -> None:  # noqa: C901 (one branch per pickled type)
    if obj is None:
        out.append(pickle.NONE)
    elif obj is True or obj is False:
        out.append(pickle.NEWTRUE if obj else pickle.NEWFALSE)
    elif isinstance(obj, int):
        if 0 <= obj < 256:
            out.append(pickle.BININT1 + bytes([obj]))
        elif 0 <= obj < 65536:
            out.append(pickle.BININT2 + struct.pack("<H", obj))
        elif -2**31 <= obj < 2**31:
            out.append(pickle.BININT + struct.pack("<i", obj))
        else:
            data = obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
            out.append(pickle.LONG1 + bytes([len(data)]) + data)
    elif isinstance(obj, float):
        out.append(pickle.BINFLOAT + struct.pack(">d", obj))
    elif isinstance(obj, str):
        data = obj.encode("utf-8", "surrogatepass")
        out.append(pickle.BINUNICODE + struct.pack("<I", len(data)) + data)
    elif isinstance(obj, tuple) and type(obj) is tuple:
        if not obj:
            out.append(pickle.EMPTY_TUPLE)
            return
        if len(obj) > 3:
            out.append(pickle.MARK)
        for item in obj:
            _save(item, out)
        out.append({1: pickle.TUPLE1, 2: pickle.TUPLE2, 3: pickle.TUPLE3}.get(len(obj), pickle.TUPLE))
    elif type(obj) is list:
        out.append(pickle.EMPTY_LIST)
        if obj:
            out.append(pickle.MARK)
            for item in obj:
                _save(item, out)
            out.append(pickle.APPENDS)
    elif type(obj) is dict:
        out.append(pickle.EMPTY_DICT)
        if obj:
            out.append(pickle.MARK)
            for k, v in obj.items():
                _save(k, out)
                _save(v, out)
            out.append(pickle.SETITEMS)
    elif isinstance(obj, Items):
        out.append(pickle.EMPTY_DICT)
        if obj.pairs:
            out.append(pickle.MARK)
            for k, v in obj.pairs:
                _save(k, out)
                _save(v, out)
            out.append(pickle.SETITEMS)
    elif isinstance(obj, Pickled):
        out.append(obj)
    elif isinstance(obj, Global):
        out.append(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
    elif isinstance(obj, New):
        _save(obj.cls, out)
        _save(tuple(obj.args), out)
        out.append(pickle.NEWOBJ)
        if obj.state is not None:
            _save(obj.state, out)
            out.append(pickle.BUILD)
    elif isinstance(obj, Call):
        _save(obj.func, out)
        _save(tuple(obj.args), out)
        out.append(pickle.REDUCE)
    elif isinstance(obj, TensorRef):
        numel = math.prod(obj.shape)
        stride = tuple(math.prod(obj.shape[i + 1:]) for i in range(len(obj.shape)))
        _save(Global("torch._utils", "_rebuild_tensor_v2"), out)
        out.append(pickle.MARK)  # its arguments: (storage, offset, shape, stride, requires_grad, hooks)
        _save(("storage", Global("torch", STORAGE_CLASSES[obj.dtype]), obj.key, "cpu", numel), out)
        out.append(pickle.BINPERSID)
        for arg in (0, tuple(obj.shape), stride, False, Call(Global("collections", "OrderedDict"))):
            _save(arg, out)
        out.append(pickle.TUPLE)
        out.append(pickle.REDUCE)
    elif isinstance(obj, argparse.Namespace):
        _save(New(Global("argparse", "Namespace"), dict(vars(obj))), out)
    else:
        stand_in = _torch_stand_in(obj)
        if stand_in is None:
            raise Unpicklable(f"a {type(obj).__module__}.{type(obj).__qualname__}")
        _save(stand_in, out)


def _torch_stand_in(obj: Any) -> Global | Call | None:
    """A torch dtype or torch.Size met in a value the caller built with torch (args.params_dtype): its stand-in,
    found without importing torch (only a caller that has imported it can hold one)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if isinstance(obj, torch.dtype):
        return dtype_global(str(obj).removeprefix("torch."))
    if isinstance(obj, torch.Size):
        return size(obj)
    return None


# ---------------------------------------------------------------- zip archives as torch.save writes them
# a record's bytes: in memory, or a list of (fd, offset, nbytes) ranges of other files and bytes in memory, in order
Data = bytes | memoryview | list[tuple[int, int, int] | bytes | memoryview]


def data_size(data: Data) -> int:
    """The bytes a record's data holds."""
    return sum(_nbytes(d) for d in data) if isinstance(data, list) else len(data)


def _nbytes(part) -> int:
    return part[2] if isinstance(part, tuple) else len(part)


class Archive:
    """One zip archive written at `start` of the open file `fd` (pwrite: the file position is not used).

    add() each record, then close(), which writes the central directory and returns the archive's end. Offsets
    inside are relative to `start`: torch.load reads the archive's bytes on their own, as DCP hands them over.
    With fd None nothing is written: the positions are counted alone. `copy`: what copies a byte range of another
    file into this one (copy_range's arguments; a durable.FileWorker's copy runs it on the file's own thread).
    """

    def __init__(self, fd: int | None, start: int, prefix: str = "archive", copy=copy_range):
        self.fd, self.start, self.pos, self.prefix, self._copy = fd, start, start, prefix, copy
        self._entries: list[tuple[bytes, int, int]] = []  # (name, local header offset, size)
        self._small, self._small_at = bytearray(), start  # headers and pickles, written together (one pwrite)

    def add(self, name: str, data: Data) -> None:
        full = f"{self.prefix}/{name}".encode()
        nbytes, offset = data_size(data), self.pos - self.start
        zip64 = nbytes >= ZIP64_LIMIT or offset >= ZIP64_LIMIT
        extra = struct.pack("<HHQQ", 1, 16, nbytes, nbytes) if zip64 else b""
        head = 30 + len(full) + len(extra) + 4  # + the padding field's own 4 bytes
        pad = -(offset + head) % ALIGNMENT
        extra += b"FB" + struct.pack("<H", pad) + b"Z" * pad
        small = ZIP64_MARK if zip64 else nbytes
        header = struct.pack("<IHHHHHIIIHH", 0x04034B50, 45 if zip64 else 20, 0, 0, 0, 0x21, 0, small, small,
                             len(full), len(extra)) + full + extra
        self._write(header)
        self._write(data)
        self._entries.append((full, offset, nbytes))

    def _write(self, data: Data) -> None:
        if self.fd is None:  # an archive only counted (another process writes it): its size, no bytes
            self.pos += data_size(data)
            return
        if isinstance(data, list):
            for part in data:
                if isinstance(part, tuple):
                    self.flush()
                    src, offset, n = part
                    self._copy(src, offset, self.fd, self.pos, n)
                    self.pos += n
                else:
                    self._write(part)
            return
        view = memoryview(data).cast("B")
        if len(view) < SMALL_WRITE:
            if not self._small:
                self._small_at = self.pos
            self._small += view
            self.pos += len(view)
            if len(self._small) >= SMALL_WRITE:
                self.flush()
            return
        self.flush()
        _pwrite_all(self.fd, view, self.pos)
        self.pos += len(view)

    def flush(self) -> None:
        """Write the small writes gathered so far."""
        if self._small:
            _pwrite_all(self.fd, memoryview(self._small), self._small_at)
            self._small = bytearray()

    def close(self) -> int:
        """The central directory and end records; the position after the archive."""
        cd_start = self.pos - self.start
        for name, offset, nbytes in self._entries:
            fields = [v for v in (nbytes, nbytes, offset) if v >= ZIP64_LIMIT] if \
                nbytes >= ZIP64_LIMIT or offset >= ZIP64_LIMIT else []
            extra = struct.pack("<HH", 1, 8 * len(fields)) + b"".join(struct.pack("<Q", v) for v in fields) \
                if fields else b""
            clip = [ZIP64_MARK if fields and v >= ZIP64_LIMIT else v for v in (nbytes, nbytes, offset)]
            version = 45 if fields else 20
            self._write(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, version, version, 0, 0, 0, 0x21, 0,
                                    clip[0], clip[1], len(name), len(extra), 0, 0, 0, 0, clip[2]) + name + extra)
        cd_size, count = self.pos - self.start - cd_start, len(self._entries)
        zip64 = cd_start >= ZIP64_LIMIT or cd_size >= ZIP64_LIMIT or count >= 0xFFFF
        if zip64:
            eocd64 = self.pos - self.start
            self._write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, cd_start))
            self._write(struct.pack("<IIQI", 0x07064B50, 0, eocd64, 1))
        self._write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, min(count, 0xFFFF), min(count, 0xFFFF),
                                ZIP64_MARK if zip64 else cd_size, ZIP64_MARK if zip64 else cd_start, 0))
        if self.fd is not None:
            self.flush()
        return self.pos


def _pwrite_all(fd: int, view: memoryview, pos: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], pos + done)


def _torch_records(archive: Archive, pickled: bytes, tensors: list[tuple[str, Data]]) -> int:
    """The records torch.save writes, in its order: data.pkl, the format records, each tensor's data, version."""
    archive.add("data.pkl", pickled)
    _format_records(archive)
    for key, data in tensors:
        archive.add(f"data/{key}", data)
    archive.add("version", b"3\n")
    return archive.close()


def finish(archive: Archive, pickled: bytes) -> int:
    """An archive whose tensor records (data/<key>) were added first, as they were produced: data.pkl, the format
    records and version after them (torch.load finds records by name), then the central directory."""
    archive.add("data.pkl", pickled)
    _format_records(archive)
    archive.add("version", b"3\n")
    return archive.close()


def _format_records(archive: Archive) -> None:
    archive.add(".format_version", b"1")
    archive.add(".storage_alignment", str(ALIGNMENT).encode())
    archive.add("byteorder", sys.byteorder.encode())


def save_object(fd: int, start: int, obj: Any) -> int:
    """torch.save(obj) for an object tree without tensors, at `start` of fd; the position after it."""
    return save_pickled(fd, start, dumps(obj))


def save_pickled(fd: int, start: int, pickled: bytes) -> int:
    """save_object with the object tree already pickled (by dumps)."""
    return _torch_records(Archive(fd, start), pickled, [])


def save_tensor(fd: int, start: int, dtype: str, shape: tuple[int, ...], data: Data, copy=copy_range) -> int:
    """torch.save(tensor) of a contiguous tensor whose bytes are `data`, at `start` of fd; the position after it
    (`copy`: as Archive's)."""
    shape = tuple(shape)
    expected = math.prod(shape) * ELEMENT_SIZES[dtype]
    if data_size(data) != expected:
        raise ValueError(f"{data_size(data)} bytes for a {dtype} tensor of shape {shape} ({expected} expected)")
    before, after = _tensor_archive(dtype, shape, ZIP64_LIMIT)
    archive = Archive(fd, start, copy=copy)
    archive._write(before)
    archive._write(data)
    archive._write(after)
    archive.flush()
    return archive.pos


@functools.lru_cache(maxsize=1024)
def _tensor_archive(dtype: str, shape: tuple[int, ...], zip64_limit: int) -> tuple[bytes, bytes]:
    """The bytes of torch.save(tensor)'s archive before and after the tensor's data. An archive's offsets are
    relative to its start, so they are the same wherever it is written, for every tensor of this dtype and shape
    (a torch_dist save has hundreds of chunks of a few shapes). `zip64_limit`: ZIP64_LIMIT when they were made."""
    template = _Template()
    _torch_records(template, dumps(TensorRef("0", dtype, shape)),
                   [("0", [(-1, 0, math.prod(shape) * ELEMENT_SIZES[dtype])])])
    return bytes(template.before), bytes(template.after)


class _Template(Archive):
    """An archive written to memory with its one tensor's data left out: the bytes before and after it."""

    def __init__(self):
        super().__init__(None, 0)
        self.before, self.after = bytearray(), bytearray()
        self._out = self.before

    def _write(self, data: Data) -> None:
        if isinstance(data, list):  # the tensor's data: a placeholder range
            self.pos += data_size(data)
            self._out = self.after
            return
        view = memoryview(data).cast("B")
        self._out += view
        self.pos += len(view)
