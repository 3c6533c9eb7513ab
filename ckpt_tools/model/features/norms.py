"""The norms' features: which norm, zero-centred weights (Gemma, Qwen3-Next), q/k norms (Qwen3, OLMoE) and OLMoE's q/k
norms across all heads."""
from __future__ import annotations

from ckpt_tools.model.features.base import Feature, arg, cannot_hold

NORMALIZATION = Feature(
    "normalization", ("RMSNorm",), "normalization",
    read=lambda args: arg(args, "normalization", "LayerNorm"),
    write=lambda spec: {"normalization": spec.normalization})

# --apply-layernorm-1p (megatron-core's layernorm_zero_centered_gamma): every norm scales by 1 + w
ZERO_CENTERED = Feature(
    "zero_centered_norm", (False,), "apply_layernorm_1p",
    read=lambda args: bool(arg(args, "apply_layernorm_1p", False) or arg(args, "layernorm_zero_centered_gamma", False)),
    write=lambda spec: {"apply_layernorm_1p": bool(spec.zero_centered_norm)})

QK_NORM = Feature(
    "qk_layernorm", (False,), "qk_layernorm",
    read=lambda args: bool(arg(args, "qk_layernorm", False)),
    write=lambda spec: {"qk_layernorm": spec.qk_layernorm})


QK_NORM_ACROSS_HEADS = Feature("qk_norm_across_heads", (False,), refuse=cannot_hold(
    "qk_norm_across_heads", "its q/k norms span all heads, megatron-core's qk_layernorm normalises each head"))
