"""A Megatron-LM `--ckpt-format torch_dcp` checkpoint, written as Megatron-LM writes one, and megatron-core's own
logits. Run under torchrun with DP processes (gloo, CPU; Megatron-LM's torch_dcp is its FSDP2 form, at TP = PP = 1):

    torchrun --nproc-per-node DP tests/mcore_dcp.py CONFIG.json OUT

CONFIG.json: {"model": ModelSpec fields, "iteration": N, "newest": true (megatron-core 0.19, tests/mcore_newest.py),
"optimizer": true (megatron-core's optimizer after one step,
saved as Megatron-LM saves it: `optimizer.state_dict()`)}. Each rank builds megatron-core's `GPTModel` (local spec, as
tests/mcore_checkpoints.py does, norms and biases made non-trivial), runs its forward on fixed tokens (rank 0 saves
OUT/tokens.pt and OUT/logits.pt), wraps it in megatron-core's own `TorchFullyShardedDataParallel` (torch's FSDP2
`fully_shard` over the data-parallel ranks: every parameter a DTensor sharded on dim 0) and saves what Megatron-LM's
`save_checkpoint` saves for torch_dcp (`generate_state_dict`: args, checkpoint_version, iteration, the unwrapped
model's `state_dict_for_save_checkpoint()`, rng_state) with `torch.distributed.checkpoint.save` into
OUT/torch_dcp/iter_NNNNNNN, and the tracker. CPU shim beyond tests/mcore_checkpoints.py's: megatron-core's wrapper
builds its device mesh on "cuda"; here on "cpu".
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main(config_path: str, out: str) -> None:
    from mcore_checkpoints import BATCH, SEQ, _args, _forward, _perturb, on_cpu, save_dcp
    cfg = json.loads(Path(config_path).read_text())
    on_cpu(1, 1, newest=cfg.get("newest", False))  # Megatron-LM's torch_dcp: TP = PP = 1, every process a DP rank
    import torch
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed import torch_fully_sharded_data_parallel as fsdp
    from mcore_reference_child import _build_model

    from ckpt_tools.model.spec import ModelSpec
    iteration = cfg.get("iteration", 5)
    spec = ModelSpec.from_dict(cfg["model"])
    padded = spec.padded_vocab_size(1)
    torch.manual_seed(1234)
    model = _build_model({**spec.to_dict(), "padded_vocab_size": padded}, 1, 1).eval()
    _perturb(model, torch)
    out_dir = Path(out)
    tokens = torch.randint(0, spec.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    logits = _forward(model, tokens, torch)
    if dist.get_rank() == 0:
        torch.save(tokens, out_dir / "tokens.pt")
        torch.save(logits, out_dir / "logits.pt")
        import megatron.core
        (out_dir / "megatron_core_version.txt").write_text(megatron.core.__version__)

    from_group = fsdp.DeviceMesh.from_group
    fsdp.DeviceMesh.from_group = staticmethod(lambda group, device, *a, **k: from_group(group, "cpu", *a, **k))
    model.config.transformer_impl = "local"  # the local spec's layers, as --transformer-impl local sets it
    wrapped = fsdp.TorchFullyShardedDataParallel(model.config, DistributedDataParallelConfig(), model)
    args = _args(spec, 1, 1, padded, iteration, "float32")
    vars(args).update(ckpt_format="torch_dcp", use_torch_fsdp2=True, data_parallel_size=dist.get_world_size())
    rng = [{"random_rng_state": None, "np_rng_state": None, "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": None, "rng_tracker_states": {}}]
    state = {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
             "model": wrapped.module.state_dict_for_save_checkpoint(), "rng_state": rng,
             "num_floating_point_operations_so_far": 0}
    if cfg.get("optimizer"):  # megatron-core's own optimizer (FSDP2: not the distributed one), one step taken
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1, clip_grad=0.0,
                                                           params_dtype=torch.float32), [wrapped])
        torch.manual_seed(99)
        for p in wrapped.parameters():  # gradients of their own per parameter: the moments tell parameters apart
            p.grad = torch.randn_like(p)
        optimizer.step()
        args.no_save_optim = False
        state["optimizer"] = optimizer.state_dict()
        state["model"] = wrapped.module.state_dict_for_save_checkpoint()
    save_dcp(state, out_dir, "torch_dcp", iteration)
    dist.destroy_process_group()


if __name__ == "__main__":
    from mcore_checkpoints import run_as_script
    run_as_script(main, *sys.argv[1:])
