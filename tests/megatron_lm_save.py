"""Checkpoints written by Megatron-LM's own `save_checkpoint` (megatron/training/checkpointing.py, not part of the
megatron-core wheel, so not in CI), on CPU, for fixtures/megatron_save:

    git -C <Megatron-LM clone> archive core_v0.16.1 megatron | tar -x -C /tmp/mlm; pip install six --target SITE
    MLM=/tmp/mlm SITE=... torchrun --nproc-per-node 2 tests/megatron_lm_save.py fixtures/megatron_save FORM

FORM is torch_dist (Megatron-LM's default) or torch. The args come from Megatron-LM's own parser (so they hold what
real args hold: AttnBackend, ModelType, signal.Signals ...), the model is megatron-core's GPTModel (Llama-style,
TP2, local spec: Transformer Engine is not installable here), and `save_checkpoint(iteration, [model], None, None,
0)` writes it with everything it adds itself (rng_state, rerun state machine, content metadata, the non-persistent
and async plumbing). OUT/FORM/reference.pt holds megatron-core's logits on fixed tokens. The CPU stand-ins are
tests/legacy_megatron_checkpoints.py's, plus the CUDA RNG and device calls save_checkpoint makes.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

MODEL = {"architecture": "llama", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
         "ffn_hidden_size": 96, "vocab_size": 127, "max_position_embeddings": 16}
ITERATION, TP = 7, 2


def main(out: str, form: str) -> None:
    sys.path.append(os.environ.get("SITE", "/tmp/site"))
    import legacy_megatron_checkpoints as legacy
    import torch
    flags = [f for f in legacy.COMMON if f != "--use-legacy-models"] + [
        "--num-layers", "2", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--no-rope-fusion",
        "--swiglu", "--ffn-hidden-size", "96", "--disable-bias-linear", "--group-query-attention",
        "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--tensor-model-parallel-size", str(TP),
        "--save", str(Path(out).resolve() / form), "--save-interval", "1", "--no-save-optim"]
    flags[flags.index("--ckpt-format") + 1] = form
    args, _ = legacy._megatron(os.environ.get("MLM", "/tmp/mlm"), flags)
    import torch.distributed as dist
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.rerun_state_machine import initialize_rerun_state_machine
    mpu.initialize_model_parallel(TP, 1)
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    tensor_parallel.get_cuda_rng_tracker().get_states = lambda: {}
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: __import__("contextlib").nullcontext()
    initialize_rerun_state_machine()
    import megatron.training.global_vars as global_vars
    global_vars._GLOBAL_ARGS = args
    import megatron.training.checkpointing as checkpointing
    from mcore_checkpoints import _forward, _perturb, _shim_cuda
    from mcore_reference_child import _build_model

    from ckpt_tools.model.spec import ModelSpec
    _shim_cuda(torch)
    checkpointing.on_save_checkpoint_start = lambda *a, **k: None
    torch.manual_seed(1234)
    model = _build_model({**ModelSpec.from_dict(MODEL).to_dict(), "padded_vocab_size": 128}, TP, 1)
    _perturb(model, torch)
    tokens = torch.randint(0, 127, (2, 16), generator=torch.Generator().manual_seed(5))
    logits = _forward(model, tokens, torch)
    checkpointing.save_checkpoint(ITERATION, [model], None, None, 0)
    if mpu.get_tensor_model_parallel_rank() == 0:
        torch.save({"tokens": tokens, "logits": logits}, Path(out) / form / "reference.pt")
    dist.barrier()


if __name__ == "__main__":
    from mcore_checkpoints import run_as_script
    run_as_script(main, *sys.argv[1:])
