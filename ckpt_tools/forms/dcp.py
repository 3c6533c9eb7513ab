"""torch.distributed.checkpoint (DCP) directories, read without unpickling code: what megatron-core's
`dist_checkpointing` writes for Megatron-LM's default `--ckpt-format torch_dist`.

`.metadata` is a pickle of DCP's `Metadata`: for every key (fqn), the global shape, dtype and chunks
(offsets, sizes) of a tensor, or a bytes entry; and for every chunk, the file, byte offset and length of its
data (`storage_data`). Saves from mid-2024 to late 2025 pickled megatron-core's `MCoreMetadata` subclass.
`read_metadata` unpickles it with an allow-list that maps each known class to a plain record (`Record`):
nothing is imported from torch.distributed or megatron, and any other global is refused. Each tensor chunk
is a `torch.save` archive inside a `.distcp` file, read torch-free by `torchfile` (`chunk_info`), so that
its bytes can be mapped or copied without loading it.
"""
from __future__ import annotations

import collections
import math
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_tools.errors import FormatError
from ckpt_tools.forms.dtypes import ELEMENT_SIZES
from ckpt_tools.forms.torchfile import Record, TensorInfo, Unreadable
from ckpt_tools.forms.torchfile import read as read_torch_file

METADATA = ".metadata"
_FILE = re.compile(r"^__\d+_\d+\.distcp$")  # what DCP's FileSystemWriter names its files
MAX_ENTRIES, MAX_CHUNKS = 1_000_000, 20_000_000  # a bound on what a (hostile) .metadata may make us hold
_DTYPES = {name for name in ELEMENT_SIZES}
_DCP = "torch.distributed.checkpoint"
# Classes a DCP .metadata pickle names, by module; each becomes a Record of that name.
_RECORDS = {
    f"{_DCP}.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                         "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    f"{_DCP}.filesystem": {"_StorageInfo"},
    f"{_DCP}.planner": {"SavePlan", "WriteItem", "TensorWriteData", "WriteItemType", "BytesIOWriteData"},
    "megatron.core.dist_checkpointing.strategies.torch": {"MCoreMetadata", "MCoreSavePlan"},
    # StorageMeta's checkpoint_id as torch's FileSystemWriter records it (torch_dcp saves): an inert record
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
}


class _Record(Record):
    """A Record whose missing fields are a FormatError naming the class (a damaged or unknown .metadata)."""
    kind = "Record"

    def __getattr__(self, name: str) -> Any:
        raise FormatError(f"a {self.kind} record of the checkpoint's {METADATA} has no field {name!r}: "
                          f"the file is damaged or of a form this version does not know")


_CLASSES: dict[tuple[str, str], type] = {(m, n): type(n, (_Record,), {"kind": n}) for m, names in _RECORDS.items()
                                         for n in names}


def _size(*args: Any) -> tuple:
    return tuple(args[0]) if args else ()


