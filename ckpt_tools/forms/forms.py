"""Megatron-LM's output forms as records: what each holds and what this version writes in it, its writer, its extra
arguments and the flags that load it. The refusals (request.Request.check, to_megatron.check), the byte paths
(verbs/dist_copy.py, verbs/hf_copy.py: the form's writer), the arguments (megatron_args.build_args) and the load command
(to_megatron.loads_with) ask a form's record instead of testing its name.
A new output form is a record here with its writer, and its name in the command line's choices (cli.FORMS); the
forms read are forms/readers.py's records.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ckpt_tools.forms import megatron_lm


def _no_flags(target, resume: bool) -> str:
    return ""


def _dist_writer(iter_dir, spec, tp, counts, padded, args, resume, **saving):
    from ckpt_tools.forms.megatron_write import DistWriter
    return DistWriter(iter_dir, spec, tp, counts, padded, args, **saving)


def _fsdp_writer(iter_dir, spec, tp, counts, padded, args, resume, **saving):
    from ckpt_tools.forms.fsdp_write import FsdpWriter
    return FsdpWriter(iter_dir, spec, tp, counts, padded, args, resume=resume, **saving)


@dataclass(frozen=True)
class Form:
    """One of Megatron-LM's forms as `ckpt reshard` / `ckpt import --format` write it.

    chunks          its tensors are global chunks (torch.distributed.checkpoint's .distcp files, loaded at any TP x PP),
                    not each rank's shards in a file of its own
    optimizer       optimizer state goes into it (a resumable checkpoint), else weights only
    whole_experts   each expert held once, loaded at any EP (--ep does not apply)
    pipeline        PP > 1 written
    interleaved     an interleaved pipeline (--vpp > 1) written
    hybrid          megatron-core's HybridModel written
    mtp_pipeline    multi-token prediction layers at PP > 1 written (at PP 1: `mtp`)
    split_biased_experts  biased experts at TP > 1 (megatron-core keeps them whole, ETP 1)
    te_modules      Transformer Engine's modules with no local twin (gated DeltaNet, zero-centred norms)
    args            Megatron-LM arguments of its runs, beside the model's (megatron_args.build_args)
    load_flags      the flags its load command adds, of the target Layout and whether it resumes
    writer          a chunks form's (iter_dir, spec, tp, layer counts, padded vocab, args, resume, saving_tp=,
                    saving_ep=) -> the writer of its .distcp files, where `resume` is what a checkpoint with optimizer
                    state holds beside the tensors (torch_dist's goes into common.pt at close) and `saving_tp`,
                    `saving_ep` the TP and EP sizes of the ranks that save the chunks (a reshard's: the source's); None
                    for rank files, which forms/legacy_copy.py writes"""
    name: str
    writer: Callable | None
    chunks: bool = False
    optimizer: bool = False
    whole_experts: bool = False
    pipeline: bool = True
    interleaved: bool = True
    hybrid: bool = False
    mtp: bool = True
    mtp_pipeline: bool = False
    split_biased_experts: bool = False
    te_modules: bool = False
    args: dict = field(default_factory=dict)
    load_flags: Callable = _no_flags


def _legacy_flags(target, resume: bool) -> str:
    """The legacy form loads at the TP x PP (x EP) it was written at, with the local spec's names."""
    flags = (f" --transformer-impl local --tensor-model-parallel-size {target.tp} --pipeline-model-parallel-size "
             f"{target.pp_ranks}")
    return flags + (f" --expert-model-parallel-size {target.ep}" if target.ep > 1 else "")


def _fsdp_flags(target, resume: bool) -> str:
    """No RNG state to load; weights only: no optimizer or scheduler either."""
    return " --use-megatron-fsdp" + ("" if resume else " --no-load-optim") + " --no-load-rng"


TORCH_DIST = Form(megatron_lm.TORCH_DIST, _dist_writer, chunks=True, optimizer=True, whole_experts=True, hybrid=True,
                  mtp_pipeline=True, split_biased_experts=True, te_modules=True)
TORCH = Form(megatron_lm.TORCH, None, load_flags=_legacy_flags)
FSDP_DTENSOR = Form(megatron_lm.FSDP_DTENSOR, _fsdp_writer, chunks=True, optimizer=True, whole_experts=True, pipeline=False,
                    interleaved=False, mtp=False,
                    args={"use_megatron_fsdp": True, "data_parallel_sharding_strategy": "optim_grads_params"},
                    load_flags=_fsdp_flags)

WRITTEN: dict[str, Form] = {f.name: f for f in (TORCH_DIST, TORCH, FSDP_DTENSOR)}  # the --format choices, in order


def get(name: str) -> Form:
    return WRITTEN[name]


def only(capability: str) -> str:
    """The forms written with `capability`, as a message names them ("torch_dist", "torch_dist or torch")."""
    return " or ".join(f.name for f in WRITTEN.values() if getattr(f, capability))
