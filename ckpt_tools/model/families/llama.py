"""Llama (2 and 3.x): RMSNorm, SwiGLU, RoPE (llama3 scaling allowed), grouped-query attention, no biases.
Its HF names serve every Llama-like family (Mistral, Qwen2, Qwen3): rows for QKV biases and query/key
norms are used only by a model that holds those tensors."""
from ckpt_tools.model.families import (GATED, QKV, SAME, VOCAB, Const, Family, Field, Name, Rope, anything, heads_dim,
                                       kv_heads)

_L, _H = "decoder.layers.{i}.", "model.layers.{i}."
NAMES = (
    Name("embedding.word_embeddings.weight", VOCAB, ("model.embed_tokens.weight",)),
    Name(_L + "input_layernorm.weight", SAME, (_H + "input_layernorm.weight",)),
    Name(_L + "self_attention.linear_proj.weight", SAME, (_H + "self_attn.o_proj.weight",)),
    Name(_L + "self_attention.linear_qkv.weight", QKV, tuple(_H + f"self_attn.{p}_proj.weight" for p in "qkv")),
    Name(_L + "self_attention.linear_qkv.bias", QKV, tuple(_H + f"self_attn.{p}_proj.bias" for p in "qkv")),
    Name(_L + "self_attention.q_layernorm.weight", SAME, (_H + "self_attn.q_norm.weight",)),
    Name(_L + "self_attention.k_layernorm.weight", SAME, (_H + "self_attn.k_norm.weight",)),
    Name(_L + "pre_mlp_layernorm.weight", SAME, (_H + "post_attention_layernorm.weight",)),
    Name(_L + "mlp.linear_fc1.weight", GATED, (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight")),
    Name(_L + "mlp.linear_fc2.weight", SAME, (_H + "mlp.down_proj.weight",)),
    Name("decoder.final_layernorm.weight", SAME, ("model.norm.weight",)),
    Name("output_layer.weight", VOCAB, ("lm_head.weight",)),
)

def config(rms_eps: float = 1e-6, head_dim=heads_dim, positions: int = 2048, *consts,
           act: Const = Const("hidden_act", "silu", "only SwiGLU (silu) MLPs"), tied: bool = False,
           theta: float = 10000.0, rope: Rope | None = None, kv=kv_heads) -> tuple:
    """The config.json keys of a Llama-like model; `consts` are the family's own fixed keys (and fields). `head_dim`
    None: the family's config.json derives it (not read, not written); `rope`: its own rotary entry; `kv`: the key
    value heads transformers assumes where the config gives none."""
    return (
        Field("vocab_size", "vocab_size"),
        Field("hidden_size", "hidden_size"),
        Field("intermediate_size", "ffn_hidden_size"),
        Field("num_hidden_layers", "num_layers"),
        Field("num_attention_heads", "num_attention_heads"),
        Field("num_key_value_heads", "num_query_groups", kv),
        *((Field("head_dim", "kv_channels", head_dim),) if head_dim is not None else ()),
        Field("max_position_embeddings", "max_position_embeddings", positions),
        Field("rms_norm_eps", "norm_epsilon", rms_eps),
        Field("tie_word_embeddings", "tie_word_embeddings", tied),
        rope or Rope(theta),
        act,
        Const("attention_dropout", 0.0, accept=anything),
        Const("initializer_range", 0.02, accept=anything),
        *consts,
    )


FAMILY = Family(
    name="llama", model_type="llama", hf_class="LlamaForCausalLM",
    features={"rope_scaling": (None, "llama3")},
    names=NAMES,
    config=config(1e-6, heads_dim, 2048,
                  Const("attention_bias", False, "biases on q, k, v and o but not the MLP: megatron-core biases "
                                                 "either every linear layer or only QKV"),
                  Const("mlp_bias", False, "MLP biases without attention biases"),
                  Const("pretraining_tp", 1, accept=anything)),
)
