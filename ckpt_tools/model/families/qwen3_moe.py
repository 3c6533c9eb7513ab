"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with a mixture-of-experts MLP in every layer. Its router's
`norm_topk_prob` false (softmax over all experts, top-k weights used as they are) is megatron-core's
moe_router_pre_softmax; true is Mixtral's renormalised top-k. Layers with a dense MLP (`mlp_only_layers`,
`decoder_sparse_step` > 1) are refused: megatron-core builds one kind of MLP for every layer of a GPTModel here."""
from ckpt_tools.model.families import Const, Family, Field, heads_dim, llama
from ckpt_tools.model.families.mixtral import TRAINING_ONLY, moe_names
from ckpt_tools.model.families.qwen2 import SLIDING, full_attention

_H = "model.layers.{i}.mlp."
FAMILY = Family(
    name="qwen3_moe", model_type="qwen3_moe", hf_class="Qwen3MoeForCausalLM", moe=True,
    features={"qk_layernorm": (True,)},
    names=moe_names(_H + "gate.weight", _H + "experts.{e}.gate_proj.weight", _H + "experts.{e}.up_proj.weight",
                    _H + "experts.{e}.down_proj.weight"),
    config=llama.config(1e-6, heads_dim, 32768,
                        Field("num_local_experts", "num_moe_experts", lambda c: c.get("num_experts", 128)),
                        Field("num_experts_per_tok", "moe_router_topk", 8),
                        Field("moe_intermediate_size", "moe_ffn_hidden_size", 768),
                        Field("norm_topk_prob", "moe_router_pre_softmax", False, {True: False, False: True}),
                        Const("decoder_sparse_step", 1, "layers with a dense MLP between MoE layers"),
                        Const("mlp_only_layers", [], "layers with a dense MLP", accept=lambda v: v == []),
                        *TRAINING_ONLY,
                        Const("attention_bias", False, "biases on q, k, v and o"),
                        Const("use_sliding_window", False, SLIDING),
                        Const("layer_types", None, SLIDING, accept=full_attention)),
)
