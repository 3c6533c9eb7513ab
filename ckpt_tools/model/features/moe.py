"""The MoE layers' features: a gate on the shared expert (Qwen2-MoE), the router's score function and its expert bias
(DeepSeek-V3). Megatron-LM's arguments carry them only for a model with experts."""
from __future__ import annotations

from ckpt_tools.model.features.base import Feature, arg


def _experts(args) -> bool:
    return bool(arg(args, "num_experts", None))


# Megatron-LM builds the gate only with a shared expert (and experts): without one the flag means nothing
SHARED_EXPERT_GATE = Feature(
    "moe_shared_expert_gate", (False,), "moe_shared_expert_gate",
    read=lambda args: bool(arg(args, "moe_shared_expert_gate", False))
    and bool(arg(args, "moe_shared_expert_intermediate_size", None)) and _experts(args),
    write=lambda spec: {"moe_shared_expert_gate": bool(spec.moe_shared_expert_gate)} if spec.is_moe else {})

SCORE_FUNCTION = Feature(
    "moe_router_score_function", ("softmax",), "moe_router_score_function",
    read=lambda args: arg(args, "moe_router_score_function", "softmax") if _experts(args) else "softmax",
    # the sigmoid router's logits in fp32, as transformers computes DeepSeek's (megatron-core's default: the
    # input's dtype)
    write=lambda spec: {"moe_router_score_function": spec.moe_router_score_function,
                        "moe_router_dtype": "fp32" if spec.moe_router_score_function == "sigmoid" else None}
    if spec.is_moe else {})

EXPERT_BIAS = Feature(
    "moe_router_enable_expert_bias", (False,), "moe_router_enable_expert_bias",
    read=lambda args: bool(arg(args, "moe_router_enable_expert_bias", False)) and _experts(args),
    write=lambda spec: {"moe_router_enable_expert_bias": bool(spec.moe_router_enable_expert_bias)}
    if spec.is_moe else {})
