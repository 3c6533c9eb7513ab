"""What `ckpt import / reshard ... --format torch_dist|torch|fsdp_dtensor` writes beside the tensors, and may: the
target checked (TP divides the heads, groups and FFN; the layer split is one Megatron-LM can express; the form holds
what the model needs) and its args built before anything is written (`check`, `check_optimizer_form`), the summary
lines and the command that loads the output (`loads_with`). The tensors are written by verbs/dist_copy.py (reshard)
and verbs/hf_copy.py (import), through the form's writer (forms/forms.py).
"""
from __future__ import annotations

from pathlib import Path

from ckpt_tools.errors import ConfigError
from ckpt_tools.forms import forms
from ckpt_tools.forms.megatron_args import build_args
from ckpt_tools.forms.megatron_resume import ResumeState
from ckpt_tools.model import features, hybrid, layout
from ckpt_tools.model.features.positions import HYBRID_INTERLEAVED
from ckpt_tools.model.spec import ModelSpec
from ckpt_tools.verbs.request import HYBRID, Layout


def check_optimizer_form(form: str, where: object) -> None:
    """Optimizer state goes into the forms that hold it, torch_dist and fsdp_dtensor (refused before anything is read
    or written)."""
    if not forms.get(form).optimizer:
        raise ConfigError(f"{where}: holds optimizer state, which this version writes in Megatron-LM's torch_dist "
                          f"form (the distributed optimizer's fully_reshardable state) and Megatron-FSDP's "
                          f"fsdp_dtensor only, not in {form}: pass --format torch_dist, or --no-optimizer to write the "
                          f"weights only (Megatron-LM then starts a fresh optimizer)")


def check(spec: ModelSpec, target: Layout, dtype: str, resume: ResumeState | None = None, where: object = None):
    """The args of the target (raises ConfigError for a target Megatron-LM cannot express). EP > 1: the legacy
    form's dirs per EP rank (args.expert_model_parallel_size, which its writers read). A hybrid `model`: a
    HybridModel's args (its pattern: the table's layers as attention + MLP pairs, a '|' segment per stage). VPP
    > 1: an interleaved pipeline (`counts`: its virtual stages; args.virtual_pipeline_model_parallel_size, which
    the writers read)."""
    form, tp, counts, padded, ep, model, vpp = (target.form, target.tp, target.counts, target.padded, target.ep,
                                                target.model, target.vpp)
    if resume is not None:
        check_optimizer_form(form, where)
    written, pattern = forms.get(form), None
    if spec.hybrid:  # Mamba-2 layers: only a HybridModel holds them
        model = HYBRID
    if model == HYBRID and spec.rotary_interleaved:
        raise ConfigError(f"{where}: {HYBRID_INTERLEAVED}: pass --model gpt (GPTModel builds it as HF does)")
    if model == HYBRID:
        if not written.hybrid:
            raise ConfigError(f"{where}: a HybridModel checkpoint is written in Megatron-LM's {forms.only('hybrid')} "
                              f"form only by this version, not in {form}: pass --format {forms.only('hybrid')}" + (
                                  "" if spec.hybrid else ", or --model gpt to write a GPTModel checkpoint of the same "
                                                         "weights"))
        if spec.mtp_num_layers:
            raise ConfigError(f"{where}: multi-token prediction layers in a HybridModel (its own MTP pattern) are not "
                              f"written by this version: pass --model gpt")
        if vpp > 1:
            raise ConfigError(f"{where}: an interleaved pipeline (--vpp {vpp}) of a HybridModel (its pattern's '|' "
                              f"segments per virtual stage) is not written by this version: drop --vpp, or pass "
                              f"--model gpt")
        pattern = hybrid.Pattern.for_layers(counts, spec.pattern, single=spec.hybrid)
    if (len(counts) > 1 and not written.pipeline) or (spec.mtp_num_layers and not written.mtp):
        raise ConfigError(f"{where}: Megatron-LM's {form} form " + (
            f"at PP {len(counts)} (its layers keyed by their index within a stage)" if len(counts) > 1 else
            "with multi-token prediction layers") + " is not written by this version: pass --pp 1" + (
            "" if len(counts) > 1 else f", or --format {forms.only('mtp')}"))
    if vpp > 1 and spec.mtp_num_layers:
        raise ConfigError(f"{where}: multi-token prediction layers in an interleaved pipeline (--vpp {vpp}) are not "
                          f"written by this version: drop --vpp")
    if spec.mtp_num_layers and len(counts) > 1 and not written.mtp_pipeline:
        raise ConfigError(f"{where}: multi-token prediction layers at PP {len(counts)} in Megatron-LM's {form} form (its "
                          f"last stage keeps an embedding copy of its own): not written by this version; pass --format "
                          f"{forms.only('mtp_pipeline')}, or --pp 1")
    if spec.is_moe and spec.add_bias_linear and tp > 1 and not written.split_biased_experts:
        only = forms.only("split_biased_experts")
        raise ConfigError(f"{where}: biased experts at TP {tp} in Megatron-LM's {form} form: megatron-core keeps them "
                          f"whole (expert_tensor_parallel_size 1), which this version writes in {only} only; pass "
                          f"--format {only}, or --tp 1")
    args = build_args(spec, tp, counts, padded, dtype, form, ep=layout.check_ep(spec, ep), pattern=pattern, vpp=vpp)
    if (spec.linear_num_key_heads is not None or spec.zero_centered_norm) and not written.te_modules:
        only = forms.only("te_modules")
        raise ConfigError(f"{where}: {spec.architecture}'s gated DeltaNet layers and zero-centred norms are Transformer "
                          f"Engine modules in megatron-core, written in Megatron-LM's {only} form only by this "
                          f"version, not in {form}: pass --format {only}")
    if resume is not None:
        args.iteration, args.consumed_train_samples = resume.iteration, resume.consumed_samples
        args.no_save_optim, args.use_distributed_optimizer = False, True
    return args


