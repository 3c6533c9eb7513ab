"""Megatron-LM checkpoints WITH optimizer state, written by megatron-core's own optimizers after real training
steps. Needs CUDA (megatron-core's optimizers allocate on "cuda"); one GPU:

    torchrun --nproc-per-node 1 tests/mcore_optimizer_checkpoints.py OUT

A tiny Llama (bf16 weights, fp32 master weights, grads reduced in fp32: what `--bf16` sets) is built by
megatron-core (as tests/mcore_checkpoints.py does), wrapped in megatron-core's DistributedDataParallel, given
megatron-core's optimizer (`get_megatron_optimizer`, Adam, weight decay skipped for biases and 1-D params as
Megatron-LM's `get_standard_config_overrides` says), trained STEPS steps on random tokens, and saved as
Megatron-LM's `save_checkpoint` saves it:

    OUT/plain/torch/       legacy torch form: model_optim_rng.pt['optimizer'] = optimizer.state_dict()
    OUT/plain/torch_dist/  torch_dist: optimizer.sharded_state_dict(model) (optimizer.state.<field>.<key>)
    OUT/dist/torch/        --use-distributed-optimizer: model_optim_rng.pt + distrib_optim.pt
    OUT/dist/torch_dist/   torch_dist, sharding type dp_reshardable (Megatron-LM's default)
    OUT/dist/torch_dist_full/  torch_dist, fully_reshardable (--dist-ckpt-optim-fully-reshardable)
    OUT/dist_buckets/{torch,torch_dist}/  the distributed optimizer with --overlap-grad-reduce and a small
                           --ddp-bucket-size: several buckets per buffer (fully_reshardable is left out: megatron-core
                           0.16.1 misplaces its data when a buffer has more than one bucket)
    OUT/<variant>/reference.pt  {model key: {"master", "exp_avg", "exp_avg_sq", "step"}}: megatron-core's own
                           optimizer state of every parameter, read from the optimizer object itself; and under
                           "_buffers" megatron-core's own grad-buffer layout (each parameter's [start, end, bucket]
                           and each bucket's [start, end]), which the bucket forms are decoded by
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

SPEC = {"architecture": "llama", "num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_query_groups": 2,
        "ffn_hidden_size": 48, "vocab_size": 120, "max_position_embeddings": 64, "norm_epsilon": 1e-6}
# (name, distributed optimizer, DDP bucket size: None = one bucket per buffer, as without --overlap-grad-reduce)
VARIANTS = (("plain", False, None), ("dist", True, None), ("dist_buckets", True, 3000))
STEPS, ITERATION = 3, 3


def _state_of(opt, model, distributed: bool) -> dict:
    """megatron-core's own view: for each parameter (by its state-dict name) the fp32 master and Adam moments."""
    import torch
    names = {id(p): n for n, p in model.named_parameters()}
    inner = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
    out = {}
    if distributed:
        for p in model.parameters():
            t = inner._get_main_param_and_optimizer_states(p)
            out[names[id(p)]] = {"master": t["param"].detach().float().cpu().view(p.shape).clone(),
                                 "exp_avg": t["exp_avg"].detach().float().cpu().view(p.shape).clone(),
                                 "exp_avg_sq": t["exp_avg_sq"].detach().float().cpu().view(p.shape).clone()}
    else:
        for model_group, main_group in zip(inner.float16_groups, inner.fp32_from_float16_groups):
            for p, main in zip(model_group, main_group):
                s = inner.optimizer.state[main]
                out[names[id(p)]] = {"master": main.detach().float().cpu().clone(),
                                     "exp_avg": s["exp_avg"].detach().float().cpu().clone(),
                                     "exp_avg_sq": s["exp_avg_sq"].detach().float().cpu().clone()}
    for group in inner.optimizer.param_groups:  # Adam's step: per parameter (torch) or per group (fused)
        for q in group["params"]:
            step = inner.optimizer.state.get(q, {}).get("step", group.get("step"))
            if step is not None:
                for v in out.values():
                    v.setdefault("step", torch.tensor(float(step)))
    return out


