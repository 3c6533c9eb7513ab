"""Megatron-LM's `args` read: the ModelSpec and layout a checkpoint's argparse.Namespace describes (the first family
whose features the arguments fit, its sizes, the pipeline split), what the toolkit cannot represent refused in one
line. The other way (the args a written checkpoint carries) is ckpt_tools.forms.megatron_args. Each feature's own
argument is read by its record (ckpt_tools.model.features)."""
from __future__ import annotations

from pathlib import Path

from ckpt_tools.errors import ConfigError
from ckpt_tools.model import families, features, hybrid, layout
from ckpt_tools.model.features.base import arg
from ckpt_tools.model.features.positions import GPT_YARN, HYBRID_INTERLEAVED, YARN_ARGS, gpt_yarn
from ckpt_tools.model.spec import ModelSpec

MAMBA_ARGS = ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads")  # both sides' names
MAMBA_DEFAULTS = {"mamba_state_dim": 128, "mamba_head_dim": 64, "mamba_num_groups": 8}  # Megatron-LM's


# Arguments that change the model beyond what the layout table and ModelSpec describe: refused when set.
_REFUSED = {
    "pipeline_model_parallel_layout": "a custom pipeline layout",
    "apply_residual_connection_post_layernorm": "post-layernorm residuals",
    "rotary_seq_len_interpolation_factor": "RoPE position interpolation",
}


LINEAR_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_conv_kernel_dim")  # both sides' names
LINEAR_DEFAULTS = (16, 32, 128, 128, 4)  # megatron-core's


def linear_attention(args) -> list[bool] | None:
    """Which layers are gated DeltaNet layers (GPTModel's --experimental-attention-variant gated_delta_net with
    --linear-attention-freq: an int N makes every N-th layer full attention, a list gives 1 for linear attention per
    layer); None for a model without."""
    variant = arg(args, "experimental_attention_variant", None)
    if variant is None:
        return None
    if variant != "gated_delta_net":
        raise ConfigError(f"experimental_attention_variant={variant!r}: this version reads gated_delta_net only")
    freq, n = arg(args, "linear_attention_freq", None), args.num_layers
    flags = [bool((i + 1) % freq) for i in range(n)] if isinstance(freq, int) and freq >= 1 else freq
    if not isinstance(flags, list) or len(flags) != n or any(f not in (0, 1, True, False) for f in flags):
        raise ConfigError(f"linear_attention_freq {freq!r} does not give {n} layers 1 (gated DeltaNet) or 0 (full "
                          f"attention): the args are damaged; restore them from the source")
    return [bool(f) for f in flags]


def linear_fields(args) -> dict:
    """A gated DeltaNet model's sizes (megatron-core's defaults where unset)."""
    return {k: int(arg(args, k, v)) for k, v in zip(LINEAR_FIELDS, LINEAR_DEFAULTS)}


def attention_fields(args) -> dict:
    """GPTModel's YaRN parameters, the sliding window and the experts' GLU clamp (GPT-OSS) as ModelSpec fields."""
    out: dict = {}
    if gpt_yarn(args):
        out["rope_scaling_factor"] = float(arg(args, "rotary_scaling_factor", 1.0))
        out.update({YARN_ARGS[k][0]: type(YARN_ARGS[k][1])(arg(args, f"yarn_{k}", YARN_ARGS[k][1])) for k in GPT_YARN})
        out.update(rope_mscale=float(arg(args, "mscale", 1.0)), rope_mscale_all_dim=float(arg(args, "mscale_all_dim", 0.0)),
                   rope_truncate=bool(arg(args, "yarn_correction_range_round_to_int", True)))
    window = arg(args, "window_size", None)
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2 or window[1] != 0 or int(window[0]) < 0:
            raise ConfigError(f"window_size {window!r}: this version reads causal windows (W - 1, 0) only")
        out["sliding_window"] = int(window[0]) + 1
        freq = arg(args, "window_attn_skip_freq", None)
        if isinstance(freq, list):  # 1 windowed, 0 full, per layer: an every-N-th-full pattern, or refused
            n = freq.index(0) + 1 if 0 in freq else None
            if n is not None and freq != [0 if (i + 1) % n == 0 else 1 for i in range(len(freq))]:
                raise ConfigError(f"window_attn_skip_freq {freq!r:.80}: this version reads every-N-th-layer-full "
                                  f"patterns only")
            freq = n
        out["window_attn_skip_freq"] = freq
    clamp = arg(args, "activation_func_clamp_value", None)
    out["activation_clamp"] = float(clamp) if clamp is not None else None
    return out


MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")  # both sides' names


