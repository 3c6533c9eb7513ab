"""Seed-OSS (ByteDance's Seed-OSS-36B): Llama's layers with biases on Q, K and V only, as Qwen2 (megatron-core's
add_qkv_bias), head_dim explicit. Its dropouts act in training only."""
from ckpt_tools.model.families import Const, Family, anything, head_dim_unless_null, kv_heads_unless_null, llama

FAMILY = Family(
    name="seed_oss", model_type="seed_oss", hf_class="SeedOssForCausalLM",
    features={"add_qkv_bias": (True,)}, names=llama.NAMES,
    config=llama.config(1e-6, head_dim_unless_null(128), 524288,
                        Const("attention_bias", True, "Q, K and V without biases: a Seed-OSS model has them; a "
                                                      "model without them is a Llama"),
                        Const("attention_out_bias", False, "a bias on the attention's output projection: "
                                                           "megatron-core biases either every linear layer or only QKV"),
                        Const("mlp_bias", False, "MLP biases without the attention's output bias"),
                        Const("residual_dropout", 0.0, accept=anything),
                        Const("pretraining_tp", 1, accept=anything), kv=kv_heads_unless_null(8)),
)
