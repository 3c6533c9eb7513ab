"""GPT-2: LayerNorm, GELU, learned absolute positions, biases everywhere, tied embeddings; HF's Conv1D
stores weights transposed and c_attn holds whole [q; k; v] blocks."""
from ckpt_tools.errors import ConfigError
from ckpt_tools.model.families import C_ATTN, CONV1D, SAME, VOCAB, Const, Family, Field, Name, anything

_L, _H = "decoder.layers.{i}.", "transformer.h.{i}."
NAMES = (
    Name("embedding.word_embeddings.weight", VOCAB, ("transformer.wte.weight",)),
    Name("embedding.position_embeddings.weight", SAME, ("transformer.wpe.weight",)),
    Name(_L + "input_layernorm.weight", SAME, (_H + "ln_1.weight",)),
    Name(_L + "input_layernorm.bias", SAME, (_H + "ln_1.bias",)),
    Name(_L + "self_attention.linear_proj.weight", CONV1D, (_H + "attn.c_proj.weight",)),
    Name(_L + "self_attention.linear_proj.bias", SAME, (_H + "attn.c_proj.bias",)),
    Name(_L + "self_attention.linear_qkv.weight", C_ATTN, (_H + "attn.c_attn.weight",)),
    Name(_L + "self_attention.linear_qkv.bias", C_ATTN, (_H + "attn.c_attn.bias",)),
    Name(_L + "pre_mlp_layernorm.weight", SAME, (_H + "ln_2.weight",)),
    Name(_L + "pre_mlp_layernorm.bias", SAME, (_H + "ln_2.bias",)),
    Name(_L + "mlp.linear_fc1.weight", CONV1D, (_H + "mlp.c_fc.weight",)),
    Name(_L + "mlp.linear_fc1.bias", SAME, (_H + "mlp.c_fc.bias",)),
    Name(_L + "mlp.linear_fc2.weight", CONV1D, (_H + "mlp.c_proj.weight",)),
    Name(_L + "mlp.linear_fc2.bias", SAME, (_H + "mlp.c_proj.bias",)),
    Name("decoder.final_layernorm.weight", SAME, ("transformer.ln_f.weight",)),
    Name("decoder.final_layernorm.bias", SAME, ("transformer.ln_f.bias",)),
)


def _check(spec) -> None:
    if spec.num_query_groups != spec.num_attention_heads:
        raise ConfigError("gpt2 has no grouped-query attention: set num_query_groups = num_attention_heads")


def _ffn(c: dict) -> int:
    return 4 * c["n_embd"]


FAMILY = Family(
    name="gpt2", model_type="gpt2", hf_class="GPT2LMHeadModel",
    features={"normalization": ("LayerNorm",), "activation": ("gelu", "gelu_tanh"), "add_bias_linear": (True,),
              "position_embedding_type": ("learned_absolute",), "tie_word_embeddings": (True,)},
    names=NAMES, check=_check,
    config=(
        Field("vocab_size", "vocab_size"),
        Field("n_embd", "hidden_size"),
        Field("n_layer", "num_layers"),
        Field("n_head", "num_attention_heads"),
        Field("n_inner", "ffn_hidden_size", _ffn),
        Field("n_positions", "max_position_embeddings", 1024),
        Field("layer_norm_epsilon", "norm_epsilon", 1e-5),
        Field("activation_function", "activation", "gelu_new", values={"gelu": "gelu", "gelu_tanh": "gelu_new"}),
        Const("tie_word_embeddings", True, "GPT-2 ties input and output embeddings"),
        Const("scale_attn_weights", True, "attention without 1/sqrt(d) scaling"),
        Const("scale_attn_by_inverse_layer_idx", False, "per-layer attention scaling"),
        Const("reorder_and_upcast_attn", False, "upcast attention"),
        *(Const(k, 0.0, accept=anything) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")),
        Const("initializer_range", 0.02, accept=anything),
    ),
)