def run(out: Path, kind: str, distributed: bool, bucket_size: int | None) -> None:
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides
    from mcore_checkpoints import _args, _perturb
    from mcore_reference_child import _build_model

    from ckpt_tools.model.spec import ModelSpec
    spec = ModelSpec.from_dict(SPEC)
    padded = spec.padded_vocab_size(1)
    torch.manual_seed(1234)
    gpt = _build_model({**spec.to_dict(), "padded_vocab_size": padded}, 1, 1)
    _perturb(gpt, torch)
    gpt = gpt.cuda().to(torch.bfloat16)
    gpt.config.bf16, gpt.config.params_dtype = True, torch.bfloat16
    ddp = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed, overlap_grad_reduce=bucket_size is not None,
        bucket_size=bucket_size), gpt)
    config = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, bf16=True, params_dtype=torch.bfloat16,
                             use_distributed_optimizer=distributed, clip_grad=1.0)
    opt = get_megatron_optimizer(config, [ddp], config_overrides=get_standard_config_overrides(config))
    g = torch.Generator().manual_seed(5)
    for _ in range(STEPS):
        tokens = torch.randint(0, spec.vocab_size, (2, 32), generator=g).cuda()
        positions = torch.arange(32).cuda().unsqueeze(0).expand(2, -1)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        loss = ddp(tokens, positions, None, labels=tokens).float().mean()
        loss.backward()
        ddp.finish_grad_sync()
        ok, grad_norm, _ = opt.step()
        print(f"{kind} loss {loss.item():.4f} grad norm {grad_norm} ok {ok}")
    root = out / kind
    args = _args(spec, 1, 1, padded, ITERATION, "bfloat16")
    args.use_distributed_optimizer = distributed
    args.overlap_grad_reduce, args.ddp_bucket_size = bucket_size is not None, bucket_size
    args.accumulate_allreduce_grads_in_fp32 = True
    name = f"iter_{ITERATION:07d}"
    rng = [{"random_rng_state": None, "np_rng_state": None, "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": None, "rng_tracker_states": {}}]
    common = {"args": args, "iteration": ITERATION, "checkpoint_version": 3.0, "rng_state": rng,
              "opt_param_scheduler": {"max_lr": 1e-2, "num_steps": STEPS * 2}}
    # legacy torch form
    rank_dir = root / "torch" / name / "mp_rank_00"
    rank_dir.mkdir(parents=True)
    torch.save({**common, "model": gpt.state_dict_for_save_checkpoint(), "optimizer": opt.state_dict()},
               rank_dir / "model_optim_rng.pt")
    if distributed:
        opt.save_parameter_state(str(rank_dir / "distrib_optim.pt"))
    (root / "torch" / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    # torch_dist form(s)
    types = {"torch_dist": "dp_reshardable", "torch_dist_full": "fully_reshardable"} if distributed \
        else {"torch_dist": None}
    if bucket_size is not None:
        del types["torch_dist_full"]
    for form, sharding in types.items():
        metadata = {"distrib_optim_sharding_type": sharding, "singleton_local_shards": False,
                    "chained_optim_avoid_prefix": True} if sharding else {}
        args.ckpt_format = "torch_dist"
        state = {k: v for k, v in common.items() if k != "rng_state"}
        state.update(model=gpt.sharded_state_dict(), content_metadata=metadata,
                     optimizer=opt.sharded_state_dict(gpt.sharded_state_dict(), metadata=metadata))
        (root / form / name).mkdir(parents=True)
        dist_checkpointing.save(state, str(root / form / name))
        (root / form / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    reference = _state_of(opt, gpt, distributed)
    names = {id(p): n for n, p in gpt.named_parameters()}
    reference["_buffers"] = [{"params": {names[id(p)]: list(where) for p, where in buf.param_index_map.items()},
                              "buckets": [list(r) for r in buf.bucket_indices],
                              "dtypes": [str(buf.param_dtype), str(buf.grad_dtype)]} for buf in ddp.buffers]
    torch.save(reference, root / "reference.pt")


def main(out: str) -> None:
    warnings.filterwarnings("ignore")
    import torch
    torch.distributed.init_process_group("nccl")
    torch.cuda.set_device(0)
    from megatron.core import parallel_state as ps
    ps.initialize_model_parallel(1, 1)
    from megatron.core import tensor_parallel
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    for kind, distributed, bucket_size in VARIANTS:
        run(Path(out), kind, distributed, bucket_size)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from mcore_checkpoints import run_as_script
    run_as_script(main, sys.argv[1])
