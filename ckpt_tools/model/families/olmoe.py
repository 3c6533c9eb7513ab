"""OLMoE: Llama's layers with a mixture-of-experts MLP in every layer and RMSNorms on queries and keys that span
all heads at once (q over heads x head_dim, k over query groups x head_dim), not each head as Qwen3's do. Under
TP each rank holds its heads' slice of those norms (split as the QKV rows are) and the trainer sums the squares
over TP. Its router takes the softmax over all experts and keeps the top-k weights as they are (norm_topk_prob
false: megatron-core's moe_router_pre_softmax). megatron-core's per-head qk_layernorm cannot hold these norms, so
Megatron-LM's forms are refused; ours and HF hold the model."""
from ckpt_tools.errors import ConfigError
from ckpt_tools.model.families import Const, Family, Field, heads_dim, llama
from ckpt_tools.model.families.mixtral import TRAINING_ONLY, moe_names

_H = "model.layers.{i}.mlp."


def check(spec) -> None:
    """What OLMoE's config cannot say: experts of another width than intermediate_size, heads that do not tile the
    hidden size (its q norm is hidden_size wide)."""
    if spec.num_attention_heads * spec.kv_channels != spec.hidden_size:
        raise ConfigError(f"num_attention_heads {spec.num_attention_heads} x kv_channels {spec.kv_channels} != "
                          f"hidden_size {spec.hidden_size}: OLMoE's heads are hidden_size / num_attention_heads wide")
    if spec.moe_ffn_hidden_size != spec.ffn_hidden_size:
        raise ConfigError(f"moe_ffn_hidden_size {spec.moe_ffn_hidden_size} differs from ffn_hidden_size "
                          f"{spec.ffn_hidden_size}: OLMoE's experts are intermediate_size wide")


FAMILY = Family(
    name="olmoe", model_type="olmoe", hf_class="OlmoeForCausalLM", moe=True, check=check,
    features={"qk_layernorm": (True,), "qk_norm_across_heads": (True,)},
    names=moe_names(_H + "gate.weight", _H + "experts.{e}.gate_proj.weight", _H + "experts.{e}.up_proj.weight",
                    _H + "experts.{e}.down_proj.weight"),
    config=llama.config(1e-5, heads_dim, 4096,
                        Field("num_experts", "num_moe_experts", 64),
                        Field("num_experts_per_tok", "moe_router_topk", 8),
                        Field("norm_topk_prob", "moe_router_pre_softmax", False, {True: False, False: True}),
                        *TRAINING_ONLY,
                        Const("attention_bias", False, "biases on q, k, v and o"),
                        Const("clip_qkv", None, "clamping q, k and v: megatron-core's attention does not clamp")),
)
