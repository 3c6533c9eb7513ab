"""ERNIE 4.5 (Baidu's dense ERNIE-4.5-0.3B): Llama's layers with RoPE on adjacent pairs of each head's dims
(transformers' Ernie4_5 rotation; megatron-core's rotary_interleaved), embeddings tied by default, and `use_bias`
putting a bias on every linear layer (megatron-core's add_bias_linear). Every tensor copies row for row, as Llama's
do; the rotation alone differs."""
from ckpt_tools.model.families import (GATED, SAME, Family, Field, Name, head_dim_unless_null, kv_heads_unless_null,
                                       llama)

_L, _H = "decoder.layers.{i}.", "model.layers.{i}."
# `use_bias`: the output projection's and the MLP's biases beside Llama's QKV bias rows
NAMES = llama.NAMES + (
    Name(_L + "self_attention.linear_proj.bias", SAME, (_H + "self_attn.o_proj.bias",)),
    Name(_L + "mlp.linear_fc1.bias", GATED, (_H + "mlp.gate_proj.bias", _H + "mlp.up_proj.bias")),
    Name(_L + "mlp.linear_fc2.bias", SAME, (_H + "mlp.down_proj.bias",)),
)


FAMILY = Family(
    name="ernie4_5", model_type="ernie4_5", hf_class="Ernie4_5ForCausalLM",
    features={"rotary_interleaved": (True,), "add_bias_linear": (False, True), "tie_word_embeddings": (True, False)},
    names=NAMES,
    config=llama.config(1e-5, head_dim_unless_null(128), 131072, Field("use_bias", "add_bias_linear", False),
                        tied=True, theta=500000.0, kv=kv_heads_unless_null(2)),
)
