"""The attention's features: biases on QKV only (Qwen2), multi-latent attention (DeepSeek-V3), learned softmax
offsets (GPT-OSS's sinks) and a gate on each head's output (Qwen3-Next)."""
from __future__ import annotations

from ckpt_tools.model.features.base import Feature, arg

# megatron-core's linear_qkv has a bias when every linear has one (add_bias_linear) or only QKV has
QKV_BIAS = Feature(
    "add_qkv_bias", (False,), "add_qkv_bias",
    read=lambda args: bool(arg(args, "add_qkv_bias", False)) and not bool(arg(args, "add_bias_linear", True)),
    write=lambda spec: {"add_qkv_bias": spec.qkv_bias})


def _mla_args(spec) -> dict:
    """Multi-latent attention's flag and rotary embedding: plain RoPE or YaRN (megatron-core's MLA defaults to
    YaRN)."""
    mla = bool(spec.multi_latent_attention)
    return {"multi_latent_attention": mla,
            "rope_type": ("yarn" if spec.rope_scaling == "yarn" else "rope") if mla else None}


def _mla_flags(spec) -> str:
    """--use-checkpoint-args restores neither MLA's rotary type nor YaRN's parameters."""
    if not spec.multi_latent_attention:
        return ""
    if spec.rope_scaling != "yarn":
        return " --rope-type rope"
    return (f" --rope-type yarn --rotary-scaling-factor {spec.rope_scaling_factor:g} --mscale {spec.rope_mscale:g} "
            f"--mscale-all-dim {spec.rope_mscale_all_dim:g}")


MLA = Feature(
    "multi_latent_attention", (False,), "multi_latent_attention",
    read=lambda args: bool(arg(args, "multi_latent_attention", False)), write=_mla_args, flags=_mla_flags)

# megatron-core's core_attention.softmax_offset, transformers' GPT-OSS `sinks`
SOFTMAX = Feature(
    "softmax_type", ("vanilla",), "softmax_type",
    read=lambda args: arg(args, "softmax_type", "vanilla"),
    write=lambda spec: {"softmax_type": spec.softmax_type or "vanilla"},
    flags=lambda spec: f" --softmax-type {spec.softmax_type}" if spec.softmax_type not in (None, "vanilla") else "")

OUTPUT_GATE = Feature(
    "attention_output_gate", (False,), "attention_output_gate",
    read=lambda args: bool(arg(args, "attention_output_gate", False)),
    write=lambda spec: {"attention_output_gate": bool(spec.attention_output_gate)})
