"""The MLP's features: its activation (with GPT-OSS's clamp), biases on every linear layer, and a gated MLP's offset
on its linear half (GPT-OSS's experts)."""
from __future__ import annotations

from ckpt_tools.model.features.base import Feature, arg


def _activation(args) -> str:
    if arg(args, "squared_relu", False):
        return "squared_relu"
    if arg(args, "swiglu", False):
        return "swiglu"
    if arg(args, "quick_geglu", False):
        return "quick_geglu"
    # megatron-core's MLP applies the tanh-approximated GELU when bias_gelu_fusion is on (the default); openai_gelu
    # (tanh as well) switches only the legacy model
    tanh = arg(args, "bias_gelu_fusion", True) or (arg(args, "use_legacy_models", False)
                                                   and arg(args, "openai_gelu", False))
    return "gelu_tanh" if tanh else "gelu"


def _activation_args(spec) -> dict:
    act = spec.activation
    return {"swiglu": act == "swiglu", "openai_gelu": False, "squared_relu": act == "squared_relu",
            "quick_geglu": act == "quick_geglu", "activation_func_clamp_value": spec.activation_clamp,
            # quick_geglu's fused kernel clamps before the bias is added (megatron-core's SequentialMLP): off
            "bias_gelu_fusion": spec.add_bias_linear and act == "gelu_tanh", "bias_swiglu_fusion": True}


def _activation_flags(spec) -> str:
    if spec.activation != "quick_geglu":
        return ""
    return " --quick-geglu --no-bias-gelu-fusion" + (
        f" --activation-func-clamp-value {spec.activation_clamp:g}" if spec.activation_clamp else "")


ACTIVATION = Feature(
    "activation", ("swiglu",), "activation (--swiglu, --squared-relu, --quick-geglu)",
    read=_activation, write=_activation_args, flags=_activation_flags)

BIAS = Feature(
    "add_bias_linear", (False,), "add_bias_linear",
    read=lambda args: bool(arg(args, "add_bias_linear", True)),
    write=lambda spec: {"add_bias_linear": spec.add_bias_linear})

GLU_OFFSET = Feature(
    "glu_linear_offset", (0.0,), "glu_linear_offset",
    read=lambda args: float(arg(args, "glu_linear_offset", 0.0)),
    write=lambda spec: {"glu_linear_offset": spec.glu_linear_offset},
    flags=lambda spec: f" --glu-linear-offset {spec.glu_linear_offset:g}" if spec.glu_linear_offset else "")
