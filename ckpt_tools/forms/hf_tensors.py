"""The tensors of an HF model dir, read lazily from its safetensors files (`HFTensors`): a tensor by name, a slice of
a stacked one (`name[e]`), quantized weights given dequantized (block-scaled FP8 by its scales; MXFP4 blocks with their
scales), each read from the byte range its file's header names (`data_offsets`).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt_tools.errors import FormatError
from ckpt_tools.forms.dtypes import SAFETENSORS_DTYPES
from ckpt_tools.model import mxfp4
from ckpt_tools.model.fp8 import SCALE, dequantize_blocks, fp8_blocks
from ckpt_tools.model.hf import part_of

if TYPE_CHECKING:
    import torch


def data_offsets(path: Path) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """name -> (safetensors dtype, shape, first byte, end byte in the file) of a safetensors file, from its header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > 100 << 20:
            raise FormatError(f"{path}: a safetensors header of {n} bytes: download or merge it again")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {name: (e["dtype"], tuple(e["shape"]), 8 + n + e["data_offsets"][0], 8 + n + e["data_offsets"][1])
            for name, e in header.items()}


class HFTensors:
    """The tensors of an HF model dir (model.safetensors or an index of several) or of one
    safetensors file, read lazily. Block-scaled FP8 weights (config.json's quantization_config) are given
    dequantized, in fp32; their scales are not listed."""

    def __init__(self, hf_dir: Path):
        from safetensors import safe_open
        hf_dir = Path(hf_dir)
        index = hf_dir / "model.safetensors.index.json"
        if hf_dir.is_file():
            hf_dir, files = hf_dir.parent, [hf_dir.name]
        elif index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (hf_dir / "model.safetensors").is_file():
            files = ["model.safetensors"]
        else:
            raise FormatError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json: only safetensors "
                              f"weights are imported (convert .bin weights with transformers' save_pretrained)")
        self._handles = {}
        self._paths: dict[str, Path] = {}
        self._offsets: dict[str, dict] = {}
        self.where: dict[str, str] = {}
        for name in files:
            path = hf_dir / name
            if not path.is_file():
                raise FormatError(f"{path}: listed in the index but missing: download it again")
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error types for a damaged header
                raise FormatError(f"{path}: not a readable safetensors file ({e}): download or merge it again") from None
            self._handles[name] = handle
            self._paths[name] = path
            for key in handle.keys():
                self.where[key] = name
        self._file_of = dict(self.where)  # every tensor, the scales too
        config = hf_dir / "config.json"
        settings = json.loads(config.read_text()) if config.is_file() else {}
        self.block = fp8_blocks(settings, config) if config.is_file() else None
        self.packed: dict[str, tuple[str, str]] = {}  # an MXFP4 weight -> its blocks and scales
        if mxfp4.is_mxfp4(settings):
            self._pack(hf_dir)
        self.scales: dict[str, str] = {}  # an FP8 weight -> its scales
        if self.block is not None:
            self.scales = {key[:-len(SCALE)]: key for key in self.where if key.endswith(SCALE)}
            lost = sorted(k for k in self.scales if k not in self.where)
            if lost:
                raise FormatError(f"{hf_dir}: scales {self.scales[lost[0]]} without their weight {lost[0]}: the "
                                  f"checkpoint is incomplete; download it again")
            for key in self.scales.values():
                del self.where[key]
        for file in set(self.where.values()):  # an FP8 tensor is read only with its block scales
            self._offsets.setdefault(file, data_offsets(self._paths[file]))
            bare = sorted(k for k, (dtype, *_) in self._offsets[file].items()
                          if dtype.startswith("F8") and k in self.where and k not in self.scales)
            if bare:
                raise FormatError(f"{self._paths[file]}: {bare[0]} is {self._offsets[file][bare[0]][0]} without "
                                  f"block scales ({bare[0]}{SCALE}"
                                  + (")" if self.block else " and a quantization_config)") +
                                  ": this version reads FP8 weights with their block scales only; dequantize the "
                                  "model with transformers first")

    def _pack(self, hf_dir: Path) -> None:
        """MXFP4 weights (`<name>_blocks` + `<name>_scales`) listed under their name, dequantized when read."""
        for key in [k for k in self.where if k.endswith(mxfp4.BLOCKS)]:
            name = key[:-len(mxfp4.BLOCKS)]
            if name + mxfp4.SCALES not in self.where:
                raise FormatError(f"{hf_dir}: MXFP4 blocks {key} without their scales {name}{mxfp4.SCALES}: the "
                                  f"checkpoint is incomplete; download it again")
            self.packed[name] = (key, name + mxfp4.SCALES)
            self.where[name] = self.where.pop(key)
            del self.where[name + mxfp4.SCALES]
        lost = sorted(k for k in self.where if k.endswith(mxfp4.SCALES) and k[:-len(mxfp4.SCALES)] not in self.packed)
        if lost:
            raise FormatError(f"{hf_dir}: MXFP4 scales {lost[0]} without their blocks: the checkpoint is incomplete; "
                              f"download it again")

    def holds(self, name: str) -> bool:
        """Whether the weights hold the tensor (or, for a slice `name[e]`, the stacked tensor it is a slice of)."""
        base, e = part_of(name)
        return base in self.where and (e is None or e < self.shape(base)[0])

    def get(self, name: str) -> torch.Tensor:
        """The tensor (an FP8 weight dequantized by its block scales, fp32); `name[e]`: slice e of a stacked tensor,
        read alone."""
        base, e = part_of(name)
        if base in self.packed:
            blocks, scales = self.packed[base]
            return mxfp4.dequantize(self._get(blocks, e), self._get(scales, e), f"{self._paths[self._file_of[blocks]]}: "
                                                                               f"{base}")
        if e is not None:
            return self._get(base, e)
        if name not in self.scales:
            return self._get(name)
        q, scale = self._get(name), self._get(self.scales[name])
        grid = tuple(-(-n // b) for n, b in zip(q.shape, self.block))
        if q.dim() != 2 or tuple(scale.shape) != grid:
            raise FormatError(f"{self._paths[self._file_of[name]]}: {self.scales[name]} has shape {list(scale.shape)}, "
                              f"expected {list(grid)} (one scale per {self.block[0]} x {self.block[1]} block of "
                              f"{name} {list(q.shape)}): the checkpoint is damaged; download it again")
        return dequantize_blocks(q, scale, self.block)

    def _get(self, name: str, part: int | None = None) -> torch.Tensor:
        """The tensor (or its slice `part` on the first axis), read into memory of its own (pread, not the file's
        mapping: the pages of every tensor read so far would otherwise stay resident until the end)."""
        import torch
        file = self._file_of[name]
        if file not in self._offsets:
            self._offsets[file] = data_offsets(self._paths[file])
        dtype, shape, start, end = self._offsets[file][name]
        if dtype not in SAFETENSORS_DTYPES or end == start:
            whole = self._handles[file].get_tensor(name)
            return whole if part is None else whole[part]
        if part is not None:
            if not 0 <= part < shape[0]:
                raise FormatError(f"{self._paths[file]}: {name} has {shape[0]} slices, not {part + 1}: the weights and "
                                  f"config.json disagree")
            step = (end - start) // shape[0]
            start, end, shape = start + part * step, start + (part + 1) * step, shape[1:]
        buf = bytearray(end - start)
        view, done = memoryview(buf), 0
        with open(self._paths[file], "rb", buffering=0) as f:
            f.seek(start)
            while done < len(buf):  # one read returns at most ~2 GiB
                n = f.readinto(view[done:])
                if not n:
                    raise FormatError(f"{self._paths[file]}: {name} runs past the end of the file: download or merge "
                                      f"it again")
                done += n
        return torch.frombuffer(buf, dtype=getattr(torch, SAFETENSORS_DTYPES[dtype])).reshape(shape)

    def dtype_name(self, name: str) -> str:
        """The dtype name of the tensor as `get` gives it ("float32" for an FP8 block weight, dequantized)."""
        name = part_of(name)[0]
        if name in self.packed:
            return "bfloat16"
        if name in self.scales:
            return "float32"
        file = self._file_of[name]
        if file not in self._offsets:
            self._offsets[file] = data_offsets(self._paths[file])
        code = self._offsets[file][name][0]
        return SAFETENSORS_DTYPES.get(code, code.lower())

    def shape(self, name: str) -> tuple[int, ...]:
        base, e = part_of(name)
        if base in self.packed:
            key = self.packed[base][0]
            shape = mxfp4.hf_shape(tuple(self._handles[self.where[base]].get_slice(key).get_shape()))
        else:
            shape = tuple(self._handles[self.where[base]].get_slice(base).get_shape())
        return shape if e is None else shape[1:]