def mla_fields(args) -> dict:
    """Multi-latent attention's sizes and rotary embedding ({} without it): megatron-core's MLA defaults to YaRN
    (rope_type None or yarn), which is plain RoPE where rotary_scaling_factor <= 1."""
    if not arg(args, "multi_latent_attention", False):
        return {}
    kind, factor = arg(args, "rope_type", "yarn"), float(arg(args, "rotary_scaling_factor", 1.0))
    if kind not in ("rope", "yarn"):
        raise ConfigError(f"multi-latent attention with rope_type={kind!r}: megatron-core's MLA takes rope or yarn")
    if factor < 1 or (kind == "rope" and factor > 1 and float(arg(args, "mscale_all_dim", 0.0))):
        raise ConfigError(f"multi-latent attention with rope_type={kind!r}, rotary_scaling_factor={factor}: megatron-"
                          f"core scales its frequencies or softmax by YaRN's factors there, which this version does "
                          f"not read")
    out = {k: getattr(args, k, None) for k in MLA_FIELDS}
    if kind == "yarn" and factor > 1:
        out["rope_scaling"] = "yarn"
        out.update({ours: type(default)(arg(args, theirs, default)) for theirs, (ours, default) in YARN_ARGS.items()})
    return out


def spec_from_args(args, vocab_size: int | None, pattern: hybrid.Pattern | None = None) -> ModelSpec:
    """Megatron-LM's arguments -> ModelSpec (of the first family their features fit); anything the
    toolkit cannot represent is a ConfigError. A HybridModel's `pattern` gives the layers and whether they are MoE."""
    refused = [f"{k}={getattr(args, k)!r} ({why})" for k, why in _REFUSED.items()
               if getattr(args, k, None) not in (None, False, 0)]
    supported = f"supported: {', '.join(families.names())} (docs/families.md)"
    if refused:
        raise ConfigError(f"unsupported Megatron-LM arguments: {'; '.join(refused)}: {supported}")
    moe = moe_fields(args, by_pattern=pattern is not None) if pattern is None or pattern.moe else {}
    if pattern is not None and pattern.moe and not moe:
        raise ConfigError(f"hybrid_layer_pattern {pattern.text!r} has MoE layers ('E') but the args set no num_experts: "
                          f"the args are damaged; restore them from the source")
    found = features.from_megatron(args)
    if pattern is not None and found["rotary_interleaved"]:
        raise ConfigError(f"layer pattern {pattern.text!r} with {HYBRID_INTERLEAVED}: no conversion keeps this model; "
                          f"a model for HF trains --rotary-interleaved as a GPTModel (pretrain_gpt.py)")
    single = pattern is not None and pattern.single  # Mamba-2 layers: a hybrid family's
    linear = (pattern is not None and hybrid.GDN in pattern.text) or (pattern is None and linear_attention(args))
    family, misfits = families.for_features(found, moe=bool(moe), hybrid=single, linear=bool(linear))
    named = getattr(args, "hf_family", None)  # written by this toolkit: Mistral's and Phi-3's arguments are Llama's
    if family is not None and named in families.names() and named != family.name:
        candidate = families.get(named)
        if all(v in candidate.allowed(k) for k, v in found.items()):
            family = candidate
    if family is None:
        grouped: dict[str, list[str]] = {}  # families that miss in the same way are named together
        for name, bad in misfits.items():
            grouped.setdefault(", ".join(features.misfits(bad)), []).append(name)
        what = "Mamba-2 layers ('M')" if single else "gated DeltaNet layers ('G')" if linear else None
        raise ConfigError((f"{f'hybrid_layer_pattern {pattern.text!r}' if pattern else 'the model'} has {what}, but "
                           f"its " if what else "") + "Megatron-LM arguments fit no supported architecture: " + "; ".join(
            f"for {', '.join(names)}: {text}" for text, names in grouped.items()) + f" ({supported})")
    if vocab_size is None:
        vocab_size = getattr(args, "vocab_size", None)
    if vocab_size is None:
        raise ConfigError(f"the checkpoint does not record its true vocab size (only padded_vocab_size "
                          f"{getattr(args, 'padded_vocab_size', None)}): pass --vocab-size (the tokenizer's size) "
                          f"so that padding rows are not kept")
    heads = args.num_attention_heads
    eps = getattr(args, "norm_epsilon", None)
    scaling = {"rope_scaling_factor": float(arg(args, "rope_scaling_factor", 8.0))} \
        if found["rope_scaling"] == "llama3" else {}
    mla = mla_fields(args)
    found["rope_scaling"] = mla.pop("rope_scaling", found["rope_scaling"])
    linear = linear_attention(args) if pattern is None else None
    if moe or mla or linear is not None:
        moe["layer_pattern"] = _moe_pattern(args, pattern, bool(mla), bool(moe), linear)
    if linear is not None or (pattern is not None and "G" in pattern.text):
        moe.update(linear_fields(args))
    if pattern is not None and pattern.single:
        moe.update(layer_pattern=pattern.text.replace(hybrid.PIPE, ""), **mamba_fields(args))
    mtp = arg(args, "mtp_num_layers", 0)
    if mtp and pattern is not None:
        raise ConfigError(f"mtp_num_layers={mtp} in a HybridModel (its multi-token prediction layers follow its own "
                          f"pattern): not read by this version; convert a GPTModel checkpoint")
    return ModelSpec(
        architecture=family.name, num_layers=pattern.num_layers if pattern is not None else args.num_layers,
        hidden_size=args.hidden_size, num_attention_heads=heads,
        ffn_hidden_size=arg(args, "ffn_hidden_size", 4 * args.hidden_size), vocab_size=int(vocab_size),
        num_query_groups=args.num_query_groups if arg(args, "group_query_attention", False) else heads,
        kv_channels=arg(args, "kv_channels"), max_position_embeddings=arg(args, "max_position_embeddings", 2048),
        norm_epsilon=float(eps if eps is not None else arg(args, "layernorm_epsilon", 1e-5)),
        rotary_base=float(arg(args, "rotary_base", 10000)), rotary_percent=float(arg(args, "rotary_percent", 1.0)),
        make_vocab_size_divisible_by=arg(args, "make_vocab_size_divisible_by", 128), **found, **scaling, **moe, **mla,
        mtp_num_layers=mtp or None, **attention_fields(args))


