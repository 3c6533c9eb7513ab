"""DeepSeek-V3 (and the models built like it: Kimi K2, Moonlight): multi-latent attention (MLA) and DeepSeek's MoE.

- Attention: queries through a low-rank latent (`q_a_proj`, its norm, `q_b_proj`; or one `q_proj` where
  `q_lora_rank` is null), keys and values through a shared latent (`kv_a_proj_with_mqa` gives the latent and the
  keys' rotary part, `kv_b_proj` each head's key and value): megatron-core's MLASelfAttention with its q/kv norms
  (`qk_layernorm`). Every tensor copies row for row; transformers' `rope_interleave` (its default) is megatron-core's
  MLA rotary layout.
- MLP: the first `first_k_dense_replace` layers dense (`intermediate_size`), the rest MoE (megatron-core's
  `moe_layer_freq` list): routed experts of `moe_intermediate_size` and a shared expert of `n_shared_experts` times
  it; sigmoid scores, `e_score_correction_bias` steering the choice only (megatron-core's `router.expert_bias`), the
  best `topk_group` of `n_group` groups searched, the chosen weights renormalised and scaled by
  `routed_scaling_factor`.

YaRN rope scaling (its published configs: factor 40, original context 4096, mscale and mscale_all_dim 1) is
megatron-core's YarnRotaryEmbedding and MLA softmax scale, transformers' alike.

Refused in one line: `rope_interleave` false, an `rms_norm_eps` other than 1e-6
(transformers fixes the latent norms' at 1e-6, megatron-core has one epsilon), `norm_topk_prob` false and top-1
routing (megatron-core renormalises a sigmoid top-k of more than one), groups whose score is not the sum of their
best two (megatron-core sums the best topk / topk_group), attention biases.
"""
from ckpt_tools.errors import ConfigError
from ckpt_tools.model.families import (GATED, OMIT, SAME, VOCAB, Const, Derived, Family, Field, Name, anything, llama,
                                       with_mtp)
from ckpt_tools.model.families.mixtral import TRAINING_ONLY

_L, _H = "decoder.layers.{i}.", "model.layers.{i}."
_A, _HA = _L + "self_attention.", _H + "self_attn."
_E, _HE = _L + "mlp.experts.local_experts.{e}.", _H + "mlp.experts.{e}."


def _mlp(key: str, hf: str) -> tuple[Name, ...]:
    return (Name(key + "linear_fc1.weight", GATED, (hf + "gate_proj.weight", hf + "up_proj.weight")),
            Name(key + "linear_fc2.weight", SAME, (hf + "down_proj.weight",)))


DECODER = (
    Name("embedding.word_embeddings.weight", VOCAB, ("model.embed_tokens.weight",)),
    Name(_L + "input_layernorm.weight", SAME, (_H + "input_layernorm.weight",)),
    Name(_A + "linear_proj.weight", SAME, (_HA + "o_proj.weight",)),
    Name(_A + "linear_q_proj.weight", SAME, (_HA + "q_proj.weight",)),
    Name(_A + "linear_q_down_proj.weight", SAME, (_HA + "q_a_proj.weight",)),
    Name(_A + "linear_q_up_proj.weight", SAME, (_HA + "q_b_proj.weight",)),
    Name(_A + "linear_kv_down_proj.weight", SAME, (_HA + "kv_a_proj_with_mqa.weight",)),
    Name(_A + "linear_kv_up_proj.weight", SAME, (_HA + "kv_b_proj.weight",)),
    Name(_A + "q_layernorm.weight", SAME, (_HA + "q_a_layernorm.weight",)),
    Name(_A + "kv_layernorm.weight", SAME, (_HA + "kv_a_layernorm.weight",)),
    Name(_L + "pre_mlp_layernorm.weight", SAME, (_H + "post_attention_layernorm.weight",)),
    *_mlp(_L + "mlp.", _H + "mlp."),
    Name(_L + "mlp.router.weight", SAME, (_H + "mlp.gate.weight",)),
    Name(_L + "mlp.router.expert_bias", SAME, (_H + "mlp.gate.e_score_correction_bias",)),
    *_mlp(_E, _HE),
    *_mlp(_L + "mlp.shared_experts.", _H + "mlp.shared_experts."),
    Name("decoder.final_layernorm.weight", SAME, ("model.norm.weight",)),
    Name("output_layer.weight", VOCAB, ("lm_head.weight",)),
)
# the multi-token prediction layers after the decoder's (DeepSeek-V3's published `model.layers.61.`): each also holds
# a copy of the embedding and of the output head
MTP_NORMS = ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")
MTP_COPIES = (("embedding.word_embeddings.weight", _H + "embed_tokens.weight"),
              ("output_layer.weight", _H + "shared_head.head.weight"))
NAMES = with_mtp(DECODER, _H, MTP_NORMS)


def dense_reader(attention: str, default: int):
    """first_k_dense_replace (transformers' `default` where absent) -> the layer pattern: k dense layers, then MoE
    layers, each pair's attention symbol `attention`."""
    def read(c: dict, out: dict, refuse) -> None:
        n, k = c["num_hidden_layers"], c.get("first_k_dense_replace", default)
        if not isinstance(k, int) or k < 0 or k >= n:
            refuse(f"first_k_dense_replace {k!r} with {n} layers (the layers after the first k are MoE layers: "
                   f"0 <= k < num_hidden_layers)")
        out["layer_pattern"] = (attention + "-") * k + (attention + "E") * (n - k)
    return read


def write_dense(spec) -> int:
    """first_k_dense_replace: the dense layers (ModelSpec refuses them anywhere but first)."""
    return spec.pattern.count("-")


