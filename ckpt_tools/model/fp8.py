"""Block-scaled FP8 HF weights (DeepSeek-V3's and Kimi K2's published form: e4m3 weights, one fp32 `weight_scale_inv`
per block): the config.json's block, which tensors are held so, dequantizing them exactly and quantizing them back by
transformers' rule. ckpt_tools.model.hf re-exports these names."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt_tools.errors import FormatError
from ckpt_tools.model import mxfp4

if TYPE_CHECKING:
    import torch


SCALE = "_scale_inv"  # a block-scaled FP8 weight's companion: `<name>_scale_inv`, one fp32 scale per block
QUANTIZATION = "quantization_config"


def fp8_blocks(config: dict, where: Path) -> tuple[int, int] | None:
    """The weight block of a block-scaled FP8 checkpoint's config.json (DeepSeek-V3's and Kimi K2's published form:
    quant_method fp8, e4m3 weights, `weight_block_size` [128, 128], dynamic activation scales); None for an
    unquantized one (or an MXFP4 one: ckpt_tools.model.mxfp4). Any other quantization is refused in one line."""
    q = config.get(QUANTIZATION)
    if q is None or mxfp4.is_mxfp4(config):
        return None
    block = q.get("weight_block_size") if isinstance(q, dict) else None
    fmt, act = (q.get("fmt", "e4m3"), q.get("activation_scheme", "dynamic")) if isinstance(q, dict) else (None, None)
    if not isinstance(q, dict) or q.get("quant_method") != "fp8" or fmt != "e4m3" or act != "dynamic" or not (
            isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise FormatError(f"{where}: quantization_config {json.dumps(q)[:120]} is not read: this version reads "
                          f"block-scaled FP8 weights (quant_method fp8, fmt e4m3, activation_scheme dynamic, "
                          f"weight_block_size [rows, cols]) and MXFP4 ones (quant_method mxfp4); dequantize the model "
                          f"with transformers first")
    return block[0], block[1]


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """An FP8 weight [rows, cols] times its per-block scales [ceil(rows / b0), ceil(cols / b1)], in fp32 (the last
    blocks may be partial): the values the weights stand for, as transformers dequantizes them in fp32."""
    rows, cols = q.shape
    full = scale.float().repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return q.float() * full


E4M3_MAX = 448.0
FP8 = "float8_e4m3fn"


def fp8_quantized(name: str, shape: tuple[int, ...]) -> bool:
    """Whether an HF tensor is one DeepSeek-V3's FP8 checkpoints hold in FP8 blocks: the decoder layers' linear
    weights (attention projections, MLPs, experts, shared experts), not norms, the router, embeddings or the head (nor
    a multi-token prediction layer's eh_proj or its copies of the embedding and head)."""
    return (name.startswith("model.layers.") and name.endswith(".weight") and len(shape) == 2 and "norm" not in name
            and not name.endswith((".mlp.gate.weight", ".eh_proj.weight", ".embed_tokens.weight",
                                   ".shared_head.head.weight")))


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def fp8_config(block: tuple[int, int]) -> dict:
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 weight [rows, cols] -> (e4m3 weight, weight_scale_inv [ceil(rows / b0), ceil(cols / b1)] fp32) by
    transformers' FP8 quantizer's rule: per block scale = 448 / amax (1 for an all-zero block), the weight times it
    clamped to +-448 in e4m3, the stored inverse 1 / scale; the last blocks may be partial (DeepSeek's layout)."""
    import torch
    rows, cols = w.shape
    grid = scale_grid(w.shape, block)
    padded = torch.zeros(grid[0] * block[0], grid[1] * block[1], dtype=torch.float32)
    padded[:rows, :cols] = w
    amax = padded.view(grid[0], block[0], grid[1], block[1]).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, E4M3_MAX / torch.where(amax > 0, amax, torch.ones_like(amax)), torch.ones_like(amax))
    inv = (1.0 / scale).to(torch.float32)
    full = scale.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return torch.clamp(w.float() * full, min=-E4M3_MAX, max=E4M3_MAX).to(torch.float8_e4m3fn), inv
