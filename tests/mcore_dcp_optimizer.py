"""A Megatron-LM `--ckpt-format torch_dcp` checkpoint WITH optimizer state, as a `--use-torch-fsdp2 --bf16` run saves it,
written by megatron-core's own modules after real training steps. Needs CUDA (megatron-core's optimizers allocate on
"cuda"); two GPUs (FSDP2 over two data-parallel ranks):

    torchrun --nproc-per-node 2 tests/mcore_dcp_optimizer.py OUT [fp32]

(`fp32`: an fp32 run instead, megatron-core's FP32Optimizer: no separate masters, Adam's own state dict.)

A tiny Llama (tests/mcore_optimizer_checkpoints.py's) is built by megatron-core, wrapped as Megatron-LM wraps it for
FSDP2 (`Float16Module`, then megatron-core's `TorchFullyShardedDataParallel`), given megatron-core's optimizer
(`get_megatron_optimizer`: Adam with fp32 masters, not the distributed optimizer, which FSDP2 refuses; weight decay
skipped for biases and 1-D params as `get_standard_config_overrides` says), trained STEPS steps on random tokens, and
saved as Megatron-LM's `save_checkpoint` saves torch_dcp (`generate_state_dict`: args, checkpoint_version, iteration,
the unwrapped model's `state_dict_for_save_checkpoint()`, `optimizer.state_dict()`, the scheduler, rng state;
`torch.distributed.checkpoint.save`):

    OUT/torch_dcp/          latest_checkpointed_iteration.txt, iter_NNNNNNN/{.metadata, __<rank>_0.distcp}
    OUT/reference.pt        {model key: {"master", "exp_avg", "exp_avg_sq", "step"}}: megatron-core's own optimizer
                            state of every parameter, gathered from the optimizer object itself
"""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

from mcore_optimizer_checkpoints import SPEC

STEPS, ITERATION = 3, 3


def main(out: str, precision: str = "bf16") -> None:
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides
    from megatron.core.transformer.module import Float16Module
    from mcore_checkpoints import _args, _perturb, save_dcp
    from mcore_reference_child import _build_model

    from ckpt_tools.model.spec import ModelSpec
    ps.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    spec = ModelSpec.from_dict(SPEC)
    padded = spec.padded_vocab_size(1)
    torch.manual_seed(1234)
    gpt = _build_model({**spec.to_dict(), "padded_vocab_size": padded}, 1, 1)
    _perturb(gpt, torch)
    gpt = gpt.cuda()
    config = gpt.config
    bf16 = precision == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    config.bf16, config.params_dtype, config.transformer_impl = bf16, dtype, "local"
    wrapped = TorchFullyShardedDataParallel(config, DistributedDataParallelConfig(),
                                            Float16Module(config, gpt) if bf16 else gpt)
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-2, min_lr=1e-3, weight_decay=0.1, bf16=bf16,
                                 params_dtype=dtype,
                                 use_distributed_optimizer=False, clip_grad=1.0)
    opt = get_megatron_optimizer(opt_config, [wrapped], config_overrides=get_standard_config_overrides(opt_config))
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    scheduler = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=1,
                                        lr_decay_steps=10, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                        wd_incr_steps=10, wd_incr_style="constant")
    g = torch.Generator().manual_seed(5 + dist.get_rank())
    for _ in range(STEPS):
        tokens = torch.randint(0, spec.vocab_size, (2, 32), generator=g).cuda()
        positions = torch.arange(32).cuda().unsqueeze(0).expand(2, -1)
        opt.zero_grad()
        loss = wrapped(tokens, positions, None, labels=tokens).float().mean()
        loss.backward()
        ok, grad_norm, _ = opt.step()
        scheduler.step(increment=1)
        if dist.get_rank() == 0:
            print(f"loss {loss.item():.4f} grad norm {grad_norm} ok {ok}")
    args = _args(spec, 1, 1, padded, ITERATION, "bfloat16" if bf16 else "float32")
    vars(args).update(ckpt_format="torch_dcp", use_torch_fsdp2=True, data_parallel_size=dist.get_world_size(),
                      no_save_optim=False, use_distributed_optimizer=False)
    rng = [{"random_rng_state": None, "np_rng_state": None, "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": torch.cuda.get_rng_state(), "rng_tracker_states": {}}]
    state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
             "model": gpt.state_dict_for_save_checkpoint(), "optimizer": opt.state_dict(),
             "opt_param_scheduler": scheduler.state_dict(), "rng_state": rng,
             "num_floating_point_operations_so_far": 0}
    root = Path(out)
    save_dcp(state, root, "torch_dcp", ITERATION)
    reference = _reference(opt, gpt)
    if dist.get_rank() == 0:
        torch.save(reference, root / "reference.pt")
    dist.barrier()
    dist.destroy_process_group()


def _reference(opt, gpt) -> dict:
    """megatron-core's own view: each parameter's (by its state-dict name) fp32 master and Adam moments, gathered
    whole from the DTensors (a collective: every rank calls it), and Adam's step."""
    import torch
    names = {id(p): n for n, p in gpt.named_parameters()}
    inner = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
    out = {}
    pairs = zip(inner.float16_groups, inner.fp32_from_float16_groups) if hasattr(inner, "float16_groups") else \
        ((g["params"], g["params"]) for g in inner.optimizer.param_groups)  # FP32Optimizer: the weights are the masters
    for model_group, main_group in pairs:
        for p, main in zip(model_group, main_group):
            s = inner.optimizer.state[main]
            out[names[id(p)]] = {k: t.full_tensor().detach().float().cpu().clone() if hasattr(t, "full_tensor")
                                 else t.detach().float().cpu().clone()
                                 for k, t in (("master", main), ("exp_avg", s["exp_avg"]),
                                              ("exp_avg_sq", s["exp_avg_sq"]))}
            step = s.get("step", next(grp.get("step") for grp in inner.optimizer.param_groups
                                      if any(main is q for q in grp["params"])))
            out[names[id(p)]]["step"] = torch.tensor(float(step))
    return out


if __name__ == "__main__":
    from mcore_checkpoints import run_as_script
    run_as_script(main, *sys.argv[1:])
