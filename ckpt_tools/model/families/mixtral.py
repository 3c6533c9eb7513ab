"""Mixtral: Mistral's attention with a mixture-of-experts MLP in every layer (megatron-core's MoE layer: a router
and SequentialMLP experts, each a SwiGLU MLP). The router takes the top-k experts of its softmax and renormalises
their weights, which is megatron-core's top-k of the logits followed by a softmax over those k."""
from ckpt_tools.errors import ConfigError
from ckpt_tools.model.families import GATED, SAME, Const, Family, Field, Name, anything, heads_dim, llama

_L, _H = "decoder.layers.{i}.mlp.", "model.layers.{i}.block_sparse_moe."
_E = _L + "experts.local_experts.{e}."


def moe_names(router: str, gate: str, up: str, down: str) -> tuple[Name, ...]:
    """Llama's names with the dense MLP replaced by a router and experts (HF names: `{e}` the expert)."""
    dense = ("mlp.linear_fc1.weight", "mlp.linear_fc2.weight")
    return tuple(n for n in llama.NAMES if not n.key.endswith(dense)) + (
        Name(_L + "router.weight", SAME, (router,)),
        Name(_E + "linear_fc1.weight", GATED, (gate, up)),
        Name(_E + "linear_fc2.weight", SAME, (down,)),
    )


# What transformers' MoE configs hold for training only (routing noise, the auxiliary loss): no weights, no math.
TRAINING_ONLY = (Const("router_aux_loss_coef", 0.001, accept=anything),
                 Const("output_router_logits", False, accept=anything))



def check(spec) -> None:
    """What Mixtral's config cannot say: experts as wide as intermediate_size, a renormalised top-k."""
    if spec.moe_ffn_hidden_size != spec.ffn_hidden_size:
        raise ConfigError(f"moe_ffn_hidden_size {spec.moe_ffn_hidden_size} differs from ffn_hidden_size "
                          f"{spec.ffn_hidden_size}: Mixtral's experts are intermediate_size wide")
    if spec.moe_router_pre_softmax:
        raise ConfigError("moe_router_pre_softmax true is not Mixtral's router, which renormalises the top-k "
                          "weights: set it false")


FAMILY = Family(
    name="mixtral", model_type="mixtral", hf_class="MixtralForCausalLM", moe=True,
    check=check,
    names=moe_names(_H + "gate.weight", _H + "experts.{e}.w1.weight", _H + "experts.{e}.w3.weight",
                    _H + "experts.{e}.w2.weight"),
    config=llama.config(1e-5, heads_dim, 4096 * 32,
                        Field("num_local_experts", "num_moe_experts", 8),
                        Field("num_experts_per_tok", "moe_router_topk", 2),
                        Const("router_jitter_noise", 0.0, accept=anything),
                        *TRAINING_ONLY,
                        Const("sliding_window", None, "sliding-window attention: megatron-core's GPTModel attends "
                                                      "to every earlier position"),
                        theta=1e6),
)
