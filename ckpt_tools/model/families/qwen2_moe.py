"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (biases on Q, K and V) with a mixture-of-experts MLP in
every layer that also has a shared expert: a SwiGLU MLP of `shared_expert_intermediate_size` every token goes
through, its output scaled by sigmoid(shared_expert_gate . x) and added to the routed experts' (megatron-core's
SharedExpertMLP with moe_shared_expert_gate). The router is Qwen3-MoE's (`norm_topk_prob` false: megatron-core's
moe_router_pre_softmax). Layers with a dense MLP (`mlp_only_layers`, `decoder_sparse_step` > 1) are refused."""
from ckpt_tools.model.families import GATED, OMIT, SAME, Const, Family, Field, Name, anything, heads_dim, llama
from ckpt_tools.model.families.mixtral import TRAINING_ONLY, moe_names
from ckpt_tools.model.families.qwen2 import SLIDING, full_attention

_L, _H = "decoder.layers.{i}.mlp.shared_experts.", "model.layers.{i}.mlp."


FAMILY = Family(
    name="qwen2_moe", model_type="qwen2_moe", hf_class="Qwen2MoeForCausalLM", moe=True, shared_experts=True,
    features={"add_qkv_bias": (True,), "moe_shared_expert_gate": (True,)},
    names=moe_names(_H + "gate.weight", _H + "experts.{e}.gate_proj.weight", _H + "experts.{e}.up_proj.weight",
                    _H + "experts.{e}.down_proj.weight") + (
        Name(_L + "gate_weight", SAME, (_H + "shared_expert_gate.weight",)),
        Name(_L + "linear_fc1.weight", GATED, (_H + "shared_expert.gate_proj.weight", _H + "shared_expert.up_proj.weight")),
        Name(_L + "linear_fc2.weight", SAME, (_H + "shared_expert.down_proj.weight",)),
    ),
    config=llama.config(1e-6, heads_dim, 32768,
                        Field("num_experts", "num_moe_experts", 60),
                        Field("num_experts_per_tok", "moe_router_topk", 4),
                        Field("moe_intermediate_size", "moe_ffn_hidden_size", 1408),
                        Field("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size", 5632),
                        Field("norm_topk_prob", "moe_router_pre_softmax", False, {True: False, False: True}),
                        Const("qkv_bias", True, "Q, K and V without biases"),
                        Const("decoder_sparse_step", 1, "layers with a dense MLP between MoE layers"),
                        Const("mlp_only_layers", [], "layers with a dense MLP", accept=lambda v: v == []),
                        *TRAINING_ONLY,
                        Const("use_sliding_window", False, SLIDING),
                        Const("max_window_layers", OMIT, accept=anything),
                        Const("layer_types", None, SLIDING, accept=full_attention)),
)
