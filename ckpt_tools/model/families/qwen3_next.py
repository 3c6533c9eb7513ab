"""Qwen3-Next (Qwen3-Next-80B-A3B and its kin): a layer is a token mixer and an MoE MLP; the mixers alternate between
gated DeltaNet linear attention (`layer_types` "linear_attention": megatron-core's GatedDeltaNet, 'G' in the layer
pattern) and gated full attention ("full_attention": grouped-query attention whose every head's output is scaled by
sigmoid of a gate projected with its query, megatron-core's attention_output_gate; per-head q/k norms; rotary on the
first `partial_rotary_factor` of each head). Every norm but the DeltaNet's gated one is zero-centred (scales by 1 + w:
megatron-core's layernorm_zero_centered_gamma); the MoE is Qwen2-MoE's (a softmax router renormalised over its top-k,
a shared expert scaled by sigmoid(shared_expert_gate . x)).

transformers interleaves what megatron-core keeps apart: q_proj holds each head's [query; gate] rows (megatron-core's
linear_qkv: per query group [q heads; gate heads; k; v]), in_proj_qkvz / in_proj_ba each key head's [q; k; v; z] and
[b; a] of its value heads (megatron-core's in_proj: [q; k; v; z; b; a], head-major), the DeltaNet's norm scales by w
where megatron-core's zero-centred one scales by 1 + w (ckpt_tools.model.hf: `qkv_gated`, `gdn_in`, `norm_offset`, the
last exact for weights in [0.5, 2]).

Refused in one line: layers with a dense MLP (`mlp_only_layers`, `decoder_sparse_step` > 1), attention biases, a
`hidden_act` other than silu; the published checkpoints' multi-token prediction tensors (`mtp.*`, which transformers
ignores too); Megatron-LM's legacy form as an output (torch_dist is written: these are Transformer Engine modules).
"""
from ckpt_tools.model.families import (GDN_IN, NORM_OFFSET, OMIT, QKV_GATED, SAME, Const, Derived, Family, Field, Name,
                                       Rope, anything, llama)
from ckpt_tools.model.families.mixtral import TRAINING_ONLY
from ckpt_tools.model.families.qwen2_moe import FAMILY as QWEN2_MOE

_L, _H = "decoder.layers.{i}.", "model.layers.{i}."
_A, _X = _L + "self_attention.", _H + "linear_attn."
_QKV = ("linear_qkv.weight", "linear_qkv.bias")

NAMES = tuple(n for n in QWEN2_MOE.names if not n.key.endswith(tuple("self_attention." + q for q in _QKV))) + (
    Name(_A + "linear_qkv.weight", QKV_GATED, tuple(_H + f"self_attn.{p}_proj.weight" for p in "qkv")),
    # a gated DeltaNet (HF `linear_attn`), under megatron-core's self_attention
    Name(_A + "dt_bias", SAME, (_X + "dt_bias",)),
    Name(_A + "A_log", SAME, (_X + "A_log",)),
    Name(_A + "in_proj.weight", GDN_IN, (_X + "in_proj_qkvz.weight", _X + "in_proj_ba.weight")),
    Name(_A + "conv1d.weight", SAME, (_X + "conv1d.weight",)),
    Name(_A + "out_norm.weight", NORM_OFFSET, (_X + "norm.weight",)),
    Name(_A + "out_proj.weight", SAME, (_X + "out_proj.weight",)),
)

LINEAR, FULL = "linear_attention", "full_attention"


def _read_types(c: dict, out: dict, refuse) -> None:
    """layer_types -> the layer pattern: 'G' (gated DeltaNet) or '*' (gated attention), each with its MoE MLP
    (transformers' default: every 4th layer full)."""
    n = c["num_hidden_layers"]
    types = c.get("layer_types") or [FULL if (i + 1) % c.get("full_attention_interval", 4) == 0 else LINEAR
                                     for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in (LINEAR, FULL) for t in types):
        refuse(f"layer_types {types!r:.80} is not {n} entries of {LINEAR!r} or {FULL!r}")
    out["layer_pattern"] = "".join(("G" if t == LINEAR else "*") + "E" for t in types)


def _write_types(spec) -> list[str]:
    return [LINEAR if spec.layer_symbols(i)[0] == "G" else FULL for i in range(spec.num_layers)]


FAMILY = Family(
    name="qwen3_next", model_type="qwen3_next", hf_class="Qwen3NextForCausalLM", moe=True, shared_experts=True,
    partial_rotary=True, linear_attention=True,
    features={"qk_layernorm": (True,), "zero_centered_norm": (True,),
              "moe_shared_expert_gate": (True,), "attention_output_gate": (True,)},
    names=NAMES,
    config=llama.config(
        1e-6, lambda c: 256, 32768,
        Field("num_experts", "num_moe_experts", 512),
        Field("num_experts_per_tok", "moe_router_topk", 10),
        Field("moe_intermediate_size", "moe_ffn_hidden_size", 512),
        Field("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size", 512),
        Field("norm_topk_prob", "moe_router_pre_softmax", True, {True: False, False: True}),
        Field("linear_num_key_heads", "linear_num_key_heads", 16),
        Field("linear_num_value_heads", "linear_num_value_heads", 32),
        Field("linear_key_head_dim", "linear_key_head_dim", 128),
        Field("linear_value_head_dim", "linear_value_head_dim", 128),
        Field("linear_conv_kernel_dim", "linear_conv_kernel_dim", 4),
        Derived("layer_types", _read_types, _write_types),
        Const("attention_bias", False, "biased attention projections: not Qwen3-Next's"),
        Const("decoder_sparse_step", 1, "layers with a dense MLP between MoE layers"),
        Const("mlp_only_layers", [], "layers with a dense MLP", accept=lambda v: v == []),
        Const("full_attention_interval", OMIT, accept=anything),
        *TRAINING_ONLY,
        rope=Rope(10000.0, partial=True, partial_default=0.25)),
)
