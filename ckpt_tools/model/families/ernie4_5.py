"""ERNIE 4.5 (Baidu's dense ERNIE-4.5-0.3B): Llama's layers with RoPE on adjacent pairs of each head's dims
(transformers' Ernie4_5 rotation; megatron-core's rotary_interleaved), embeddings tied by default, and `use_bias`
putting a bias on every linear layer (megatron-core's add_bias_linear). Every tensor copies row for row, as Llama's
do; the rotation alone differs."""
from ckpt_tools.model.families import GATED, SAME, Family, Field, Name, heads_dim, llama

_L, _H = "decoder.layers.{i}.", "model.layers.{i}."
# `use_bias`: the output projection's and the MLP's biases beside Llama's QKV bias rows
NAMES = llama.NAMES + (
    Name(_L + "self_attention.linear_proj.bias", SAME, (_H + "self_attn.o_proj.bias",)),
    Name(_L + "mlp.linear_fc1.bias", GATED, (_H + "mlp.gate_proj.bias", _H + "mlp.up_proj.bias")),
    Name(_L + "mlp.linear_fc2.bias", SAME, (_H + "mlp.down_proj.bias",)),
)


def _head_dim(c: dict) -> int:
    """transformers' Ernie4_5Config: 128 where the key is absent, hidden / heads where it is null."""
    return heads_dim(c) if "head_dim" in c else 128


def _kv_heads(c: dict) -> int:
    """Ernie4_5Config: 2 where the key is absent, every head its own where it is null."""
    return c["num_attention_heads"] if "num_key_value_heads" in c else 2


FAMILY = Family(
    name="ernie4_5", model_type="ernie4_5", hf_class="Ernie4_5ForCausalLM",
    features={"rotary_interleaved": (True,), "add_bias_linear": (False, True), "tie_word_embeddings": (True, False)},
    names=NAMES,
    config=llama.config(1e-5, _head_dim, 131072, Field("use_bias", "add_bias_linear", False), tied=True,
                        theta=500000.0, kv=_kv_heads),
)
