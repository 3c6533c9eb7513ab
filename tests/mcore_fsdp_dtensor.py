"""Megatron-LM `--ckpt-format fsdp_dtensor` checkpoints (Megatron-FSDP: `--use-megatron-fsdp`), saved and loaded by
megatron-core's own modules as a `--bf16` run does. Needs CUDA (Megatron-FSDP and megatron-core's optimizers allocate
on "cuda"); tests/gpu_fsdp_dtensor.sh runs the cases:

    torchrun --nproc-per-node DP tests/mcore_fsdp_dtensor.py CONFIG.json OUT             # save
    torchrun --nproc-per-node DP tests/mcore_fsdp_dtensor.py load CONFIG.json OUT.pt DIR...   # load
    torchrun --nproc-per-node DP tests/mcore_fsdp_dtensor.py resume CONFIG.json OUT.json DIR...   # resume

CONFIG.json: {"model": ModelSpec fields, "iteration": N, "optimizer": true|false, "watchdog": seconds}. Save:
megatron-core builds the GPTModel (local spec, as tests/mcore_checkpoints.py does, norms non-trivial), wraps it as
Megatron-LM's `get_model` does for Megatron-FSDP (`Float16Module`, then megatron-core's `FullyShardedDataParallel`
adapter, `optim_grads_params`), gives it megatron-core's distributed optimizer and scheduler, trains STEPS steps, runs
its forward on fixed tokens (OUT/tokens.pt, OUT/logits.pt: the weights the checkpoint holds), gathers its own full
tensors of them (OUT/weights.pt) and saves what Megatron-LM's `save_checkpoint` saves for fsdp_dtensor:
`generate_state_dict` (args, checkpoint_version, iteration, the model's `state_dict_for_save_checkpoint()`, the
optimizer's `sharded_state_dict(..., metadata={"distrib_optim_sharding_type": "fsdp_dtensor"})` and the scheduler
unless "optimizer" is false (`--no-save-optim`), rng state), then Megatron-LM's `preprocess_fsdp_dtensor_state_dict`
(megatron-core's own handlers in its order: `_extra_state` dropped, SwiGLU fc1 split into `_w` / `_v`, uneven DTensor
shards described) and `torch.distributed.checkpoint.save` into OUT/fsdp_dtensor/iter_NNNNNNN, and the tracker.
With "continue": K in CONFIG it then trains K more steps and writes their losses (OUT/losses.json): the run that was
not interrupted. Resume loads each DIR with its optimizer and scheduler as Megatron-LM's load_checkpoint does for
`--use-megatron-fsdp --ckpt-format fsdp_dtensor --no-load-rng` and trains the same K steps on the same batches.

Seen on 2 x H200 with megatron-core 0.16.1 and 0.19.2: with the optimizer at DP 2 the save waits forever in
`preprocess_state_dict_for_uneven_dtensor`'s all_gather_object (the ranks' optimizer states hold different
parameters: Megatron-LM #4910, #5265); at DP 1, or without the optimizer, it saves.
"""
from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

STEPS = 2


def _wrapped(spec, torch, seed: int = 1234):
    """megatron-core's GPTModel as Megatron-LM's get_model wraps it for Megatron-FSDP (bf16): Float16Module, then
    megatron-core's FullyShardedDataParallel adapter (optim_grads_params)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.transformer.module import Float16Module
    from mcore_checkpoints import _perturb
    from mcore_reference_child import _build_model
    torch.manual_seed(seed)
    gpt = _build_model({**spec.to_dict(), "padded_vocab_size": spec.padded_vocab_size(1)}, 1, 1)
    _perturb(gpt, torch)
    gpt = gpt.cuda()
    config = gpt.config
    config.bf16, config.params_dtype, config.transformer_impl = True, torch.bfloat16, "local"
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True,
                                               use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params")
    return FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=Float16Module(config, gpt))


def _logits(wrapped, spec, torch):
    """The forward on fixed tokens, through the FSDP wrapper."""
    from mcore_checkpoints import BATCH, SEQ
    tokens = torch.randint(0, spec.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(7)).cuda()
    positions = torch.arange(SEQ).cuda().unsqueeze(0).expand(BATCH, -1)
    mask = torch.triu(torch.ones(SEQ, SEQ, device="cuda"), 1).bool()[None, None]
    wrapped.eval()
    with torch.no_grad():
        return tokens.cpu(), wrapped(tokens, positions, mask).float().cpu()


def _preprocess(state: dict, wrapped, swiglu: bool) -> None:
    """Megatron-LM's preprocess_fsdp_dtensor_state_dict with megatron-core's handlers, in its order."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor)
    from megatron.core.transformer import fsdp_dtensor_checkpoint as handlers
    handlers.handle_fp8_extra_state_case(state["model"])
    if swiglu:  # Megatron-LM passes its model unwrapped down to MegatronFSDP (megatron.training.utils.unwrap_model)
        state["model"], optimizer = handlers.handle_swiglu_in_state_dict(wrapped.module, state["model"],
                                                                         state.get("optimizer"))
        if optimizer is not None:
            state["optimizer"] = optimizer
    preprocess_state_dict_for_uneven_dtensor(state)


