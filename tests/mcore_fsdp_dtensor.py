"""A Megatron-LM `--ckpt-format fsdp_dtensor` checkpoint (Megatron-FSDP: `--use-megatron-fsdp`), as a `--bf16` run
saves it, written by megatron-core's own modules after real training steps. Needs CUDA (Megatron-FSDP and
megatron-core's optimizers allocate on "cuda"); two GPUs (the parameters sharded over two data-parallel ranks):

    torchrun --nproc-per-node 2 tests/mcore_fsdp_dtensor.py CONFIG.json OUT

CONFIG.json: {"model": ModelSpec fields, "iteration": N}. megatron-core builds the GPTModel (local spec, as
tests/mcore_checkpoints.py does, norms and biases non-trivial), runs its forward on fixed tokens (OUT/tokens.pt,
OUT/logits.pt: the weights saved are these, trained on after), wraps it as Megatron-LM's `get_model` does for
Megatron-FSDP (`Float16Module`, then megatron-core's `FullyShardedDataParallel` adapter, `optim_grads_params`), gives it
megatron-core's distributed optimizer, trains STEPS steps, runs the forward again (OUT/logits_saved.pt: the weights the
checkpoint holds) and saves what Megatron-LM's `save_checkpoint` saves for fsdp_dtensor: `generate_state_dict` (args,
checkpoint_version, iteration, the model's `state_dict_for_save_checkpoint()`, the optimizer's
`sharded_state_dict(..., metadata={"distrib_optim_sharding_type": "fsdp_dtensor"})`, rng state), then Megatron-LM's
`preprocess_fsdp_dtensor_state_dict` (megatron-core's own handlers in its order: `_extra_state` dropped, SwiGLU fc1
split into `_w` / `_v`, experts by global index, uneven DTensor shards described) and
`torch.distributed.checkpoint.save` into OUT/fsdp_dtensor/iter_NNNNNNN, and the tracker.

Status: not yet a fixture maker; no test uses it. On 2 x H100 it trains, then megatron-core 0.16.1's save path
stops in `preprocess_state_dict_for_uneven_dtensor` ("DTensor chunk metadata is invalid. Offsets: (128, 0), Sizes:
(96, 64), Global shape: [96, 64]": the SwiGLU `_v` half of an fc1 of 2 x 96 rows), and 0.19.2's hangs after training
(killed at 500 s). Run it with a model CONFIG of tests/mcore_checkpoints.py's kind, e.g. a 2-layer Llama.
"""
from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

STEPS = 2


def main(config_path: str, out: str) -> None:
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides
    from megatron.core.transformer import fsdp_dtensor_checkpoint as handlers
    from megatron.core.transformer.module import Float16Module
    from mcore_checkpoints import BATCH, SEQ, _args, _perturb, save_dcp
    from mcore_reference_child import _build_model

    from ckpt_tools.spec import ModelSpec
    cfg = json.loads(Path(config_path).read_text())
    iteration = cfg.get("iteration", 5)
    import faulthandler
    faulthandler.dump_traceback_later(cfg.get("watchdog", 300), exit=True)  # a rank that hangs says where
    ps.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    spec = ModelSpec.from_dict(cfg["model"])
    padded = spec.padded_vocab_size(1)
    torch.manual_seed(1234)
    gpt = _build_model({**spec.to_dict(), "padded_vocab_size": padded}, 1, 1)
    _perturb(gpt, torch)
    gpt = gpt.cuda()
    config = gpt.config
    config.bf16, config.params_dtype, config.transformer_impl = True, torch.bfloat16, "local"
    model = Float16Module(config, gpt)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True,
                                               use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params")
    wrapped = FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=model)
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-2, min_lr=1e-3, weight_decay=0.1, bf16=True,
                                 params_dtype=torch.bfloat16, use_distributed_optimizer=True, clip_grad=1.0)
    opt = get_megatron_optimizer(opt_config, [wrapped], config_overrides=get_standard_config_overrides(opt_config))
    g = torch.Generator().manual_seed(5 + dist.get_rank())
    for _ in range(STEPS):
        tokens = torch.randint(0, spec.vocab_size, (2, 32), generator=g).cuda()
        positions = torch.arange(32).cuda().unsqueeze(0).expand(2, -1)
        wrapped.zero_grad_buffer()
        opt.zero_grad()
        loss = wrapped(tokens, positions, None, labels=tokens).float().mean()
        loss.backward()
        wrapped.finish_grad_sync()
        ok, grad_norm, _ = opt.step()
        if dist.get_rank() == 0:
            print(f"loss {loss.item():.4f} grad norm {grad_norm} ok {ok}")
    # the forward of the weights the checkpoint holds (megatron-core's own, through the FSDP wrapper)
    tokens = torch.randint(0, spec.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(7)).cuda()
    positions = torch.arange(SEQ).cuda().unsqueeze(0).expand(BATCH, -1)
    mask = torch.triu(torch.ones(SEQ, SEQ, device="cuda"), 1).bool()[None, None]
    wrapped.eval()
    with torch.no_grad():
        logits = wrapped(tokens, positions, mask).float().cpu()
    root = Path(out)
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        torch.save(tokens.cpu(), root / "tokens.pt")
        torch.save(logits, root / "logits.pt")
    args = _args(spec, 1, 1, padded, iteration, "bfloat16")
    vars(args).update(ckpt_format="fsdp_dtensor", use_megatron_fsdp=True, data_parallel_size=dist.get_world_size(),
                      no_save_optim=False, use_distributed_optimizer=True)
    rng = {"(0, 0)": [{"random_rng_state": None, "np_rng_state": None, "torch_rng_state": torch.get_rng_state(),
                       "cuda_rng_state": torch.cuda.get_rng_state(), "rng_tracker_states": {}}]}
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
             "model": wrapped.module.state_dict_for_save_checkpoint()}
    # megatron-core's own full tensors of what the checkpoint holds (Megatron-FSDP's gather of its uneven DTensors)
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import gather_uneven_dtensor_to_full_tensor
    full = {k: gather_uneven_dtensor_to_full_tensor(v).to_local().cpu() if hasattr(v, "device_mesh") else v.cpu()
            for k, v in sorted(state["model"].items()) if isinstance(v, torch.Tensor)}
    if dist.get_rank() == 0:
        torch.save(full, root / "weights.pt")
    if cfg.get("optimizer", True):
        state["optimizer"] = opt.sharded_state_dict(state, metadata={"distrib_optim_sharding_type": "fsdp_dtensor"})
    else:
        args.no_save_optim = True
    state["rng_state"] = rng
    # Megatron-LM's preprocess_fsdp_dtensor_state_dict, with megatron-core's handlers
    handlers.handle_fp8_extra_state_case(state["model"])
    if args.swiglu:
        # Megatron-LM's save passes its model unwrapped down to MegatronFSDP (megatron.training.utils.unwrap_model)
        state["model"], optimizer = handlers.handle_swiglu_in_state_dict(wrapped.module, state["model"],
                                                                         state.get("optimizer"))
        if optimizer is not None:
            state["optimizer"] = optimizer
    if args.num_experts:
        state["model"] = handlers.handle_experts_in_state_dict(state["model"], args.num_experts)
    preprocess_state_dict_for_uneven_dtensor(state)
    save_dcp(state, root, "fsdp_dtensor", iteration)
    dist.destroy_process_group()


if __name__ == "__main__":
    from mcore_checkpoints import run_as_script
    run_as_script(main, *sys.argv[1:])