def routing(width: int, groups: int, topk_group: int, scaling: float) -> tuple:
    """The config.json entries of DeepSeek-V3's MoE that transformers derives (its defaults given: the experts'
    width, n_group, topk_group, routed_scaling_factor): the shared expert as n_shared_experts experts, the groups
    (none where n_group is 1), the scaling."""
    def read_shared(c: dict, out: dict, refuse) -> None:
        shared = c.get("n_shared_experts", 1)
        if not isinstance(shared, int) or shared < 1:
            refuse(f"n_shared_experts {shared!r} (its MoE layers without a shared expert)")
        out["moe_shared_expert_intermediate_size"] = shared * c.get("moe_intermediate_size", width)

    def read_groups(c: dict, out: dict, refuse) -> None:
        n, top = c.get("n_group", groups), c.get("topk_group", topk_group)
        if n not in (None, 1):
            out.update(moe_router_num_groups=n, moe_router_group_topk=top)

    def read_scaling(c: dict, out: dict, refuse) -> None:
        out["moe_router_topk_scaling_factor"] = float(c.get("routed_scaling_factor", scaling))

    return (Field("moe_intermediate_size", "moe_ffn_hidden_size", width),
            Derived("n_shared_experts", read_shared, _write_shared),
            Derived("n_group", read_groups, lambda s: s.moe_router_num_groups or 1),
            Derived("topk_group", lambda c, out, refuse: None, lambda s: s.moe_router_group_topk or 1),
            Derived("routed_scaling_factor", read_scaling, lambda s: s.moe_router_topk_scaling_factor or 1.0),
            Const("norm_topk_prob", True, "the top-k weights as they are: megatron-core renormalises a sigmoid "
                                          "top-k"),
            # the multi-token prediction layers (transformers writes 1 and builds none: import keeps those the weights
            # hold, ckpt_tools.verbs.importer)
            Derived("num_nextn_predict_layers", _read_mtp, lambda s: s.mtp_num_layers or 0))


def _read_mtp(c: dict, out: dict, refuse) -> None:
    n = c.get("num_nextn_predict_layers", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        refuse(f"num_nextn_predict_layers {n!r} (a number of layers >= 0)")
    out["mtp_num_layers"] = n or None


def _write_shared(spec) -> int:
    shared, width = spec.moe_shared_expert_intermediate_size, spec.moe_ffn_hidden_size
    if shared % width:
        raise ConfigError(f"moe_shared_expert_intermediate_size {shared} is not a multiple of moe_ffn_hidden_size "
                          f"{width}: DeepSeek-V3's config.json gives the shared expert as n_shared_experts experts")
    return shared // width


def check(spec) -> None:
    if spec.num_query_groups != spec.num_attention_heads:
        raise ConfigError(f"num_key_value_heads {spec.num_query_groups} differs from num_attention_heads "
                          f"{spec.num_attention_heads}: multi-latent attention gives every head its own key and value")
    if spec.norm_epsilon != 1e-6:
        raise ConfigError(f"rms_norm_eps {spec.norm_epsilon} is not 1e-6: transformers' DeepSeek-V3 fixes its latent "
                          f"norms' epsilon at 1e-6 and megatron-core has one epsilon for every norm")
    check_routing(spec)


def check_routing(spec) -> None:
    """What megatron-core's sigmoid router computes as transformers' DeepSeek-V3 / GLM-4.5 router does."""
    if spec.moe_router_topk < 2:
        raise ConfigError(f"num_experts_per_tok {spec.moe_router_topk}: megatron-core renormalises the sigmoid "
                          f"weights of a top-k only for k > 1, transformers always: choose k >= 2")
    if spec.moe_router_pre_softmax:
        raise ConfigError("moe_router_pre_softmax true is not DeepSeek-V3's router (sigmoid scores): set it false")
    if spec.moe_router_num_groups is not None and spec.moe_router_topk != 2 * spec.moe_router_group_topk:
        raise ConfigError(f"num_experts_per_tok {spec.moe_router_topk} with topk_group {spec.moe_router_group_topk}: "
                          f"transformers scores a group by its best 2 experts, megatron-core by its best "
                          f"topk / topk_group: they agree only where num_experts_per_tok = 2 x topk_group")


FAMILY = Family(
    name="deepseek_v3", model_type="deepseek_v3", hf_class="DeepseekV3ForCausalLM", moe=True, shared_experts=True,
    grouped_routing=True, dense_first=True, fp8_blocks=True, mtp_layers=True, mtp_copies=MTP_COPIES,
    features={"multi_latent_attention": (True,), "qk_layernorm": (True,),
              "rope_scaling": (None, "yarn"),
              "moe_router_score_function": ("sigmoid",), "moe_router_enable_expert_bias": (True,)},
    names=NAMES, check=check,
    config=llama.config(
        1e-6, None, 4096,  # head_dim: transformers sets it to qk_rope_head_dim
        Field("q_lora_rank", "q_lora_rank", lambda c: None if "q_lora_rank" in c else 1536),
        Field("kv_lora_rank", "kv_lora_rank", 512),
        Field("qk_nope_head_dim", "qk_head_dim", 128),
        Field("qk_rope_head_dim", "qk_pos_emb_head_dim", 64),
        Field("v_head_dim", "v_head_dim", 128),
        Field("n_routed_experts", "num_moe_experts", 256),
        Field("num_experts_per_tok", "moe_router_topk", 8),
        *routing(2048, 8, 4, 2.5),
        Derived("first_k_dense_replace", dense_reader("+", 3), write_dense),
        Const("rope_interleave", True, "the rotary rows in transformers' non-interleaved order"),
        Const("attention_bias", False, "biases on the attention projections"),
        Const("head_dim", OMIT, accept=anything),
        Const("qk_head_dim", OMIT, accept=anything),
        Const("pretraining_tp", 1, accept=anything),
        *TRAINING_ONLY,
    ),
)