class _Refused(pickle.UnpicklingError):
    """A global outside the allow-list: the file would run code, or is not DCP metadata."""


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _CLASSES:
            return _CLASSES[(module, name)]
        if (module, name) == ("torch", "Size"):
            return _size
        if module == "torch" and name in _DTYPES:
            return name  # torch.float32 -> "float32"
        if (module, name) == ("torch.serialization", "_get_layout"):
            return lambda layout: layout
        if module == "torch" and name in ("strided", "sparse_coo", "contiguous_format", "preserve_format"):
            return name
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "pathlib" and name in ("Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            return lambda *parts: "/".join(map(str, parts))  # StorageMeta's checkpoint_id (torch's FileSystemWriter)
        if (module, name) in (("builtins", "set"), ("builtins", "frozenset")):
            return {"set": set, "frozenset": frozenset}[name]
        raise _Refused(f"global {f'{module}.{name}'!r:.100} is not one of a DCP checkpoint's metadata")


@dataclass(frozen=True)
class Chunk:
    """One saved piece of a global tensor: where it sits (offsets, sizes) and where its bytes are."""
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    blob_offset: int  # of its torch.save archive in `file`
    blob_length: int


@dataclass(frozen=True)
class Entry:
    """One tensor of the checkpoint: global shape, dtype, chunks."""
    fqn: str
    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class Index:
    tensors: dict[str, Entry]
    blobs: dict[str, tuple[str, int, int]]  # bytes entries: fqn -> (file, offset, length)


def read_metadata(iter_dir: Path) -> Index:
    """The tensors and bytes entries of a DCP dir's `.metadata`, checked for shape; FormatError otherwise."""
    path = iter_dir / METADATA
    try:
        with open(path, "rb") as f:
            meta = _Unpickler(f).load()
    except FileNotFoundError:
        raise FormatError(f"{path}: missing: a torch_dist checkpoint dir holds .metadata beside its *.distcp files; "
                          f"restore it from the source (it is written last, so a save that died left none)") from None
    except _Refused as e:
        raise FormatError(f"{path}: refused to unpickle ({e}): not the metadata of a torch_dist checkpoint; "
                          f"restore it from the source") from None
    except Exception as e:  # noqa: BLE001 - a damaged pickle fails in any way
        raise FormatError(f"{path}: unreadable ({type(e).__name__}: {str(e)[:120]}): the file is truncated or "
                          f"corrupt; restore it from the source") from None
    try:
        return _index(meta)
    except (AttributeError, TypeError, ValueError, KeyError, IndexError, ArithmeticError, FormatError) as e:
        raise FormatError(f"{path}: not the metadata of a torch_dist checkpoint ({type(e).__name__}: "
                          f"{str(e)[:120]}): restore it from the source") from None


def _index(meta: Any) -> Index:
    if getattr(meta, "kind", None) not in ("Metadata", "MCoreMetadata"):
        raise TypeError(f"top level is a {type(meta).__name__}, not DCP Metadata")
    where: dict[tuple[str, tuple], tuple[str, int, int]] = {}
    for index, info in meta.storage_data.items():
        offset = index.__dict__.get("offset")  # absent (None) for a bytes entry
        offset = tuple(_int(x) for x in offset) if offset is not None else None
        name = info.relative_path
        if not (isinstance(name, str) and _FILE.match(name)):  # never a path outside the checkpoint dir
            raise ValueError(f"storage file {name!r:.60} is not a .distcp file name of the checkpoint dir")
        where[(index.fqn, offset)] = (name, _int(info.offset), _int(info.length))
    tensors: dict[str, Entry] = {}
    blobs: dict[str, tuple[str, int, int]] = {}
    for fqn, item in meta.state_dict_metadata.items():
        if item.kind == "BytesStorageMetadata":
            if (fqn, None) in where:
                blobs[fqn] = where[(fqn, None)]
            continue
        if item.kind != "TensorStorageMetadata":
            raise TypeError(f"{fqn} is a {item.kind}")
        props = item.properties.__dict__
        dtype = props["dtype"] if "dtype" in props else props["_state"][0]  # a dataclass, or its getstate tuple
        if dtype not in ELEMENT_SIZES:
            raise ValueError(f"{fqn} has dtype {dtype!r:.40}")
        chunks = []
        for c in item.chunks:
            offsets, sizes = tuple(_int(x) for x in c.offsets), tuple(_int(x) for x in c.sizes)
            if (fqn, offsets) not in where:
                raise KeyError(f"chunk of {fqn} at {list(offsets)} has no storage record")
            chunks.append(Chunk(offsets, sizes, *where[(fqn, offsets)]))
        tensors[fqn] = Entry(fqn, tuple(_int(x) for x in item.size), str(dtype), tuple(chunks))
        if len(tensors) > MAX_ENTRIES or sum(len(e.chunks) for e in tensors.values()) > MAX_CHUNKS:
            raise ValueError(f"more than {MAX_ENTRIES} tensors or {MAX_CHUNKS} chunks")
    return Index(tensors, blobs)


def _int(x: Any) -> int:
    """A size or offset from the pickle: an int >= 0 (anything else is a damaged file)."""
    if type(x) is not int or x < 0:
        raise ValueError(f"{x!r:.40} is not a size")
    return x


def chunk_info(iter_dir: Path, chunk: Chunk) -> TensorInfo:
    """Where a chunk's tensor bytes are in its .distcp file (absolute offset), read torch-free."""
    path = iter_dir / chunk.file
    try:
        obj = read_torch_file(path, chunk.blob_offset, chunk.blob_length)
    except FileNotFoundError:
        raise FormatError(f"{path}: missing, but .metadata places chunks in it: restore it from the source") from None
    except Unreadable as e:
        raise FormatError(f"{path}: the chunk at byte {chunk.blob_offset} ({chunk.blob_length} bytes) is not a "
                          f"readable tensor ({e}): the file is truncated or corrupt; restore it from the source") from None
    if not isinstance(obj, TensorInfo) or obj.shape != chunk.sizes:
        raise FormatError(f"{path}: the chunk at byte {chunk.blob_offset} holds {getattr(obj, 'shape', type(obj).__name__)}, "
                          f".metadata says a tensor of shape {list(chunk.sizes)}: restore the file from the source")
    return obj


def coverage_problems(entry: Entry) -> list[str]:
    """Chunks that lie outside the global shape, overlap, or leave part of it uncovered."""
    problems, shape = [], entry.shape
    for c in entry.chunks:
        if len(c.offsets) != len(shape) or any(o < 0 or o + s > n for o, s, n in zip(c.offsets, c.sizes, shape)):
            problems.append(f"chunk at {list(c.offsets)} of shape {list(c.sizes)} lies outside the global shape "
                            f"{list(shape)}")
    if problems:
        return problems
    active: list[Chunk] = []  # a sweep along dim 0: each chunk is compared with those its dim-0 range meets
    for c in sorted(entry.chunks, key=lambda c: c.offsets[:1]):
        start = c.offsets[0] if c.offsets else 0
        active = [a for a in active if not a.offsets or a.offsets[0] + a.sizes[0] > start]
        for a in active:
            if all(oa < ob + sb and ob < oa + sa for oa, sa, ob, sb in zip(a.offsets, a.sizes, c.offsets, c.sizes)):
                problems.append(f"chunks at {list(a.offsets)} and {list(c.offsets)} overlap")
        active.append(c)
    covered = sum(math.prod(c.sizes) for c in entry.chunks)
    if not problems and covered != math.prod(shape):
        problems.append(f"chunks cover {covered} of its {math.prod(shape)} elements (a chunk is missing)")
    return problems
