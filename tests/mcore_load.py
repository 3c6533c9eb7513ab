"""megatron-core loads a Megatron-LM checkpoint written by `ckpt import/reshard --format ...` the way Megatron-LM's
`load_checkpoint` does, into its own GPTModel, and runs its own forward. Run under torchrun (gloo, CPU):

    torchrun --nproc-per-node TP*PP tests/mcore_load.py CONFIG.json

CONFIG.json: {"model": ModelSpec fields, "tp": T, "pp": P, "form": "torch_dist" | "torch" | "ours", "load": the save dir,
"tokens": tokens.pt, "out": logits.pt}. torch_dist: `dist_checkpointing.load` of the model's
`sharded_state_dict()` (at this TP x PP, whatever the checkpoint's), then `load_state_dict(strict=True)`;
torch: each rank's `mp_rank_TT[_PPP]/model_optim_rng.pt` into `load_state_dict(strict=True)`. The tracker
names the dir, as Megatron-LM reads it. ours: each rank's file of our format (with "ep": E, megatron-core's expert
parallelism over E data-parallel ranks, run with TP*PP*E processes, each EP rank its own experts' file). Rank 0 writes the logits [b, s, padded vocab] and the loaded args.
The CPU shims are tests/mcore_checkpoints.py's.
"""
from __future__ import annotations

import contextlib
import json
import sys
import warnings
from pathlib import Path


def main(config_path: str) -> None:
    warnings.filterwarnings("ignore")
    import torch
    from mcore_checkpoints import _forward, _shim_cuda, sharding_metadata, shim_masks
    _shim_cuda(torch)
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo")
    import trainer  # noqa: F401 (megatron-core imported as the trainer imports it: no CPU torch.compile wrappers)
    from megatron.core import dist_checkpointing, tensor_parallel
    from megatron.core import parallel_state as ps
    from mcore_reference_child import _build_model, expert_tp
    shim_masks()
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):  # megatron-core 0.16 names it without Transformer Engine too
        moe_utils.te_general_gemm = None

    from ckpt_tools.model.spec import ModelSpec
    cfg = json.loads(Path(config_path).read_text())
    tp, pp, form, load = cfg["tp"], cfg["pp"], cfg["form"], Path(cfg["load"])
    ep = cfg.get("ep", 1)
    spec = ModelSpec.from_dict(cfg["model"])
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=expert_tp(spec, tp))
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    torch.manual_seed(99)  # other weights than the checkpoint's: only a complete load gives its logits
    model = _build_model({**spec.to_dict(), "padded_vocab_size": cfg["padded_vocab"], "ep": ep}, tp, pp)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    if form == "ours":  # this rank's file of our format, its experts under local indices as megatron-core's
        from ckpt_tools.forms import checkpoint
        from ckpt_tools.model.ranks import Rank
        rank = Rank(tp_rank, pp_rank, ps.get_expert_model_parallel_rank() if ep > 1 else None)
        state = torch.load(checkpoint.resolve(load) / checkpoint.model_file(rank), weights_only=True)["model"]
        model.load_state_dict(state, strict=True)
        logits = _forward(model.eval(), torch.load(cfg["tokens"]), torch)
        if logits is not None and tp_rank == 0 and ps.get_data_parallel_rank() == 0:
            torch.save({"logits": logits}, cfg["out"])
        dist.barrier()
        dist.destroy_process_group()
        return
    tracker = (load / "latest_checkpointed_iteration.txt").read_text().strip()
    iter_dir = load / (tracker if tracker == "release" else f"iter_{int(tracker):07d}")
    if form == "torch_dist":
        common = dist_checkpointing.load_common_state_dict(str(iter_dir))
        state = dist_checkpointing.load({"model": model.sharded_state_dict(metadata=sharding_metadata())}, str(iter_dir))
        model.load_state_dict(state["model"], strict=True)
    else:
        # Megatron-LM's get_checkpoint_name: _PPP with pipeline parallelism, _EEE with expert parallelism
        name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
        if ep > 1:
            name += f"_{ps.get_expert_model_parallel_rank():03d}"
        common = torch.load(iter_dir / name / "model_optim_rng.pt", weights_only=False)
        model.load_state_dict(common["model"], strict=True)
    mtp: list = []
    logits = _forward(model.eval(), torch.load(cfg["tokens"]), torch, mtp)
    if logits is not None and tp_rank == 0 and ps.get_data_parallel_rank() == 0:
        args = common["args"]
        torch.save({"logits": logits, "mtp_logits": torch.stack(mtp) if mtp else None, "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))},
                    "iteration": common["iteration"]}, cfg["out"])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from mcore_checkpoints import run_as_script
    run_as_script(main, sys.argv[1])
