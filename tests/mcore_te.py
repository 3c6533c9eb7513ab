"""Transformer Engine checkpoints, saved by megatron-core 0.19 itself with Transformer Engine's layers on a GPU: what
a Megatron-LM user's `--transformer-impl transformer_engine` (the default) run saves. Run under torchrun on the GPU
machine (tests/gpu_te.sh installs Transformer Engine there):

    torchrun --nproc-per-node TP tests/mcore_te.py save OUT CASE [CASE...]
    torchrun --nproc-per-node TP tests/mcore_te.py load CASE SAVE_DIR OUT.pt [CASE SAVE_DIR OUT.pt ...]

save builds each CASE (of CASES, all at the torchrun's TP) with megatron-core's Transformer Engine specs
(`get_gpt_layer_with_transformer_engine_spec`, HybridModel's `hybrid_stack_spec`), makes its norms non-trivial, runs
megatron-core's forward on fixed tokens (fp32, TF32 off in torch) and saves the model as Megatron-LM's
save_checkpoint does:

    OUT/CASE/torch_dist/  dist_checkpointing.save of {args, iteration, checkpoint_version, model: sharded_state_dict(),
                     rng_state} (0.19: the common state embedded, no common.pt); every linear layer's `_extra_state`
                     is Transformer Engine's own (with "fp8": its FP8 scales and amax histories after two FP8 forwards)
    OUT/CASE/torch/  mp_rank_TT/model_optim_rng.pt: torch.save of each rank's state_dict_for_save_checkpoint(), its
                     tensors on the GPU as Megatron-LM saves them
    OUT/CASE/reference.pt  {tokens, logits}: megatron-core's logits of the fp32 forward [b, s, padded vocab] (before
                     any FP8)
    OUT/CASE/local_tp<r>.pt  each rank's model.state_dict() tensors (CPU), megatron-core's own shards

load builds each CASE at the TP of the torchrun, loads its SAVE_DIR's torch_dist (dist_checkpointing.load of
sharded_state_dict(), load_state_dict strict) or legacy torch files (load_state_dict strict), runs the same forward
and writes {logits} to OUT.pt. Fewer GPUs than processes: the ranks share GPU 0 over gloo.
"""
from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

_LLAMA = {"architecture": "llama", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
          "ffn_hidden_size": 96, "vocab_size": 127, "max_position_embeddings": 16}
_GPT2 = {"architecture": "gpt2", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128,
         "vocab_size": 127, "max_position_embeddings": 16}
_MIXTRAL = {**_LLAMA, "architecture": "mixtral", "num_moe_experts": 4, "moe_router_topk": 2}
CASES = {
    "gpt_llama_tp1": {"kind": "gpt", "tp": 1, "model": _LLAMA},
    "gpt_llama_fp8_tp1": {"kind": "gpt", "tp": 1, "model": _LLAMA, "fp8": True},
    "gpt_gpt2_tp1": {"kind": "gpt", "tp": 1, "model": _GPT2},
    "gpt_mixtral_grouped_tp1": {"kind": "gpt", "tp": 1, "model": _MIXTRAL, "grouped": True},
    "hybrid_llama_tp1": {"kind": "hybrid", "tp": 1, "model": _LLAMA, "pattern": "*-*-"},
    "gpt_llama_tp2": {"kind": "gpt", "tp": 2, "model": _LLAMA},
}
ITERATION = 5