def mamba_fields(args) -> dict:
    """A Mamba hybrid's Mamba-2 sizes (Megatron-LM's defaults where unset; its heads d_inner / head dim, d_inner twice
    the hidden size, where mamba_num_heads is unset)."""
    out = {k: int(arg(args, k, v)) for k, v in MAMBA_DEFAULTS.items()}
    heads = arg(args, "mamba_num_heads", None)
    out["mamba_num_heads"] = int(heads) if heads is not None else 2 * args.hidden_size // out["mamba_head_dim"]
    return out


def _moe_pattern(args, pattern: hybrid.Pattern | None, mla: bool, moe: bool, linear: list[bool] | None = None) -> str:
    """The layer pattern (ModelSpec.layer_pattern) of a GPTModel's moe_layer_freq (an int N: every N-th layer from
    the first is MoE; a list: 1 for MoE) and gated DeltaNet layers (`linear`), or of a HybridModel's pattern."""
    n = args.num_layers if pattern is None else pattern.num_layers
    attentions = ["+" if mla else "G" if linear is not None and linear[i] else "*" for i in range(n)]
    if pattern is not None:
        main = pattern.text.replace(hybrid.PIPE, "")
        return "".join(("+" if mla else a) + mlp for a, mlp in zip(main[0::2], main[1::2]))
    if not moe:
        return "".join(a + "-" for a in attentions)
    freq = arg(args, "moe_layer_freq", 1)
    flags = [int(i % freq == 0) for i in range(n)] if isinstance(freq, int) and freq >= 1 else freq
    if not isinstance(flags, list) or len(flags) != n or any(f not in (0, 1) for f in flags):
        raise ConfigError(f"moe_layer_freq {freq!r} does not give {n} layers 0 (dense) or 1 (MoE): the args are "
                          f"damaged; restore them from the source")
    return "".join(a + ("E" if f else "-") for a, f in zip(attentions, flags))


# Megatron-LM MoE arguments whose non-default values change the weights or the routing beyond what the MoE families
# hold: (argument, its harmless values, what it would mean)
_MOE_REFUSED = (
    ("moe_router_score_function", ("softmax", "sigmoid"), "a router score function other than softmax or sigmoid"),
)


def moe_fields(args, by_pattern: bool = False) -> dict:
    """Megatron-LM's MoE arguments -> ModelSpec fields ({} for a dense model); what the families cannot hold is
    refused. Every layer must be an MoE layer (moe_layer_freq 1; a HybridModel's pattern says it instead)."""
    experts = arg(args, "num_experts", None)
    if not experts:
        return {}
    refused = [f"{k}={arg(args, k, None)!r} ({why})" for k, ok, why in _MOE_REFUSED if arg(args, k, ok[0]) not in ok]
    if refused:
        raise ConfigError(f"unsupported Megatron-LM MoE arguments: {'; '.join(refused)}")
    groups = arg(args, "moe_router_num_groups", None)
    grouped = {"moe_router_num_groups": groups, "moe_router_group_topk": arg(args, "moe_router_group_topk", None)} \
        if groups not in (None, 0, 1) else {}
    scaling = arg(args, "moe_router_topk_scaling_factor", None)
    return {"num_moe_experts": int(experts), "moe_router_topk": int(arg(args, "moe_router_topk", 2)),
            "moe_ffn_hidden_size": arg(args, "moe_ffn_hidden_size", None),
            "moe_router_pre_softmax": bool(arg(args, "moe_router_pre_softmax", False)),
            "moe_shared_expert_intermediate_size": arg(args, "moe_shared_expert_intermediate_size", None) or None,
            **grouped, **({"moe_router_topk_scaling_factor": float(scaling)} if scaling is not None else {})}


