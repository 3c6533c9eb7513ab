"""The state beside the tensors of the forms torch.distributed.checkpoint writes: megatron-core's common state (args,
iteration, checkpoint_version) in `common.pt` (up to 0.18), as the byte entry `common_state/shard_0_1` of the .distcp
files (0.19 on: a torch.save of the one-element list [state]), and torch_dcp's and fsdp_dtensor's per-name byte
entries. Every object is read through the allow-listed loader (io.load_bytes), or the caller's `load_embedded`.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ckpt_tools import io
from ckpt_tools.errors import FormatError
from ckpt_tools.forms import dcp
from ckpt_tools.forms.torch_dist_names import DCP_COMMON

COMMON = "common.pt"
COMMON_STATE = "common_state/shard_0_1"  # megatron-core >= 0.19: the common state as a ShardedObject's byte entry


def read_dcp_common(iter_dir: Path, index: dcp.Index, load_embedded: Callable | None = None) -> tuple[Path, dict]:
    """(where its args are, the common state) of a torch_dcp checkpoint: args, iteration and checkpoint_version, each
    a bytes entry of the .distcp files (a torch.save of the object), through the allow-listed loader."""
    common: dict = {}
    where = iter_dir / dcp.METADATA
    for name in DCP_COMMON:
        if name not in index.blobs:
            if name == "checkpoint_version":
                continue
            raise FormatError(f"{where}: no {name!r} entry: Megatron-LM saves args and iteration in every torch_dcp "
                              f"checkpoint; restore it from the source")
        path, common[name] = _entry(iter_dir, index, name, f"the {name!r} entry", "the {name!r} entry ({length} bytes "
                                    "at byte {offset})", load_embedded)
        if name == "args":
            where = path
    return where, common


def read_common(iter_dir: Path, index: dcp.Index, load: Callable = io.load_file,
                load_embedded: Callable | None = None) -> tuple[Path, dict]:
    """(where it is, the common state): common.pt where there is one (megatron-core <= 0.18; what its loader reads
    first too), else the `common_state` byte entry (megatron-core >= 0.19), through the same allow-listed loader."""
    common_path = iter_dir / COMMON
    if common_path.is_file():
        return common_path, load(common_path)
    if COMMON_STATE not in index.blobs:
        raise FormatError(f"{common_path}: missing, and {iter_dir / dcp.METADATA} holds no {COMMON_STATE} entry "
                          f"(megatron-core 0.19 and later keep the common state there): the checkpoint's args are "
                          f"gone; restore common.pt or the checkpoint from the source")
    path, obj = _entry(iter_dir, index, COMMON_STATE, f"the {COMMON_STATE} entry", "the common state ({name}, {length} "
                       "bytes at byte {offset})", load_embedded)
    if not (isinstance(obj, list) and len(obj) == 1 and isinstance(obj[0], dict)):
        offset = index.blobs[COMMON_STATE][1]
        raise FormatError(f"{path}: the {COMMON_STATE} entry at byte {offset} holds {type(obj).__name__}"
                          f"{f' of {len(obj)}' if isinstance(obj, list) else ''}, expected megatron-core's one-element "
                          f"list holding the common state dict: restore the checkpoint from the source")
    return path, obj[0]


def _entry(iter_dir: Path, index: dcp.Index, name: str, label: str, placed: str,
           load_embedded: Callable | None) -> tuple[Path, object]:
    """(the .distcp file, the object) of the byte entry `name`, checked to be where .metadata places it (`placed`
    words that place, with {name}, {length} and {offset}; `label` names the entry where it does not load)."""
    file, offset, length = index.blobs[name]
    path = iter_dir / file
    if not path.is_file() or path.stat().st_size < offset + length:
        where = placed.format(name=name, length=length, offset=offset)
        raise FormatError(f"{path}: {'missing' if not path.is_file() else 'truncated'}, but .metadata places {where} "
                          f"in it: restore the file from the source")
    if load_embedded is not None:
        return path, load_embedded(path, offset, length)
    with open(path, "rb") as f:
        f.seek(offset)
        return path, io.load_bytes(f.read(length), f"{path}: {label} at byte {offset}")