def _load_strict(state: dict, wrapped, spec, save_dir: str) -> None:
    """Megatron-LM's preprocess_fsdp_dtensor_state_dict, then torch.distributed.checkpoint's load of the save dir's
    tracked iteration into `state`, strict: every key asked for must be in the checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import default_planner
    _preprocess(state, wrapped, spec.activation == "swiglu")
    root = Path(save_dir)
    tracker = (root / "latest_checkpointed_iteration.txt").read_text().strip()
    iter_dir = root / (tracker if tracker == "release" else f"iter_{int(tracker):07d}")
    dcp.load_state_dict(state_dict=state, storage_reader=dcp.FileSystemReader(str(iter_dir)),
                        planner=default_planner.DefaultLoadPlanner(allow_partial_load=False))


def _full(model_state: dict, torch) -> dict:
    """megatron-core's own full tensors of a model state dict (Megatron-FSDP's gather of its uneven DTensors)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import gather_uneven_dtensor_to_full_tensor
    return {k: gather_uneven_dtensor_to_full_tensor(v).to_local().cpu() if hasattr(v, "device_mesh") else v.cpu()
            for k, v in sorted(model_state.items()) if isinstance(v, torch.Tensor)}


def _setup(config_path: str):
    """(CONFIG, torch, torch.distributed, the model's ModelSpec) of a process of the run, its process group joined."""
    warnings.filterwarnings("ignore")
    cfg = json.loads(Path(config_path).read_text())
    return (cfg, *_start(cfg))


def _start(cfg: dict):
    import faulthandler
    import torch
    import torch.distributed as dist
    faulthandler.dump_traceback_later(cfg.get("watchdog", 300), exit=True)  # a rank that hangs says where
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    ps.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    from ckpt_tools.model.spec import ModelSpec
    return torch, dist, ModelSpec.from_dict(cfg["model"])


