"""The positions' features: the position embedding (RoPE, learned, none), RoPE's scaling (Llama 3.1's llama3,
YaRN: GPTModel's own for GPT-OSS, multi-latent attention's for DeepSeek-V3) and its pairs (ERNIE 4.5's interleaved
RoPE)."""
from __future__ import annotations

from ckpt_tools.model.features.base import Feature, arg

# YaRN's arguments (MLATransformerConfig's names) -> ModelSpec's, with megatron-core's defaults
YARN_ARGS = {"rotary_scaling_factor": ("rope_scaling_factor", 1.0),
             "original_max_position_embeddings": ("rope_original_max_position_embeddings", 4096),
             "beta_fast": ("rope_beta_fast", 32.0), "beta_slow": ("rope_beta_slow", 1.0),
             "mscale": ("rope_mscale", 1.0), "mscale_all_dim": ("rope_mscale_all_dim", 0.0)}
GPT_YARN = ("original_max_position_embeddings", "beta_fast", "beta_slow")  # GPTModel's YaRN: `yarn_` + these
# megatron-core's MLA YaRN takes its original context and betas from MLATransformerConfig's defaults.
MLA_YARN = {"rope_original_max_position_embeddings": 4096, "rope_beta_fast": 32.0, "rope_beta_slow": 1.0}
# Megatron-LM's --rope-scaling applies megatron-core's fixed llama3 frequency bounds.
MCORE_LLAMA3 = {"rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
                "rope_original_max_position_embeddings": 8192}


def gpt_yarn(args) -> bool:
    """GPTModel's own YaRN rotary embedding (--position-embedding-type yarn; MLA has its own)."""
    return arg(args, "position_embedding_type", None) == "yarn" and not arg(args, "multi_latent_attention", False)


def _spec_gpt_yarn(spec) -> bool:
    return spec.rope_scaling == "yarn" and not spec.multi_latent_attention


POSITIONS = Feature(
    "position_embedding_type", ("rope",), "position_embedding_type",
    read=lambda args: "rope" if gpt_yarn(args) else arg(args, "position_embedding_type", "learned_absolute"),
    # add_position_embedding: Megatron-LM's default (its parser's, and its Llama 3 example's): megatron-core's GPTModel
    # goes by position_embedding_type; check_checkpoint_args compares this flag with the run's
    write=lambda spec: {"position_embedding_type": "yarn" if _spec_gpt_yarn(spec) else spec.position_embedding_type,
                        "add_position_embedding": True,
                        "use_rotary_position_embeddings": spec.position_embedding_type == "rope"})


def _scaling_args(spec) -> dict:
    out = {"use_rope_scaling": spec.rope_scaling == "llama3", "rope_scaling_factor": spec.rope_scaling_factor}
    if spec.rope_scaling == "yarn":
        out.update({theirs: getattr(spec, ours) for theirs, (ours, _) in YARN_ARGS.items()})
    else:
        out.update(rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    if _spec_gpt_yarn(spec):
        out.update({f"yarn_{k}": getattr(spec, YARN_ARGS[k][0]) for k in GPT_YARN})
        out["yarn_correction_range_round_to_int"] = spec.rope_truncate
    return out


def _scaling_flags(spec) -> str:
    """GPTModel's YaRN parameters, which --use-checkpoint-args does not restore (MLA's: the MLA feature's flags)."""
    if not _spec_gpt_yarn(spec):
        return ""
    return (f" --rotary-scaling-factor {spec.rope_scaling_factor:g} --yarn-original-max-position-embeddings "
            f"{spec.rope_original_max_position_embeddings} --yarn-beta-fast {spec.rope_beta_fast:g} "
            f"--yarn-beta-slow {spec.rope_beta_slow:g} --mscale {spec.rope_mscale:g} --mscale-all-dim "
            f"{spec.rope_mscale_all_dim:g} --" + ("" if spec.rope_truncate else "no-")
            + "yarn-correction-range-round-to-int")


def _scaling_refused(spec) -> str | None:
    """YaRN parameters megatron-core's MLA takes from its defaults, or llama3 bounds other than megatron-core's."""
    if spec.rope_scaling == "yarn" and spec.multi_latent_attention:
        odd = [f"{k} {getattr(spec, k)} (Megatron-LM: {v})" for k, v in MLA_YARN.items() if getattr(spec, k) != v]
        if odd:
            return (f"YaRN with {', '.join(odd)}: megatron-core's MLA takes these from its defaults (no Megatron-LM "
                    f"argument sets them), so the written model would differ; keep the model in our format or HF")
    if spec.rope_scaling == "llama3":
        odd = [f"{k} {getattr(spec, k)} (Megatron-LM: {v})" for k, v in MCORE_LLAMA3.items() if getattr(spec, k) != v]
        if odd:
            return (f"llama3 rope scaling with {', '.join(odd)}: Megatron-LM's --use-rope-scaling fixes these, so the "
                    f"written model would differ; keep the model in our format or HF")
    return None


ROPE_SCALING = Feature(
    "rope_scaling", (None,), "position_embedding_type",
    read=lambda args: "llama3" if arg(args, "use_rope_scaling", False) else "yarn" if gpt_yarn(args) else None,
    shown=lambda v: {"llama3": "rope + use_rope_scaling"}.get(v, v or "rope"),
    write=_scaling_args, flags=_scaling_flags, refuse=_scaling_refused)


# megatron-core's rotary_interleaved: dims 2j and 2j + 1 of each head turn together by frequency j (ERNIE 4.5; the
# default turns dim j with dim j + d/2). The weights are the same either way; only the rotation differs. Megatron-LM's
# --use-checkpoint-args restores it (its checkpointing's _set_arg, force=True): no load flag.
ROTARY_INTERLEAVED = Feature(
    "rotary_interleaved", (False,), "rotary_interleaved",
    read=lambda args: bool(arg(args, "rotary_interleaved", False)),
    write=lambda spec: {"rotary_interleaved": bool(spec.rotary_interleaved)})
# megatron-core's HybridModel (and MambaModel before it: 0.16.1 to 0.19.2, and Megatron-LM's main of 2026-08-22)
# builds its RotaryEmbedding without rotary_interleaved while its attention applies the flag. Refused both ways
# (forms.megatron_spec, verbs.to_megatron).
HYBRID_INTERLEAVED = ("interleaved RoPE (rotary_interleaved) in megatron-core's HybridModel (MambaModel before 0.19), "
                      "which lays its rotary tables out for the two halves of each head while its attention pairs "
                      "dims 2j and 2j + 1: the two dims of a pair turn by different frequencies, not a rotation, "
                      "and no HF model computes it")