def _start(tp: int):
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    world = int(os.environ.get("WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % gpus)
    dist.init_process_group("nccl" if gpus >= world else "gloo")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    return torch, dist, ps


def build(cfg: dict, padded: int):
    """megatron-core's GPTModel (or HybridModel) of CASE with Transformer Engine's layers, on this rank's GPU."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt import gpt_layer_specs
    from mcore_reference_child import _build_model

    from ckpt_tools.model.spec import ModelSpec

    def te_spec(normalization=None, qk_layernorm=False, num_experts=None, moe_grouped_gemm=False, **_):
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm, qk_layernorm=qk_layernorm)

    gpt_layer_specs.get_gpt_layer_local_spec = te_spec  # _build_model's config and model, Transformer Engine's spec
    spec = ModelSpec.from_dict(cfg["model"])
    torch.manual_seed(1234)
    model = _build_model({**spec.to_dict(), "padded_vocab_size": padded}, cfg["tp"], 1,
                         grouped=cfg.get("grouped", False))
    if cfg["kind"] == "hybrid":
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
        from megatron.core.models.hybrid.hybrid_model import HybridModel
        config = model.config
        config.num_layers = len(cfg["pattern"])
        torch.manual_seed(1234)
        model = HybridModel(config=config, hybrid_stack_spec=hybrid_stack_spec, vocab_size=padded,
                            max_sequence_length=spec.max_position_embeddings, hybrid_layer_pattern=cfg["pattern"],
                            pre_process=parallel_state.is_pipeline_first_stage(),
                            post_process=parallel_state.is_pipeline_last_stage(),
                            share_embeddings_and_output_weights=spec.tie_word_embeddings,
                            position_embedding_type=spec.position_embedding_type, rotary_base=int(spec.rotary_base))
    return model.cuda().eval()


def forward(model, tokens, torch):
    """megatron-core's forward on this rank's GPU; the logits gathered over TP [b, s, padded vocab] (fp32, CPU)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    b, s = tokens.shape
    positions = torch.arange(s, device="cuda").unsqueeze(0).expand(b, -1)
    with torch.no_grad():
        out = model(tokens.cuda(), positions, None)
        out = gather_from_tensor_model_parallel_region(out)
    return out.float().cpu()


def _args(spec, cfg: dict, padded: int):
    from mcore_checkpoints import _args as args_of
    args = args_of(spec, cfg["tp"], 1, padded, ITERATION, "float32")
    vars(args).update(transformer_impl="transformer_engine", fp8="hybrid" if cfg.get("fp8") else None,
                      moe_grouped_gemm=bool(cfg.get("grouped")), moe_use_legacy_grouped_gemm=False)
    if cfg["kind"] == "hybrid":
        vars(args).update(hybrid_layer_pattern=cfg["pattern"], num_layers=len(cfg["pattern"]), is_hybrid_model=True,
                          spec=["megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec"])
    return args


def save(out: Path, *cases: str) -> None:
    torch, dist, ps = _start(int(os.environ.get("WORLD_SIZE", "1")))
    for case in cases:
        target = out / case
        target.mkdir(parents=True, exist_ok=True)
        (target / "case.json").write_text(json.dumps(CASES[case]))
        try:
            _save(CASES[case], target, torch, dist, ps)
        except Exception as e:  # noqa: BLE001 - each save says its own failure; the next one runs
            import traceback
            print(f"save {case}: FAILED {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}", flush=True)
    dist.destroy_process_group()


def _save(cfg: dict, out: Path, torch, dist, ps) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from mcore_checkpoints import _perturb

    from ckpt_tools.model.spec import ModelSpec
    spec = ModelSpec.from_dict(cfg["model"])
    padded = spec.padded_vocab_size(cfg["tp"])
    model = build(cfg, padded)
    _perturb(model, torch)
    tokens = torch.randint(0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7))
    logits = forward(model, tokens, torch)
    tp_rank = ps.get_tensor_model_parallel_rank()
    if cfg.get("fp8"):  # Transformer Engine's FP8 GEMMs fill each layer's scales and amax history (its extra state)
        model.config.fp8, model.config.fp8_recipe = "hybrid", "delayed"
        for _ in range(2):
            forward(model, tokens, torch)
    if tp_rank == 0:
        torch.save({"tokens": tokens, "logits": logits}, out / "reference.pt")
    torch.save({k: v.detach().cpu().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)
                and not k.endswith("_extra_state")}, out / f"local_tp{tp_rank}.pt")
    args = _args(spec, cfg, padded)
    rng = [{"random_rng_state": None, "np_rng_state": None, "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": torch.cuda.get_rng_state(), "rng_tracker_states": {}}]
    name = f"iter_{ITERATION:07d}"
    state = {"args": args, "iteration": ITERATION, "checkpoint_version": 3.0, "model": model.sharded_state_dict(),
             "rng_state": ShardedObject("rng_state", rng, (1, cfg["tp"]), (0, tp_rank), replica_id=0)}
    if dist.get_rank() == 0:
        (out / "torch_dist" / name).mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(state, str(out / "torch_dist" / name))
    path = out / "torch" / name / f"mp_rank_{tp_rank:02d}" / "model_optim_rng.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    legacy = vars(args).copy()
    legacy["ckpt_format"] = "torch"
    import argparse
    torch.save({"args": argparse.Namespace(**legacy), "iteration": ITERATION, "checkpoint_version": 3.0,
                "model": model.state_dict_for_save_checkpoint(), "rng_state": rng}, path)
    dist.barrier()
    if dist.get_rank() == 0:
        for form in ("torch_dist", "torch"):
            (out / form / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    dist.barrier()


def load(*triples: str) -> None:
    torch, dist, ps = _start(int(os.environ.get("WORLD_SIZE", "1")))
    for i in range(0, len(triples), 3):
        case, save_dir, out = triples[i:i + 3]
        try:
            _load({**CASES[case], "tp": ps.get_tensor_model_parallel_world_size()}, Path(save_dir), Path(out), torch,
                  dist, ps)
        except Exception as e:  # noqa: BLE001 - each load says its own failure; the next one runs
            print(f"load {case} {save_dir}: FAILED {type(e).__name__}: {e}", flush=True)
    dist.destroy_process_group()


def _load(cfg: dict, save_dir: Path, out: Path, torch, dist, ps) -> None:
    from megatron.core import dist_checkpointing

    from ckpt_tools.model.spec import ModelSpec
    tracker = (save_dir / "latest_checkpointed_iteration.txt").read_text().strip()
    iter_dir = save_dir / ("release" if tracker == "release" else f"iter_{int(tracker):07d}")
    spec = ModelSpec.from_dict(cfg["model"])
    rank_dir = iter_dir / f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
    if rank_dir.is_dir():  # Megatron-LM's legacy form
        state = torch.load(rank_dir / "model_optim_rng.pt", map_location="cpu", weights_only=False)
        padded = state["args"].padded_vocab_size
        model = build(cfg, padded)
        model.load_state_dict(state["model"], strict=True)
    else:
        common = dist_checkpointing.load_common_state_dict(str(iter_dir))
        padded = common["args"].padded_vocab_size
        model = build(cfg, padded)
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(iter_dir))
        model.load_state_dict(loaded["model"], strict=True)
    tokens = torch.randint(0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7))  # save's
    logits = forward(model, tokens, torch)
    if dist.get_rank() == 0:
        torch.save({"logits": logits}, out)
    dist.barrier()


if __name__ == "__main__":
    from mcore_checkpoints import run_as_script
    mode, *rest = sys.argv[1:]
    if mode == "save":
        run_as_script(save, Path(rest[0]), *rest[1:])
    else:
        run_as_script(load, *rest)
