"""Megatron-LM's OWN `save_checkpoint` and `load_checkpoint` around `ckpt reshard --format torch_dist` (optimizer
state included). Needs CUDA (the distributed optimizer) and Megatron-LM's training code (megatron/training, not in
the megatron-core wheel); one GPU:

    git -C <Megatron-LM clone> archive core_v0.16.1 megatron | tar -x -C MLM; pip install six --target SITE
    MLM=... SITE=... torchrun --nproc-per-node 1 tests/megatron_lm_resume.py OUT

megatron-core's model, DistributedDataParallel, DistributedOptimizer and scheduler (tests/mcore_resume.py's
`build`) train 3 steps; Megatron-LM's `save_checkpoint` saves them (its default: torch_dist, dp_reshardable, rng
and rerun state), and the run goes on 3 steps (the reference). `ckpt reshard` rewrites the save at TP2 x PP2;
a new model with other weights and fresh optimizer and scheduler is given it by Megatron-LM's `load_checkpoint`
(args from Megatron-LM's own parser, `--load DST`), and trains the same 3 steps. OUT/resume.json: both curves, the
iteration loaded, the summary line.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(out: str) -> None:
    sys.path.append(os.environ.get("SITE", "/tmp/site"))
    import legacy_megatron_checkpoints as legacy
    out = Path(out).resolve()
    flags = [f for f in legacy.COMMON if f != "--use-legacy-models"] + [
        "--num-layers", "2", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--no-rope-fusion",
        "--swiglu", "--ffn-hidden-size", "96", "--disable-bias-linear", "--group-query-attention",
        "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--bf16", "--use-distributed-optimizer",
        "--lr", "1e-2", "--min-lr", "1e-3", "--weight-decay", "0.1", "--clip-grad", "1.0", "--train-iters", "10",
        "--save", str(out / "src"), "--save-interval", "1", "--ckpt-format", "torch_dist", "--seq-length", "32",
        "--max-position-embeddings", "64", "--vocab-size", "120"]
    for drop in ("--use-cpu-initialization",):
        flags.remove(drop)
    args, _ = legacy._megatron(os.environ.get("MLM", "/tmp/mlm"), flags)
    args.padded_vocab_size = 128
    import torch
    torch.distributed.init_process_group("nccl")
    torch.cuda.set_device(0)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core.rerun_state_machine import initialize_rerun_state_machine
    ps.initialize_model_parallel(1, 1)
    init_num_microbatches_calculator(0, None, args.global_batch_size, args.micro_batch_size, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    initialize_rerun_state_machine()
    import megatron.training.checkpointing as checkpointing
    import megatron.training.global_vars as global_vars
    import mcore_resume as mr

    from ckpt_tools.model.spec import ModelSpec
    from ckpt_tools.verbs.reshard import reshard
    global_vars._GLOBAL_ARGS = args
    checkpointing.on_save_checkpoint_start = lambda *a, **k: None
    mr.keep_torch_adam_step()
    spec = ModelSpec.from_dict(mr.SPEC)
    gpt, ddp, opt, sched = mr.build(spec, 128, 1234)
    before = [mr.step(ddp, opt, sched, i, spec.vocab_size) for i in range(mr.SAVED_AT)]
    args.consumed_train_samples = mr.SAVED_AT * mr.GBS
    checkpointing.save_checkpoint(mr.SAVED_AT, [ddp], opt, sched, 0)
    reference = [mr.step(ddp, opt, sched, i, spec.vocab_size) for i in range(mr.SAVED_AT, mr.SAVED_AT + mr.MORE)]
    line = reshard(out / "src", out / "dst", tp=2, pp=2, vocab_size=spec.vocab_size, quiet=True, form="torch_dist")
    gpt, ddp, opt, sched = mr.build(spec, 128, 999)
    for inner in getattr(opt, "chained_optimizers", [opt]):  # torch's Adam has no state before a step (mcore_resume)
        inner._init_optimizer_states_with_dummy_values()
    args.load, args.consumed_train_samples = str(out / "dst"), 0
    iteration, _ = checkpointing.load_checkpoint([ddp], opt, sched)
    resumed = [mr.step(ddp, opt, sched, i, spec.vocab_size) for i in range(mr.SAVED_AT, mr.SAVED_AT + mr.MORE)]
    result = {"line": line, "iteration": iteration, "consumed_train_samples": args.consumed_train_samples,
              "before": before, "reference": reference, "resumed": resumed}
    (out / "resume.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    from mcore_checkpoints import run_as_script
    run_as_script(main, *sys.argv[1:])
