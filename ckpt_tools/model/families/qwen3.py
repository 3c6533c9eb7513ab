"""Qwen3 (dense): Llama's layers with a per-head RMSNorm on queries and keys (megatron-core's qk_layernorm),
head_dim explicit (128 unless the config says otherwise)."""
from ckpt_tools.model.families import Const, Family, llama
from ckpt_tools.model.families.qwen2 import SLIDING, full_attention

FAMILY = Family(
    name="qwen3", model_type="qwen3", hf_class="Qwen3ForCausalLM",
    features={"qk_layernorm": (True,)}, names=llama.NAMES,
    config=llama.config(1e-6, 128, 32768,
                        Const("attention_bias", False, "biases on q, k, v and o"),
                        Const("use_sliding_window", False, SLIDING),
                        Const("layer_types", None, SLIDING, accept=full_attention)),
)