def loads_with(out: Path, target: Layout, resume: bool = False, spec: ModelSpec | None = None) -> str:
    """The Megatron-LM command-line flags that load the written checkpoint (with the flags of what
    `--use-checkpoint-args` does not restore: MLA's rotary type, YaRN's parameters, GPT-OSS's features)."""
    form, vpp = target.form, target.vpp
    where = f"--load {out} --ckpt-format {form} --use-checkpoint-args"
    layers = spec.num_layers // target.pp if spec is not None else None
    if spec is not None:
        where += features.load_flags(spec) + _not_restored(spec)
    if resume:
        where += " --use-distributed-optimizer"
    where += forms.get(form).load_flags(target, resume)
    if vpp > 1:
        where += f" --num-layers-per-virtual-pipeline-stage {layers}"
    return where


def _not_restored(spec: ModelSpec) -> str:
    """The flags of the sliding window and of biased experts, which --use-checkpoint-args does not restore (the
    features' own: `features.load_flags`)."""
    flags = ""
    if spec.sliding_window is not None:
        flags += f" --window-size {spec.sliding_window - 1},0"
        flags += f" --window-attn-skip-freq {spec.window_attn_skip_freq}" if spec.window_attn_skip_freq else ""
    if spec.is_moe and spec.add_bias_linear:
        flags += " --expert-tensor-parallel-size 1"
    return flags


MASTERS_NOT_WRITTEN = ("\nnote: the fresh optimizer's fp32 masters that carried more than the weights are not written: "
                       "Megatron-LM starts its optimizer from the weights")


def resharded(meta, out: Path, target: Layout, resume: ResumeState | None, fresh: bool, unread: str | None,
              nbytes: int, seconds: float) -> str:
    """The one-line summary of a reshard into Megatron-LM's forms (`meta`: the source's)."""
    what = (f"iteration {resume.iteration}, model + optimizer (fp32 masters and Adam moments, step "
            f"{resume.step:g}; {resume.note})" if resume else "weights only (release)")
    if fresh:
        what += " (its optimizer state is the fresh one of iteration 0: Megatron-LM starts it afresh)"
    elif unread:
        what += f" (NOT carried: its {unread}, not read by this version)"
    return (f"resharded {meta.dir} {meta.grid} -> {out} Megatron-LM {target.form} {target.describe()} "
            f"(layers {target.counts}), {what}, {nbytes / 2**20:,.1f} MiB, {seconds:.1f}s; load with "
            f"{loads_with(out, target, resume is not None, meta.spec)}")


def imported(hf_dir: Path, spec: ModelSpec, out: Path, target: Layout, dtype: str, nbytes: int, seconds: float) -> str:
    """The one-line summary of an import into Megatron-LM's forms."""
    return (f"imported {hf_dir} ({spec.architecture}, {spec.num_layers} layers) -> {out} Megatron-LM {target.form} "
            f"{target.describe()} (layers {target.counts}), {dtype}, weights only (release), padded vocab "
            f"{target.padded}, {nbytes / 2**20:,.1f} MiB, {seconds:.1f}s; load with "
            f"{loads_with(out, target, spec=spec)}")
