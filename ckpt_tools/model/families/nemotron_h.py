"""Nemotron-H (NVIDIA's Mamba-2 hybrids: Nemotron-H 8B / 47B / 56B, Nemotron Nano 2): megatron-core's HybridModel,
a layer one block by its pattern (`hybrid_override_pattern`, transformers' `layers_block_type`):

    M  a Mamba-2 mixer (linear_attention)   *  grouped-query attention (full_attention)   -  an MLP (mlp)

each behind its own RMSNorm, no positions anywhere (attention without RoPE), the MLPs squared-ReLU (relu2) and not
gated, no biases. A Mamba-2 mixer is megatron-core's MambaMixer: in_proj [z; x; B; C; dt], a depthwise causal
convolution over [x; B; C] (width 4, biased), a step bias, A (as A_log) and D per head, a gated RMSNorm over each
group's channels, out_proj; transformers' NemotronHMamba2Mixer holds the same tensors in the same row order.

Refused in one line: MoE ('E') layers (Nemotron 3's latent MoE) and multi-token prediction layers, a convolution of
another width or without its bias, biased projections, activations other than relu2 / silu, a norm epsilon other
than megatron-core's gated norm's 1e-5.
"""
from ckpt_tools.errors import ConfigError
from ckpt_tools.model.families import QKV, SAME, VOCAB, Const, Derived, Family, Field, Name, anything

_L, _H = "decoder.layers.{i}.", "backbone.layers.{i}."
_X, _HX = _L + "mixer.", _H + "mixer."
_A = _L + "self_attention."

NAMES = (
    Name("embedding.word_embeddings.weight", VOCAB, ("backbone.embeddings.weight",)),
    # every block's norm is HF's `norm` of its layer
    Name(_L + "norm.weight", SAME, (_H + "norm.weight",)),
    Name(_L + "input_layernorm.weight", SAME, (_H + "norm.weight",)),
    Name(_L + "pre_mlp_layernorm.weight", SAME, (_H + "norm.weight",)),
    *(Name(_X + n, SAME, (_HX + n,)) for n in ("dt_bias", "A_log", "D", "in_proj.weight", "conv1d.weight",
                                                "conv1d.bias", "norm.weight", "out_proj.weight")),
    Name(_A + "linear_proj.weight", SAME, (_HX + "o_proj.weight",)),
    Name(_A + "linear_qkv.weight", QKV, tuple(_HX + f"{p}_proj.weight" for p in "qkv")),
    Name(_L + "mlp.linear_fc1.weight", SAME, (_HX + "up_proj.weight",)),
    Name(_L + "mlp.linear_fc2.weight", SAME, (_HX + "down_proj.weight",)),
    Name("decoder.final_layernorm.weight", SAME, ("backbone.norm_f.weight",)),
    Name("output_layer.weight", VOCAB, ("lm_head.weight",)),
)

# transformers' layers_block_type <-> the pattern's symbols
BLOCK_TYPES = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}


def _read_pattern(c: dict, out: dict, refuse) -> None:
    """layers_block_type (transformers 5), else hybrid_override_pattern (the published configs) -> layer_pattern."""
    types = c.get("layers_block_type")
    if types is not None:
        if not isinstance(types, list) or any(t not in BLOCK_TYPES for t in types):
            refuse(f"layers_block_type {types!r:.80} (entries of {', '.join(BLOCK_TYPES)})")
        text = "".join(BLOCK_TYPES[t] for t in types)
    else:
        text = c.get("hybrid_override_pattern")
        if not isinstance(text, str) or not text:
            raise KeyError("layers_block_type")
    if "E" in text:
        refuse(f"MoE layers ('E' in {text!r:.60}: Nemotron 3's latent MoE) are not converted by this version")
    out["layer_pattern"], out["num_layers"] = text, len(text)


def _write_pattern(spec) -> list[str]:
    back = {v: k for k, v in BLOCK_TYPES.items()}
    return [back[c] for c in spec.layer_pattern]


def check(spec) -> None:
    if spec.norm_epsilon != 1e-5:
        raise ConfigError(f"norm_epsilon {spec.norm_epsilon} with Mamba-2 layers: megatron-core's gated norm inside "
                          f"each mixer fixes 1e-5 (transformers' uses layer_norm_epsilon): use 1e-5")


FAMILY = Family(
    name="nemotron_h", model_type="nemotron_h", hf_class="NemotronHForCausalLM", hybrid=True,
    features={"activation": ("squared_relu",), "position_embedding_type": ("none",)},
    names=NAMES, check=check,
    config=(
        Field("vocab_size", "vocab_size"),
        Field("hidden_size", "hidden_size"),
        Field("intermediate_size", "ffn_hidden_size"),
        Derived("layers_block_type", _read_pattern, _write_pattern),
        Field("num_attention_heads", "num_attention_heads"),
        Field("num_key_value_heads", "num_query_groups", lambda c: c["num_attention_heads"]),
        Field("head_dim", "kv_channels", lambda c: c["hidden_size"] // c["num_attention_heads"]),
        Field("max_position_embeddings", "max_position_embeddings", 4096),
        Field("layer_norm_epsilon", "norm_epsilon", 1e-5),
        Field("tie_word_embeddings", "tie_word_embeddings", False),
        Field("mamba_num_heads", "mamba_num_heads", 128),
        Field("mamba_head_dim", "mamba_head_dim", 64),
        Field("ssm_state_size", "mamba_state_dim", 128),
        Field("n_groups", "mamba_num_groups", 8),
        Const("conv_kernel", 4, "a convolution of another width: megatron-core's MambaMixer fixes 4"),
        Const("use_conv_bias", True, "a convolution without bias: megatron-core's MambaMixer always has one"),
        Const("mamba_hidden_act", "silu", "megatron-core's Mamba-2 mixer is silu-activated"),
        Const("mlp_hidden_act", "relu2", "megatron-core's hybrid MLPs here are squared-ReLU"),
        Const("use_bias", False, "biased Mamba projections: megatron-core's MambaMixer has none"),
        Const("mamba_proj_bias", False, "biased Mamba projections: megatron-core's MambaMixer has none"),
        Const("attention_bias", False, "biased attention projections: not in Nemotron-H"),
        Const("mlp_bias", False, "biased MLPs: not in Nemotron-H"),
        Const("num_nextn_predict_layers", 0, "multi-token prediction layers: not converted for Nemotron-H by this "
                                             "version"),
        Const("chunk_size", 128, accept=anything),  # the scan's chunking: the same sums in another order
        Const("residual_in_fp32", False, accept=anything),
        Const("attention_dropout", 0.0, accept=anything),
        Const("hidden_dropout", 0.0, accept=anything),
        Const("initializer_range", 0.02, accept=anything),
        Const("rescale_prenorm_residual", True, accept=anything),
    ),
)