def _optimizer(wrapped, torch):
    """megatron-core's distributed optimizer (Adam, bf16 with fp32 main weights) and scheduler for the run."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_standard_config_overrides
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    opt_config = OptimizerConfig(optimizer="adam", lr=1e-2, min_lr=1e-3, weight_decay=0.1, bf16=True,
                                 params_dtype=torch.bfloat16, use_distributed_optimizer=True, clip_grad=1.0)
    opt = get_megatron_optimizer(opt_config, [wrapped], config_overrides=get_standard_config_overrides(opt_config))
    scheduler = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=1,
                                        lr_decay_steps=10, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
                                        wd_incr_steps=10, wd_incr_style="constant")
    return opt, scheduler


def _train(wrapped, opt, scheduler, spec, torch, dist, g, steps: int) -> list[float]:
    """`steps` training steps on batches drawn from `g`; their losses."""
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, spec.vocab_size, (2, 32), generator=g).cuda()
        positions = torch.arange(32).cuda().unsqueeze(0).expand(2, -1)
        wrapped.train()
        wrapped.zero_grad_buffer()
        opt.zero_grad()
        loss = wrapped(tokens, positions, None, labels=tokens).float().mean()
        loss.backward()
        wrapped.finish_grad_sync()
        ok, grad_norm, _ = opt.step()
        scheduler.step(increment=1)
        losses.append(loss.item())
        if dist.get_rank() == 0:
            print(f"loss {loss.item():.6f} grad norm {grad_norm} ok {ok}")
    return losses


def main(config_path: str, out: str) -> None:
    cfg, torch, dist, spec = _setup(config_path)
    from mcore_checkpoints import _args, save_dcp
    iteration = cfg.get("iteration", 5)
    wrapped = _wrapped(spec, torch)
    opt, scheduler = _optimizer(wrapped, torch)
    g = torch.Generator().manual_seed(5 + dist.get_rank())
    _train(wrapped, opt, scheduler, spec, torch, dist, g, STEPS)
    tokens, logits = _logits(wrapped, spec, torch)  # the forward of the weights the checkpoint holds
    root = Path(out)
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        torch.save(tokens, root / "tokens.pt")
        torch.save(logits, root / "logits.pt")
    args = _args(spec, 1, 1, spec.padded_vocab_size(1), iteration, "bfloat16")
    vars(args).update(ckpt_format="fsdp_dtensor", use_megatron_fsdp=True, data_parallel_size=dist.get_world_size(),
                      no_save_optim=False, use_distributed_optimizer=True)
    rng = {"(0, 0)": [{"random_rng_state": None, "np_rng_state": None, "torch_rng_state": torch.get_rng_state(),
                       "cuda_rng_state": torch.cuda.get_rng_state(), "rng_tracker_states": {}}]}
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
             "model": wrapped.module.state_dict_for_save_checkpoint()}
    full = _full(state["model"], torch)
    if dist.get_rank() == 0:
        torch.save(full, root / "weights.pt")
    if cfg.get("optimizer", True):
        state["optimizer"] = opt.sharded_state_dict(state, metadata={"distrib_optim_sharding_type": "fsdp_dtensor"})
        state["opt_param_scheduler"] = scheduler.state_dict()
    else:
        args.no_save_optim = True
    state["rng_state"] = rng
    _preprocess(state, wrapped, args.swiglu)
    save_dcp(state, root, "fsdp_dtensor", iteration)
    if cfg.get("continue"):
        losses = _train(wrapped, opt, scheduler, spec, torch, dist, g, cfg["continue"])
        if dist.get_rank() == 0:
            (root / "losses.json").write_text(json.dumps(losses))
    dist.destroy_process_group()


def resume(config_path: str, out: str, *save_dirs: str) -> None:
    """Megatron-LM's load_checkpoint of each SAVE_DIR with `--use-megatron-fsdp --ckpt-format fsdp_dtensor
    --no-load-rng`: the model, the optimizer's sharded_state_dict(is_loading=True, fsdp_dtensor) and the scheduler's
    state through preprocess_fsdp_dtensor_state_dict and a strict torch.distributed.checkpoint load, then the model's,
    the optimizer's and the scheduler's load_state_dict; then CONFIG's "continue" steps on the batches the saving run
    drew after its save. OUT {save dir: losses} from rank 0."""
    cfg, torch, dist, spec = _setup(config_path)
    found = {}
    for save_dir in save_dirs:
        wrapped = _wrapped(spec, torch, seed=99)  # other weights than any checkpoint's
        opt, scheduler = _optimizer(wrapped, torch)
        raw = wrapped.module.state_dict_for_save_checkpoint()
        state = {"model": dict(raw), "args": None, "iteration": None, "checkpoint_version": None}
        state["optimizer"] = opt.sharded_state_dict(state, is_loading=True,
                                                    metadata={"distrib_optim_sharding_type": "fsdp_dtensor"})
        state["opt_param_scheduler"] = scheduler.state_dict()
        raw_optimizer = state["optimizer"].copy()
        _load_strict(state, wrapped, spec, save_dir)
        wrapped.load_state_dict(raw, strict=False)
        opt.load_state_dict(raw_optimizer)
        scheduler.load_state_dict(state["opt_param_scheduler"])
        g = torch.Generator().manual_seed(5 + dist.get_rank())
        for _ in range(STEPS):  # the batches the saving run trained on before its save
            torch.randint(0, spec.vocab_size, (2, 32), generator=g)
        found[save_dir] = _train(wrapped, opt, scheduler, spec, torch, dist, g, cfg["continue"])
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(found))
    dist.destroy_process_group()


def load(config_path: str, out: str, *save_dirs: str) -> None:
    """Megatron-LM's load_checkpoint of each SAVE_DIR for `--use-megatron-fsdp --ckpt-format fsdp_dtensor
    --no-load-optim --no-load-rng`: the model's state dict (args, iteration, checkpoint_version beside it) through
    preprocess_fsdp_dtensor_state_dict, torch.distributed.checkpoint.load_state_dict with a strict planner (every key
    the model asks for must be in the checkpoint: stricter than Megatron-LM's partial load, which would leave a
    missing weight at its initial value), then the wrapped model's load_state_dict (strict=False, as Megatron-FSDP's
    adapter loads a GLU model); then its forward.
    OUT {save dir: {"logits", "weights": the main weights loaded, gathered, "args"}} from rank 0."""
    cfg, torch, dist, spec = _setup(config_path)
    found = {}
    for save_dir in save_dirs:
        wrapped = _wrapped(spec, torch, seed=99)  # other weights than any checkpoint's
        raw = wrapped.module.state_dict_for_save_checkpoint()
        state = {"model": dict(raw), "args": None, "iteration": None, "checkpoint_version": None}
        _load_strict(state, wrapped, spec, save_dir)
        result = wrapped.load_state_dict(raw, strict=False)
        _, logits = _logits(wrapped, spec, torch)
        weights = _full(wrapped.module.state_dict_for_save_checkpoint(), torch)
        found[save_dir] = {"logits": logits, "weights": weights, "iteration": state["iteration"],
                           "missing": list(getattr(result, "missing_keys", []) or []),
                           "unexpected": list(getattr(result, "unexpected_keys", []) or [])}
        if dist.get_rank() == 0:
            print(save_dir, "loaded: iteration", state["iteration"], "missing", found[save_dir]["missing"][:4])
    if dist.get_rank() == 0:
        torch.save(found, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    from mcore_checkpoints import run_as_script
    if sys.argv[1] == "load":  # torchrun ... load CONFIG.json OUT SAVE_DIR...
        run_as_script(load, *sys.argv[2:])
    elif sys.argv[1] == "resume":  # torchrun ... resume CONFIG.json OUT.json SAVE_DIR...
        run_as_script(resume, *sys.argv[2:])
    else:
        run_as_script(main, *sys.argv[1:])
