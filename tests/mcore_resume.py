"""megatron-core resumes training from the torch_dist checkpoints `ckpt reshard --format torch_dist` writes with
optimizer state. Needs CUDA (megatron-core's DistributedOptimizer allocates on "cuda"); one GPU:

    torchrun --nproc-per-node 1 tests/mcore_resume.py OUT [OURS]
    MCORE_RESUME_TP=T MCORE_RESUME_PP=P torchrun --nproc-per-node N tests/mcore_resume.py OUT
                                            # N GPUs: TP T x PP P x DP N/(T x P) (A only)
    MCORE_RESUME_MODEL=hybrid torchrun --nproc-per-node 1 tests/mcore_resume.py OUT     # megatron-core >= 0.19
    MCORE_RESUME_PP=2 MCORE_RESUME_VPP=2 torchrun --nproc-per-node 4 tests/mcore_resume.py OUT   # interleaved

With MCORE_RESUME_VPP=V (PP > 1, 4 layers), A is an interleaved pipeline as Megatron-LM's get_model builds it: each PP
rank's V model chunks (`vp_stage`), each in its own DistributedDataParallel (bucketing off for chunks after the first,
as Megatron-LM's `disable_bucketing=(model_chunk_idx > 0)`), one distributed optimizer over them (a grad buffer per
chunk: `gbuf_idx_<v>`), megatron-core's interleaved 1F1B schedule, saved with `model0`, `model1`, ... beside the
optimizer, in the legacy form too (each rank file's `model<v>`, its distrib_optim.pt a grad buffer per chunk).

With MCORE_RESUME_MODEL=hybrid, A is run with megatron-core 0.19's HybridModel (pattern `*-*-`, its local modules as
tests/mcore_newest.py builds them) instead of GPTModel: its dp_reshardable and fully_reshardable saves, resharded by
`ckpt` (the class kept), resume on the same curve; B and C are GPTModel's and are skipped.

On N GPUs (A only) the run is TP x DP, each data-parallel rank two sequences of the global batch: the
distributed optimizer's dp_reshardable buckets are sharded over DP, as real multi-GPU runs save them; `ckpt`
reshards to another TP x PP on disk and megatron-core loads it back at the run's layout.

A. megatron-core's own run: a tiny Llama (bf16 weights, fp32 masters, grads reduced in fp32) in megatron-core's
   DistributedDataParallel with its DistributedOptimizer and OptimizerParamScheduler trains 3 steps and is saved as
   Megatron-LM saves it by default (torch_dist, dp_reshardable), and again as megatron-core's canonical
   `fully_reshardable` (REF_SRC); it goes on 3 more steps (the reference loss curve).
   `ckpt reshard SRC DST --tp 2 --pp 2 --format torch_dist` writes DST. A new model of other weights, with a fresh
   optimizer and scheduler, loads DST the way Megatron-LM's load_checkpoint does (content metadata from the
   checkpoint, `sharded_state_dict(is_loading=True)`, `dist_checkpointing.load`, then the model's, optimizer's and
   scheduler's `load_state_dict`), is saved again as `fully_reshardable` (REF_DST) and trains the same 3 steps.
   The same for megatron-core's own fully_reshardable save (REF_SRC); and, the control, DST's weights with a
   fresh optimizer.
B. (with OURS, a save dir of our trainer, TP x PP any) `ckpt reshard OURS --format torch_dist` and megatron-core
   loads it the same way (scheduler overridden: the trainer's schedule is its own), saved again as REF_OURS.

C. An HF Llama made by transformers, `ckpt import --format torch_dist` (weights only, TP2 x PP2), loaded by
   megatron-core at TP1: its loss on the same tokens is transformers' (fp32), and training goes on from there.

Rank 0 writes OUT/resume.json: the four loss curves and, for every tensor of REF_SRC / REF_DST (and REF_OURS
against the trainer's own optimizer file, TP1 x PP1, read with torch.load), whether it is bit-identical, read with
torch's own DCP reader (`dcp_to_torch_save`), never ours.
"""
from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