def _layer_counts(args, pp_size: int) -> list[int]:
    """megatron-core's get_num_layers_to_build, for every PP stage."""
    n = args.num_layers
    first, last = (arg(args, "decoder_first_pipeline_num_layers"), arg(args, "decoder_last_pipeline_num_layers"))
    if first is None and last is None:
        emb, loss = (int(bool(arg(args, f"account_for_{w}_in_pipeline_split", False))) for w in ("embedding", "loss"))
        if not emb and not loss:
            return layout.layers_per_stage(n, pp_size)
        if (n + emb + loss) % pp_size:
            raise ConfigError(f"num_layers {n} + {emb + loss} (embedding/loss in the pipeline split) is not "
                              f"divisible by pipeline_model_parallel_size {pp_size}: the args are inconsistent")
        counts = [(n + emb + loss) // pp_size] * pp_size
        counts[0] -= emb
        counts[-1] -= loss
        return layout.layers_per_stage(n, pp_size, counts)
    middle = pp_size - (first is not None) - (last is not None)
    rest = n - (first or 0) - (last or 0)
    if middle > 0 and rest % middle:
        raise ConfigError(f"num_layers {n} minus decoder_first/last_pipeline_num_layers {first}/{last} leaves {rest} "
                          f"layers that do not divide over {middle} middle stages: the args are inconsistent")
    counts = [rest // middle if middle > 0 else 0] * pp_size
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return layout.layers_per_stage(n, pp_size, counts)


def virtual_stages(path: Path, args, counts: list[int]) -> tuple[int, list[int]]:
    """(VPP, layers of each virtual stage in layer order) of an interleaved pipeline (Megatron-LM's
    --num-layers-per-virtual-pipeline-stage): virtual stage s = v * PP + p is model chunk v of PP rank p, holding the
    layers megatron-core's get_transformer_layer_offset gives it. (1, counts) without one. Even splits only."""
    vpp = arg(args, "virtual_pipeline_model_parallel_size", 1) or 1
    if vpp == 1:
        return 1, counts
    n, pp = sum(counts), len(counts)
    if not isinstance(vpp, int) or vpp < 1 or len(set(counts)) != 1 or n % (pp * vpp):
        raise ConfigError(f"{path}: virtual_pipeline_model_parallel_size {vpp!r} with layers per stage {counts}: this "
                          f"version reads interleaved pipelines that split the {n} layers evenly over PP x VPP chunks")
    return vpp, [n // (pp * vpp)] * (pp * vpp)


def expert_parallel(args) -> int:
    """The EP size the arguments describe (a legacy checkpoint has one file per EP rank)."""
    return int(arg(args, "expert_model_parallel_size", 1) or 1) if arg(args, "num_experts", None) else 1


def expert_tensor_parallel(args) -> int:
    """The TP size of the experts (--expert-tensor-parallel-size; megatron-core's default: TP). torch_dist saves the
    experts as global tensors whatever it is; a legacy file holds its rank's expert-TP shard."""
    tp = int(arg(args, "tensor_model_parallel_size", 1) or 1)
    return int(arg(args, "expert_tensor_parallel_size", tp) or tp) if arg(args, "num_experts", None) else tp


def layout_of(path: Path, args, vocab_size: int | None) -> tuple[ModelSpec, int, int, list[int]]:
    """(spec, TP, PP, layers per stage) the arguments describe; what cannot be represented is refused."""
    try:
        tp, pp = arg(args, "tensor_model_parallel_size", 1), arg(args, "pipeline_model_parallel_size", 1)
        pattern = hybrid.pattern_of(args)
        spec = spec_from_args(args, vocab_size, pattern)
        spec.check_tp(tp)
        if pattern is not None:
            first, last = arg(args, "decoder_first_pipeline_num_layers"), arg(args, "decoder_last_pipeline_num_layers")
            return spec, tp, pp, pattern.stage_counts(pp, first, last)
        return spec, tp, pp, _layer_counts(args, pp)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except (AttributeError, TypeError, ValueError, KeyError, ZeroDivisionError) as e:
        raise ConfigError(f"{path}: Megatron-LM's args are incomplete or malformed ({type(e).__name__}: "
                          f"{str(e)[:120]}): the file is damaged or not written by Megatron-LM's training loop; "
                          f"restore it from the source") from None
