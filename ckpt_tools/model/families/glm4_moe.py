"""GLM-4.5 / GLM-4.6 (`glm4_moe`): grouped-query attention with biases on Q, K and V (`attention_bias`; o_proj has
none), optional per-head q/k norms (`use_qk_norm`), rotary embeddings on the first `partial_rotary_factor` of each
head (megatron-core's rotary_percent), and DeepSeek-V3's MoE: the first `first_k_dense_replace` layers dense, then
routed experts of `moe_intermediate_size` plus a shared expert, sigmoid routing steered by `e_score_correction_bias`
(megatron-core's expert bias), optionally group-limited, renormalised and scaled by `routed_scaling_factor`.
Refused as DeepSeek-V3's are: `norm_topk_prob` false, top-1 routing, groups whose score is not their best two's sum.
Its multi-token prediction layers (`num_nextn_predict_layers`) are DeepSeek-V3's."""
from ckpt_tools.model.families import Derived, Family, Field, Rope, heads_dim, with_mtp
from ckpt_tools.model.families import deepseek_v3 as ds
from ckpt_tools.model.families import llama
from ckpt_tools.model.families.mixtral import TRAINING_ONLY

_A = ("self_attention.linear_proj.", "self_attention.linear_q", "self_attention.linear_kv", "self_attention.q_",
      "self_attention.kv_")
NAMES = with_mtp(tuple(n for n in ds.DECODER if not n.key.startswith(tuple("decoder.layers.{i}." + a for a in _A)))
                 + tuple(n for n in llama.NAMES if ".self_attention." in n.key), "model.layers.{i}.", ds.MTP_NORMS)
# the attention rows are Llama's (qkv, its biases, q/k norms, o_proj), the MLP rows DeepSeek-V3's; its multi-token
# prediction layers DeepSeek-V3's


def check(spec) -> None:
    ds.check_routing(spec)


FAMILY = Family(
    name="glm4_moe", model_type="glm4_moe", hf_class="Glm4MoeForCausalLM", moe=True, shared_experts=True,
    grouped_routing=True, dense_first=True, fp8_blocks=True, mtp_layers=True, mtp_copies=ds.MTP_COPIES,
    partial_rotary=True,
    features={"add_qkv_bias": (False, True), "qk_layernorm": (False, True),
              "moe_router_score_function": ("sigmoid",), "moe_router_enable_expert_bias": (True,)},
    names=NAMES, check=check,
    config=llama.config(
        1e-5, heads_dim, 131072,
        Field("attention_bias", "add_qkv_bias", False),
        Field("use_qk_norm", "qk_layernorm", False),
        Field("n_routed_experts", "num_moe_experts", 128),
        Field("num_experts_per_tok", "moe_router_topk", 8),
        *ds.routing(1408, 1, 1, 1.0),
        Derived("first_k_dense_replace", ds.dense_reader("*", 1), ds.write_dense),
        *TRAINING_ONLY,
        rope=Rope(10000.0, partial=True, partial_default=0.5),
    ),
)