VPP = int(os.environ.get("MCORE_RESUME_VPP", "1"))  # model chunks per PP rank (an interleaved pipeline)
SPEC = {"architecture": "llama", "num_layers": 4 if VPP > 1 else 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
        "ffn_hidden_size": 96, "vocab_size": 120, "max_position_embeddings": 64, "norm_epsilon": 1e-6}
LR, MIN_LR, WD, SEQ = 1e-2, 1e-3, 0.1, 32
TP = int(os.environ.get("MCORE_RESUME_TP", "1"))  # the run's TP and PP; DP = the processes / (TP x PP), a GPU each
PP = int(os.environ.get("MCORE_RESUME_PP", "1"))
DP = int(os.environ.get("WORLD_SIZE", "1")) // (TP * PP)
GBS = 2 * DP  # each data-parallel rank two sequences a step
SAVED_AT, MORE = 3, 3
FULL = {"distrib_optim_sharding_type": "fully_reshardable", "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True}
DP_RESHARDABLE = {**FULL, "distrib_optim_sharding_type": "dp_reshardable"}
KIND = os.environ.get("MCORE_RESUME_MODEL", "gpt")  # gpt | hybrid
PATTERN = "*-*-"


def keep_torch_adam_step() -> None:
    """Two faults of megatron-core 0.16.1 with torch's Adam (no Transformer Engine or Apex, as on this GPU image),
    which hit its own checkpoints as much as ours: loading `fully_reshardable` state it copies every entry of a
    parameter's state, torch's per-parameter 'step' included, which that form never holds (a KeyError); and
    load_state_dict puts ONE step tensor (from the param groups) into every parameter's state, which torch's Adam
    then increments once per parameter per step (wrong bias correction from the first step on). Give each
    parameter its own copy of the loaded step and keep it."""
    from megatron.core.optimizer import distrib_optimizer as mdo
    if mdo.HAVE_APEX_OR_TE:
        return
    original = mdo.DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        group, order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
        if "step" in state and "step" not in tensors:
            state["step"] = state["step"].clone()
            tensors = {**tensors, "step": state["step"]}
        return original(self, model_param, tensors)
    mdo.DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def build(spec, padded: int, seed: int, override_schedule: bool = False, dtype: str = "bfloat16", lr: float = LR,
          min_lr: float = MIN_LR):
    """megatron-core's GPTModel, DDP, distributed optimizer and schedule. `lr`, `min_lr`: the run's --lr and --min-lr
    (a resumed run passes the checkpoint's: megatron-core 0.19 pairs saved and current param groups by them too)."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from mcore_checkpoints import _perturb
    from mcore_reference_child import _build_model
    torch.manual_seed(seed)
    if KIND == "hybrid":
        from mcore_newest import build as build_newest
        chunks = [build_newest({"kind": "hybrid", "pattern": PATTERN, "model": spec.to_dict(), "tp": 1, "pp": 1},
                               padded)]
    elif VPP > 1:
        from mcore_vpp import _chunks
        chunks = _chunks(spec, padded, torch, seed)
    else:
        chunks = [_build_model({**spec.to_dict(), "padded_vocab_size": padded}, TP, PP)]
    bf16 = dtype == "bfloat16"
    ddps = []
    for v, gpt in enumerate(chunks):
        _perturb(gpt, torch)
        gpt = chunks[v] = gpt.cuda().to(getattr(torch, dtype))
        gpt.config.bf16, gpt.config.params_dtype = bf16, getattr(torch, dtype)
        gpt.config.pipeline_dtype = getattr(torch, dtype)  # what the stages send each other
        ddps.append(DistributedDataParallel(gpt.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=True), gpt, disable_bucketing=v > 0))
    config = OptimizerConfig(optimizer="adam", lr=lr, min_lr=min_lr, weight_decay=WD, bf16=bf16,
                             params_dtype=getattr(torch, dtype), use_distributed_optimizer=True, clip_grad=1.0)
    opt = get_megatron_optimizer(config, ddps, config_overrides=get_standard_config_overrides(config))
    gpt, ddp = (chunks, ddps) if VPP > 1 else (chunks[0], ddps[0])
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=lr, min_lr=min_lr, lr_warmup_steps=2 * GBS,
                                    lr_decay_steps=10 * GBS, lr_decay_style="cosine", start_wd=WD, end_wd=WD,
                                    wd_incr_steps=10 * GBS, wd_incr_style="constant",
                                    use_checkpoint_opt_param_scheduler=False,
                                    override_opt_param_scheduler=override_schedule)
    return gpt, ddp, opt, sched


def step(ddp, opt, sched, i: int, vocab: int) -> float:
    """One step on the global batch, each data-parallel rank its own rows (megatron-core's DDP averages the
    gradients over DP); the loss is the global batch's mean."""
    import torch
    from megatron.core import parallel_state as ps
    tokens = torch.randint(0, vocab, (GBS, SEQ), generator=torch.Generator().manual_seed(100 + i)).cuda()
    tokens = tokens.chunk(DP)[ps.get_data_parallel_rank()]
    positions = torch.arange(SEQ).cuda().unsqueeze(0).expand(tokens.shape[0], -1)
    for chunk in ddp if VPP > 1 else [ddp]:
        chunk.zero_grad_buffer()
    opt.zero_grad()
    if PP > 1:
        return _pipelined_step(ddp, opt, sched, tokens)
    loss = ddp(tokens, positions, None, labels=tokens).float().mean()
    loss.backward()
    ddp.finish_grad_sync()
    opt.step()
    sched.step(increment=GBS)
    mean = loss.detach().clone()
    torch.distributed.all_reduce(mean, group=ps.get_data_parallel_group())
    return (mean / DP).item()


def _pipelined_step(ddp, opt, sched, tokens) -> float:
    """The step through megatron-core's own pipeline schedule (1F1B), a micro-batch per sequence; the loss is
    averaged over the last stage's ranks."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data, model):
        t = next(data)
        out = model(t, torch.arange(SEQ).cuda().unsqueeze(0), None, labels=t)
        return out, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})
    chunks = ddp if VPP > 1 else [ddp]
    data = [iter(tokens.split(1)) for _ in chunks] if VPP > 1 else iter(tokens.split(1))  # one per model chunk
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data, model=chunks,
        num_microbatches=tokens.shape[0], seq_length=SEQ, micro_batch_size=1, forward_only=False)
    for chunk in chunks:
        chunk.finish_grad_sync()
    opt.step()
    sched.step(increment=GBS)
    total = torch.tensor(sum(x["loss"].item() for x in losses) / len(losses) if losses else 0.0).cuda()
    torch.distributed.all_reduce(total)
    return (total / (TP * DP)).item()


def models(gpt) -> dict:
    """The model's sharded state dict, under `model` (`model0`, `model1`, ... with virtual pipeline stages)."""
    return {f"model{v}": c.sharded_state_dict() for v, c in enumerate(gpt)} if VPP > 1 else \
        {"model": gpt.sharded_state_dict()}


def sharded(gpt, opt, metadata: dict, loading: bool) -> dict:
    """The model's and the optimizer's sharded state dicts."""
    model = models(gpt)
    return {**model, "optimizer": opt.sharded_state_dict(model if VPP > 1 else model["model"], is_loading=loading,
                                                          metadata=metadata)}


def load(gpt, opt, sched, iter_dir: Path, with_optimizer: bool = True) -> int:
    """As Megatron-LM's load_checkpoint: the content metadata picks the optimizer's keys."""
    from megatron.core import dist_checkpointing
    metadata = dist_checkpointing.load_content_metadata(str(iter_dir))
    if with_optimizer:  # torch's Adam (no Transformer Engine or Apex here) has no state before its first step:
        for inner in getattr(opt, "chained_optimizers", [opt]):  # megatron-core's own placeholder for loading
            inner._init_optimizer_states_with_dummy_values()
    request = sharded(gpt, opt, metadata, True) if with_optimizer else models(gpt)
    state = dist_checkpointing.load(request, str(iter_dir))
    for v, chunk in enumerate(gpt if VPP > 1 else [gpt]):
        chunk.load_state_dict(state[f"model{v}" if VPP > 1 else "model"], strict=True)
    if with_optimizer:
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["opt_param_scheduler"])
    return state["iteration"]


