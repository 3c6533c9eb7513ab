"""GLM-4 (GLM-4-9B; transformers' `glm`): Llama's layers with biases on Q, K and V (megatron-core's add_qkv_bias,
Qwen2's), HF's fused `gate_up_proj` ([gate; up]: megatron-core's own fc1 layout, Phi-3's), and RoPE on the first
`partial_rotary_factor` (0.5) of each head turning adjacent pairs of dims (megatron-core's rotary_percent, GLM-4.5's,
with rotary_interleaved, ERNIE 4.5's). A family of features others brought: no feature of its own."""
from ckpt_tools.model.families import (SAME, Const, Family, Name, Rope, anything, head_dim_unless_null,
                                       kv_heads_unless_null, llama)

_FC1 = "decoder.layers.{i}.mlp.linear_fc1.weight"
NAMES = tuple(Name(_FC1, SAME, ("model.layers.{i}.mlp.gate_up_proj.weight",)) if n.key == _FC1 else n
              for n in llama.NAMES)


FAMILY = Family(
    name="glm", model_type="glm", hf_class="GlmForCausalLM",
    features={"add_qkv_bias": (True,), "rotary_interleaved": (True,)}, names=NAMES, partial_rotary=True,
    config=llama.config(1.5625e-07, head_dim_unless_null(128), 131072,
                        Const("attention_bias", True, "Q, K and V without biases: a GLM-4 model has them"),
                        Const("pad_token_id", None, accept=anything),  # transformers' 151329 may be past the vocab
                        rope=Rope(10000.0, partial=True, partial_default=0.5), kv=kv_heads_unless_null(2)),
)
