"""Every on-disk form a verb reads, as a record: how it is told apart (`detect`), its reader through torch (`reader`:
a shards.Reader) and its index of byte ranges read without torch (`byte_index`: the byte paths' source). `detect`
is the one place that decides which form a path holds: `shards.open_checkpoint`, `byte_ranges.ByteSource.open` and
`ckpt verify`'s other side ask it, and never test a form themselves.

The forms are tried in `READ`'s order and the first that recognises the path is its form. Our format comes last:
it takes any path, and its reader words what a path that is no checkpoint lacks. A new form read is a record here
(its `detect`, its reader, its byte index where its files allow one) and its line in `READ`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ckpt_tools.forms import megatron_lm


@dataclass(frozen=True)
class ReadForm:
    """An on-disk form as the verbs read it.

    name        what messages and `inspect` call it
    detect      does this path (a save dir, an iteration dir, a file) hold this form
    sharded     a sharded checkpoint (the verbs' SRC); else a whole model (an HF dir or safetensors file: `ckpt
                verify`'s OTHER, `ckpt import`'s input)
    reader      (path, vocab_size) -> the shards.Reader through torch
    byte_index  (path, vocab_size, from_master) -> byte_index.Index, or raises byte_index.Declined; None: the form
                is read through torch only"""
    name: str
    detect: Callable[[Path], bool]
    sharded: bool = True
    reader: Callable | None = None
    byte_index: Callable | None = None


def _megatron(by_dcp: bool) -> Callable[[Path], bool]:
    """A Megatron-LM save dir or iteration dir written through torch.distributed.checkpoint (`by_dcp`: torch_dist,
    torch_dcp or fsdp_dtensor, which one reader tells apart) or as legacy per-rank files."""
    def detect(path: Path) -> bool:
        return megatron_lm.is_megatron_lm(path) and megatron_lm.by_dcp(megatron_lm.resolve_iter_dir(path)) == by_dcp
    return detect


def _dcp_reader(path: Path, vocab_size: int | None):
    from ckpt_tools.forms.torch_dist_tensors import open_torch_dist
    return open_torch_dist(megatron_lm.resolve_iter_dir(path), vocab_size)


def _legacy_reader(path: Path, vocab_size: int | None):
    from ckpt_tools.forms.megatron_torch import LegacyShards
    return LegacyShards(megatron_lm.read_meta(megatron_lm.resolve_iter_dir(path), vocab_size))


def _ours_reader(path: Path, vocab_size: int | None):
    from ckpt_tools.forms import shards
    return shards.open_ours(path, vocab_size)


def _dcp_index(path: Path, vocab_size: int | None, from_master: bool):
    from ckpt_tools.forms import byte_index
    return byte_index.dist_index(path, vocab_size, from_master)


def _legacy_index(path: Path, vocab_size: int | None, from_master: bool):
    from ckpt_tools.forms import byte_index
    return byte_index.legacy_index(path, vocab_size, from_master)


def _ours_index(path: Path, vocab_size: int | None, from_master: bool):
    from ckpt_tools.forms import byte_index
    return byte_index.ours_index(path, vocab_size, from_master)


# torch_dist, torch_dcp and fsdp_dtensor: torch.distributed.checkpoint's files, one reader tells them apart
DCP = ReadForm(megatron_lm.TORCH_DIST, _megatron(by_dcp=True), reader=_dcp_reader, byte_index=_dcp_index)
LEGACY = ReadForm(megatron_lm.TORCH, _megatron(by_dcp=False), reader=_legacy_reader, byte_index=_legacy_index)
SAFETENSORS = ReadForm("safetensors", lambda p: p.is_file() and p.suffix == ".safetensors", sharded=False)
HF = ReadForm("hf", lambda p: p.is_dir() and (p / "config.json").is_file(), sharded=False)
OURS = ReadForm("ours", lambda p: True, reader=_ours_reader, byte_index=_ours_index)

READ: tuple[ReadForm, ...] = (DCP, LEGACY, SAFETENSORS, HF, OURS)


def detect(path: str | Path, sharded: bool = False) -> ReadForm:
    """The form `path` holds; `sharded`: among the sharded checkpoints' forms only (a verb's SRC)."""
    path = Path(path)
    return next(f for f in READ if (f.sharded or not sharded) and f.detect(path))