def full_tensors(iter_dir: Path, scratch: Path) -> dict:
    """Every tensor of a torch_dist checkpoint, whole, by torch's own DCP reader."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(str(iter_dir), str(scratch))
    return {k: v for k, v in torch.load(scratch, weights_only=False).items() if torch.is_tensor(v)}


def compare(a: dict, b: dict, prefix: str = "") -> dict:
    import torch
    keys = sorted(k for k in a if k.startswith(prefix))
    missing = [k for k in keys if k not in b]
    differ = [k for k in keys if k in b and not (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]))]
    return {"compared": len(keys), "missing": missing, "differ": differ}


def run_megatron_source(out: Path, result: dict) -> None:
    import torch
    from megatron.core import dist_checkpointing
    from mcore_checkpoints import _args

    from ckpt_tools.model.spec import ModelSpec
    from ckpt_tools.verbs.reshard import reshard
    spec = ModelSpec.from_dict(SPEC)
    padded = spec.padded_vocab_size(TP)
    gpt, ddp, opt, sched = build(spec, padded, 1234)
    losses = [step(ddp, opt, sched, i, spec.vocab_size) for i in range(SAVED_AT)]
    args = _args(spec, TP, PP, padded, SAVED_AT, "bfloat16")
    args.data_parallel_size = DP
    args.use_distributed_optimizer, args.accumulate_allreduce_grads_in_fp32 = True, True
    if VPP > 1:
        args.virtual_pipeline_model_parallel_size = VPP
        args.num_layers_per_virtual_pipeline_stage = spec.num_layers // (PP * VPP)
    if KIND == "hybrid":  # what pretrain_hybrid.py's args record
        vars(args).update(hybrid_layer_pattern=PATTERN, num_layers=len(PATTERN), is_hybrid_model=True)
    common = {"args": args, "iteration": SAVED_AT, "checkpoint_version": 3.0,
              "opt_param_scheduler": sched.state_dict()}
    name = f"iter_{SAVED_AT:07d}"
    lead = torch.distributed.get_rank() == 0
    for where, metadata in (("src", DP_RESHARDABLE), ("ref_src", FULL)):
        if lead:
            (out / where / name).mkdir(parents=True)
        torch.distributed.barrier()
        dist_checkpointing.save({**common, **sharded(gpt, opt, metadata, False)}, str(out / where / name),
                                content_metadata=metadata)
        if lead:
            (out / where / "latest_checkpointed_iteration.txt").write_text(str(SAVED_AT))
    if DP > 1:  # the legacy form too: model_optim_rng.pt and distrib_optim.pt per TP x PP rank (DP 0)
        save_legacy(out / "src_legacy", gpt, opt, common, name)
    reference = [step(ddp, opt, sched, i, spec.vocab_size) for i in range(SAVED_AT, SAVED_AT + MORE)]
    written = torch.ones(1).cuda()
    if lead:  # another layout on disk (TP2 x PP2; TP1 x PP2 from TP2, TP2 x PP1 from PP2); loaded at this run's
        try:
            result["line"] = reshard(out / "src", out / "dst", tp=1 if TP > 1 else 2, pp=1 if PP > 1 else 2,
                                     vocab_size=spec.vocab_size, quiet=True, form="torch_dist")
        except Exception as e:  # noqa: BLE001 - said in resume.json; the saves are kept
            result["reshard_error"], written[0] = f"{type(e).__name__}: {e}", 0
    torch.distributed.broadcast(written, 0)
    if not written.item():
        result.update(losses_before=losses, reference=reference)
        return
    dst = out / "dst" / name
    gpt, ddp, opt, sched = build(spec, padded, 999)
    result["iteration"] = load(gpt, opt, sched, dst)
    if KIND == "hybrid":  # the class kept: the pattern megatron-core reads back from what ckpt wrote
        result["dst_pattern"] = dist_checkpointing.load_common_state_dict(str(dst))["args"].hybrid_layer_pattern
    if lead:
        (out / "ref_dst" / name).mkdir(parents=True)
    torch.distributed.barrier()
    dist_checkpointing.save(sharded(gpt, opt, FULL, False), str(out / "ref_dst" / name), content_metadata=FULL)
    resumed = [step(ddp, opt, sched, i, spec.vocab_size) for i in range(SAVED_AT, SAVED_AT + MORE)]
    gpt, ddp, opt, sched = build(spec, padded, 999)  # megatron-core's own fully_reshardable save, loaded alike
    load(gpt, opt, sched, out / "ref_src" / name)
    own = [step(ddp, opt, sched, i, spec.vocab_size) for i in range(SAVED_AT, SAVED_AT + MORE)]
    gpt, ddp, opt, sched = build(spec, padded, 999)
    load(gpt, opt, sched, dst, with_optimizer=False)
    sched.num_steps = 0
    sched.step(increment=SAVED_AT * GBS)
    fresh = [step(ddp, opt, sched, i, spec.vocab_size) for i in range(SAVED_AT, SAVED_AT + MORE)]
    result.update(layout={"tp": TP, "pp": PP, "dp": DP})
    if not lead:
        return
    a = full_tensors(out / "ref_src" / name, out / "a.pt")
    b = full_tensors(out / "ref_dst" / name, out / "b.pt")
    result.update(losses_before=losses, reference=reference, resumed=resumed, resumed_from_megatron_cores_own=own,
                  fresh_optimizer=fresh,
                  optimizer=compare(a, b, "optimizer."), model=compare(a, b, "embedding.") | {
                      "all": compare({k: v for k, v in a.items() if not k.startswith("optimizer.")}, b)})
    torch.cuda.synchronize()


def save_legacy(root: Path, gpt, opt, common: dict, name: str) -> None:
    """What Megatron-LM's save_checkpoint writes with --ckpt-format torch --use-distributed-optimizer: per TP x PP rank
    `mp_rank_TT[_PPP]/model_optim_rng.pt` and `distrib_optim.pt` (megatron-core gathers the state over DP)."""
    import argparse

    import torch
    from megatron.core import parallel_state as ps
    tp, pp = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    rank_dir = root / name / (f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if PP > 1 else ""))
    first = ps.get_data_parallel_rank() == 0
    if first:
        rank_dir.mkdir(parents=True, exist_ok=True)
        args = argparse.Namespace(**{**vars(common["args"]), "ckpt_format": "torch"})
        model = {f"model{v}": c.state_dict_for_save_checkpoint() for v, c in enumerate(gpt)} if VPP > 1 else \
            {"model": gpt.state_dict_for_save_checkpoint()}  # Megatron-LM's chunks model0, model1, ...
        torch.save({**common, "args": args, **model, "optimizer": opt.state_dict(), "rng_state": None},
                   rank_dir / "model_optim_rng.pt")
    torch.distributed.barrier()
    opt.save_parameter_state(str(rank_dir / "distrib_optim.pt"))
    if torch.distributed.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(common["iteration"].__str__())
    torch.distributed.barrier()


def same_as_ours(ours_tp1: Path, got: dict, tied: bool) -> dict:
    """Our TP1 x PP1 optimizer file (torch.load) against the whole tensors of a torch_dist checkpoint (layer l of
    a stacked key is row l)."""
    import torch

    from ckpt_tools.forms.torch_dist_names import stacked_key
    ckpt = next(ours_tp1.glob("checkpoint-*"))
    state = torch.load(ckpt / "optimizer_tp_0_pp_0.bin", weights_only=True)["optimizer"]
    want, have = {}, {}
    for key, fields in state.items():
        if tied and key == "output_layer.weight":
            continue
        fqn, layer = stacked_key(key)
        for field, stored in (("master", "param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            want[f"{stored}.{key}"] = fields[field]
            whole = got.get(f"optimizer.state.{stored}.{fqn}")
            if whole is not None:
                have[f"{stored}.{key}"] = whole if layer is None else whole[layer]
    return compare(want, have) | {"step": float(next(iter(state.values()))["step"])}


def run_ours(ours: Path, out: Path, result: dict) -> None:
    from ckpt_tools.forms.shards import open_checkpoint
    from ckpt_tools.verbs.reshard import reshard
    reader = open_checkpoint(ours)
    spec, padded, iteration = reader.meta.spec, reader.meta.padded_vocab, reader.meta.iteration
    result["ours_line"] = reshard(ours, out / "ours_dst", tp=2, pp=2, quiet=True, form="torch_dist")
    reshard(ours, out / "ours_tp1", tp=1, pp=1, quiet=True)  # its optimizer state whole, as a plain file
    name = f"iter_{iteration:07d}"
    config = reader.meta.raw.get("config") or {}  # the trainer's run: Megatron-LM resumes it with its --lr, --min-lr
    gpt, ddp, opt, sched = build(spec, padded, 999, override_schedule=True, dtype=reader.meta.params_dtype,
                                 lr=float(config.get("lr", LR)), min_lr=float(config.get("min_lr", MIN_LR)))
    result["ours_iteration"] = load(gpt, opt, sched, out / "ours_dst" / name)
    from megatron.core import dist_checkpointing
    (out / "ref_ours" / name).mkdir(parents=True)
    dist_checkpointing.save(sharded(gpt, opt, FULL, False), str(out / "ref_ours" / name), content_metadata=FULL)
    got = full_tensors(out / "ref_ours" / name, out / "c.pt")
    result["ours"] = same_as_ours(out / "ours_tp1", got, spec.tie_word_embeddings)
    reader.close()


def run_imported(out: Path, result: dict) -> None:
    """C. An HF Llama (transformers' own) -> `ckpt import --format torch_dist` -> megatron-core loads it: the loss
    on the same tokens starts where transformers' is (fp32, the padded vocab rows left out as HF has none), then
    training goes on from there."""
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    from ckpt_tools.model import hf
    from ckpt_tools.verbs.importer import import_hf
    config = LlamaConfig(vocab_size=SPEC["vocab_size"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float().eval()
    model.save_pretrained(out / "hf")
    result["imported_line"] = import_hf(out / "hf", out / "imported", tp=2, pp=2, form="torch_dist", quiet=True)
    spec = hf.spec_from_hf(out / "hf" / "config.json")
    gpt, ddp, opt, sched = build(spec, spec.padded_vocab_size(2), 999, dtype="float32")
    load(gpt, opt, sched, out / "imported" / "release", with_optimizer=False)
    tokens = torch.randint(0, spec.vocab_size, (GBS, SEQ), generator=torch.Generator().manual_seed(7)).cuda()
    positions = torch.arange(SEQ).cuda().unsqueeze(0).expand(GBS, -1)

    def next_token_loss(logits) -> float:
        logits = logits[:, :-1, :spec.vocab_size].float()
        return F.cross_entropy(logits.reshape(-1, spec.vocab_size), tokens[:, 1:].reshape(-1)).item()
    with torch.no_grad():
        result["hf_loss"] = next_token_loss(model.cuda()(tokens).logits)
        result["imported_loss"] = next_token_loss(ddp(tokens, positions, None))
    labels = torch.roll(tokens, -1, dims=1)
    curve = []
    for _ in range(3):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = ddp(tokens, positions, None, labels=labels)[:, :-1].float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        opt.step()
        sched.step(increment=GBS)
        curve.append(loss.item())
    result["imported_training"] = curve


def main(out: str, ours: str | None = None) -> None:
    warnings.filterwarnings("ignore")
    import torch
    torch.distributed.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    ps.initialize_model_parallel(TP, PP, virtual_pipeline_model_parallel_size=VPP if VPP > 1 else None)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    keep_torch_adam_step()
    result: dict = {}
    run_megatron_source(Path(out), result)
    alone = torch.distributed.get_world_size() == 1
    if ours and KIND == "gpt" and alone:
        run_ours(Path(ours), Path(out), result)
    if KIND == "gpt" and alone:
        run_imported(Path(out), result)
    if torch.distributed.get_rank() == 0:
        (Path(out) / "resume.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from mcore_checkpoints import run_as_script
    run_as_script(main, *sys.argv[1:])
