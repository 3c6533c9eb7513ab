"""Qwen2 / Qwen2.5: Llama's layers with biases on Q, K and V only (megatron-core's add_qkv_bias)."""
from ckpt_tools.model.families import Const, Family, heads_dim, llama

SLIDING = "sliding-window attention layers: megatron-core's GPTModel attends to every earlier position"


def full_attention(v) -> bool:
    return isinstance(v, list) and all(t == "full_attention" for t in v)


FAMILY = Family(
    name="qwen2", model_type="qwen2", hf_class="Qwen2ForCausalLM",
    features={"add_qkv_bias": (True,)}, names=llama.NAMES,
    config=llama.config(1e-6, heads_dim, 32768,
                        Const("use_sliding_window", False, SLIDING),
                        Const("layer_types", None, SLIDING, accept=full_attention)),
)
