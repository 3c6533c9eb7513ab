"""Every read of a `.bin`/`.pt` file and every small atomic write goes through here.

Reads use `torch.load(weights_only=True)`: nothing in a checkpoint may run code when loaded.
Real Megatron-LM files also hold an argparse.Namespace, numpy RNG states and (Transformer Engine's
`_extra_state` in older TE versions) io.BytesIO; those types are allow-listed explicitly, nothing else. torch is
imported where it is used: the torch-free merge path (ckpt_tools.verbs.merge with ckpt_tools.forms.byte_ranges) writes
through this module too. The disk's side of writing is durable.py; hashes hashing.py; memory memory.py; ports ports.py.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

from ckpt_tools.durable import fsync_dir
from ckpt_tools.errors import FormatError


def _allowed_globals() -> list:
    import io as _io
    from ckpt_tools.forms.torchfile import MEGATRON_INERT, Record
    allowed: list = [argparse.Namespace, _io.BytesIO]  # BytesIO: Transformer Engine's _extra_state in older TE
    allowed += [(Record, f"{module}.{name}") for module, name in sorted(MEGATRON_INERT)]  # read, never built
    try:
        import numpy as np
        reconstruct = np._core.multiarray._reconstruct if hasattr(np, "_core") else np.core.multiarray._reconstruct
        # files written under numpy < 2 name it numpy.core.multiarray._reconstruct
        allowed += [np.ndarray, np.dtype, reconstruct, (reconstruct, "numpy.core.multiarray._reconstruct")]
        allowed += [type(np.dtype(t)) for t in ("uint32", "int64", "float64", "float32")]
    except (ImportError, AttributeError):
        pass
    return allowed


def _allowing():
    """The allow-list for one load, adding only what the process has not allowed already: leaving the context
    removes what it added, and must not remove what others (megatron-core registers argparse.Namespace) rely on."""
    import torch
    have = torch.serialization.get_safe_globals()
    # a name already allowed (megatron-core registers its real enums and argparse.Namespace) keeps its entry: two
    # entries of one name would make torch's pick between them arbitrary
    named = {g[1] if isinstance(g, tuple) else f"{getattr(g, '__module__', '')}.{getattr(g, '__qualname__', '')}"
             for g in have}
    return torch.serialization.safe_globals([g for g in _allowed_globals() if g not in have and not (
        isinstance(g, tuple) and g[1] in named)])


TRUST_PICKLE = False  # set only by `ckpt --trust-pickle`: full unpickling, which can run code


def load_bytes(data, what: str) -> Any:
    """A torch.save archive held in memory (a byte entry of a torch_dist checkpoint), loaded with the allow-list;
    `what` names it in errors."""
    import io as _io
    import torch
    try:
        with _allowing():
            return torch.load(_io.BytesIO(bytes(data)), map_location="cpu", weights_only=TRUST_PICKLE is False)
    except Exception as e:  # noqa: BLE001 - refused or damaged: one line either way
        raise FormatError(f"{what}: refused or unreadable ({str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__}): "
                          f"restore the checkpoint from the source") from None


def load_file(path: str | Path, mmap: bool = True) -> Any:
    """Load a torch-saved file safely (weights only), lazily via mmap when the file allows it."""
    import torch
    path = Path(path)
    if not path.is_file():
        raise FormatError(f"{path}: file not found")
    if TRUST_PICKLE:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    try:
        with _allowing():
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        # name the global, not torch's advice (which is to allow-list it)
        found = re.search(r"[Uu]nsupported (?:global: )?GLOBAL (\S+)", str(e))
        if not found:  # not a refused global: a damaged pickle that the weights-only unpickler could not read
            detail = str(e).split("WeightsUnpickler error:")[-1].strip().splitlines()
            raise FormatError(f"{path}: not a readable torch file ({(detail[0] if detail else 'damaged pickle')[:160]}): "
                              f"the file is truncated or corrupt; restore it from the source checkpoint") from None
        what = f"it needs {found.group(1)}"
        raise FormatError(f"{path}: refused to load, unpickling it would need code outside the allow-list "
                          f"({what}): it is not a plain checkpoint; only if you trust its origin, "
                          f"rerun with `ckpt --trust-pickle ...`, which lets it run code") from None
    except Exception as e:  # noqa: BLE001 - a damaged pickle or zip fails in any way (IndexError, KeyError, ...)
        if mmap and "mmap" in str(e):
            return load_file(path, mmap=False)
        first = str(e).strip().splitlines()[0].split(". ")[0][:200] if str(e).strip() else type(e).__name__
        raise FormatError(f"{path}: not a readable torch file ({first}): the file is truncated or corrupt; "
                          f"restore it from the source checkpoint") from None


def save_file(obj: Any, path: str | Path) -> None:
    """torch.save + fsync: the caller writes into a temp dir that is renamed when complete."""
    import torch
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write a small text file via a temp name in the same dir + fsync + rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_json_atomic(path: str | Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")
