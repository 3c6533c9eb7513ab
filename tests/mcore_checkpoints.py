"""Real Megatron-LM checkpoints, written by megatron-core itself, and megatron-core's own logits.

Run under torchrun with TP x PP (x EP) processes (gloo, CPU):

    torchrun --nproc-per-node TP*PP*EP tests/mcore_checkpoints.py CONFIG.json OUT

CONFIG.json: {"model": ModelSpec fields, "tp": T, "pp": P, "iteration": N, optional "dtype": "bfloat16" (the
weights' dtype, as --bf16 keeps them; default float32), "ep": E (an MoE model's expert parallelism over E
data-parallel ranks), "etp": ETP (--expert-tensor-parallel-size, default TP), "grouped": true (an MoE model
also saved from megatron-core's GroupedMLP experts, --moe-grouped-gemm) and "forward": false (no reference logits: for the
benchmark's large checkpoints, benchmarks/megatron_forms.py)}. Each rank builds megatron-core's
`GPTModel` (local spec, as tests/mcore_reference_child.py does), makes its norm weights and biases non-trivial
(replicas equal), runs megatron-core's own forward on fixed tokens through the pipeline, and saves the model
the ways Megatron-LM's `save_checkpoint` does:

    OUT/torch_dist/  latest_checkpointed_iteration.txt, iter_NNNNNNN/{.metadata, __*_*.distcp, common.pt,
                     metadata.json}: `dist_checkpointing.save` of {args, iteration, checkpoint_version,
                     model: GPTModel.sharded_state_dict(), rng_state: ShardedObject}
    OUT/torch/       iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt: torch.save of {args, iteration,
                     checkpoint_version, model: GPTModel.state_dict_for_save_checkpoint(), rng_state}
    OUT/torch_te/    the same with Transformer Engine's key names, renamed by the map megatron-core's local
                     spec itself declares for that purpose (`sharded_state_dict_keys_map`)
    OUT/grouped_torch_dist/, OUT/grouped_torch/   with "grouped": a GroupedMLP model loaded by dist_checkpointing from
                     OUT/torch_dist, saved again: the experts as its weight1/weight2 tensors in the legacy form
    OUT/grouped_torch_te/  the legacy form with TEGroupedMLP's names (Transformer Engine's GroupedLinear: weight{e})
    OUT/tokens.pt, OUT/logits.pt   tokens [b, s] and megatron-core's logits [b, s, padded vocab] (fp32)
    OUT/mtp_logits.pt  with multi-token prediction layers: each depth's logits [depths, b, s, padded vocab]

CPU shims (the model's math is untouched): `Tensor.cuda` is the identity, `torch.cuda.current_device` is
"cpu", `torch.cuda.synchronize` does nothing, the CUDA RNG tracker's fork is a no-op (no dropout), and the
causal mask is passed explicitly (megatron-core would build its default one on "cuda").
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import types
import warnings
from pathlib import Path

BATCH, SEQ = 2, 16


def _shim_cuda(torch) -> None:
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None


def shim_masks() -> None:
    """megatron-core's sliding-window mask is made on "cuda": the same mask made on the CPU (after megatron-core is
    imported)."""
    import torch
    from megatron.core.fusions import fused_softmax

    def mask(sq, skv, window_size):
        m = torch.ones(sq, skv, dtype=torch.bool)
        return ~torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])
    fused_softmax.get_sliding_window_causal_mask = mask


def _perturb(model, torch) -> None:
    """Norm weights and biases are ones and zeros at init: give them values (the same on every TP rank,
    seeded by the parameter's global layer and name), so that a misplaced one changes the logits."""
    offset = model.decoder.layers[0].layer_number - 1 if len(model.decoder.layers) else 0
    for name, p in model.named_parameters():
        if not (name.endswith(("bias", "softmax_offset")) or "norm" in name):
            continue
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:
            parts[2] = str(int(parts[2]) + offset)
        if name.endswith("softmax_offset"):  # GPT-OSS's sinks: split over TP by heads, each rank its own
            parts.append(str(_tp_rank()))
        g = torch.Generator().manual_seed(_stable(".".join(parts)))
        full = torch.randn(p.shape, generator=g) * 0.2
        with torch.no_grad():
            p.copy_(full + (1.0 if "norm" in name and name.endswith("weight") else 0.0))
    for name, b in model.named_buffers():  # DeepSeek's expert bias (zeros at init) steers the routing
        if name.endswith("expert_bias"):
            g = torch.Generator().manual_seed(_stable(name))
            with torch.no_grad():
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)


def _tp_rank() -> int:
    from megatron.core import parallel_state as ps
    return ps.get_tensor_model_parallel_rank()


def _stable(text: str) -> int:
    import zlib
    return zlib.crc32(text.encode())


def _forward(model, tokens, torch, mtp: list | None = None):
    """megatron-core's own forward through the pipeline (gloo send/recv); the last stage returns the
    logits gathered over TP [b, s, padded vocab], other stages None. A model with multi-token prediction layers runs
    them (megatron-core does with labels) and appends each depth's logits [b, s, padded vocab] to `mtp`: its output
    layer's outputs, the MTP depths' first, the model's own last."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    b, s = tokens.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, -1)
    mask = torch.triu(torch.ones(s, s), 1).bool()[None, None]
    if not ps.is_pipeline_first_stage():
        x = torch.empty(s, b, model.config.hidden_size)
        dist.recv(x, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(x)
    depths = model.config.mtp_num_layers or 0
    outputs = []
    # a copy: megatron-core's cross entropy turns the logits into probabilities in place
    hook = model.output_layer.register_forward_hook(lambda m, i, o: outputs.append(o[0].transpose(0, 1).clone())) \
        if depths and ps.is_pipeline_last_stage() else None
    with torch.no_grad():
        out = model(tokens, positions, mask, labels=tokens if depths else None)
    if not ps.is_pipeline_last_stage():
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    if hook is not None:
        hook.remove()
        *depth_logits, out = outputs
        if mtp is not None:
            mtp.extend(_gather_vocab(t, torch) for t in depth_logits)
    return _gather_vocab(out, torch)


def _gather_vocab(out, torch):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    parts = [torch.empty_like(out) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1).float()


def sharding_metadata() -> dict:
    """What Megatron-LM's save_checkpoint passes to `sharded_state_dict(metadata=...)` that the model reads: the
    data-parallel group (a multi-token prediction stage's embedding copy is a replica over it)."""
    from megatron.core import parallel_state as ps
    return {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}


def _args(spec, tp: int, pp: int, padded: int, iteration: int, dtype: str) -> argparse.Namespace:
    from megatron_lm_writer import megatron_args
    meta = types.SimpleNamespace(spec=spec, raw={"dtypes": {"params": dtype}, "config": {}}, padded_vocab=padded,
                                 tp_size=tp, pp_size=pp, iteration=iteration)
    args = megatron_args(meta, vocab_recorded=False)
    args.ckpt_format = "torch_dist"
    return args


def _te_names(state: dict, keys_map: dict[str, str]) -> dict:
    """The state dict with the names a Transformer Engine layer has (megatron-core's own map)."""
    out = {}
    for key, value in state.items():
        for local, te in keys_map.items():
            if f".{local}" in key:
                key = key.replace(f".{local}", f".{te}")
                break
        out[key] = value
    return out


def _te_grouped_names(state: dict) -> dict:
    """SequentialMLP's local_experts.{e}.linear_fc1.weight -> TEGroupedMLP's linear_fc1.weight{e} (Transformer
    Engine's GroupedLinear names its GEMMs' weights weight0..weightN-1, one extra state for all)."""
    import re
    out = {}
    for key, value in state.items():
        m = re.match(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias|_extra_state)$", key)
        if m is None:
            out[key] = value
        elif m.group(4) == "_extra_state":
            out.setdefault(f"{m.group(1)}{m.group(3)}._extra_state", value)
        else:
            out[f"{m.group(1)}{m.group(3)}.{m.group(4)}{m.group(2)}"] = value
    return out


def on_cpu(tp: int, pp: int, ep: int = 1, etp: int | None = None, newest: bool = False) -> None:
    """A torchrun process ready to build megatron-core's models on the CPU (gloo, the shims above) at TP x PP (x EP,
    experts over ETP ranks); `newest`: megatron-core 0.19 (tests/mcore_newest.py), else the installed 0.16."""
    warnings.filterwarnings("ignore")
    if newest:
        from mcore_newest import activate
        activate()
    import torch
    _shim_cuda(torch)
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo")
    if not newest:
        import trainer  # noqa: F401 (megatron-core imported as the trainer imports it: no CPU torch.compile wrappers)
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    shim_masks()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 expert_model_parallel_size=ep, expert_tensor_parallel_size=etp or tp)
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):  # megatron-core 0.16 names it without Transformer Engine too
        moe_utils.te_general_gemm = None
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


def main(config_path: str, out: str) -> None:
    from ckpt_tools.model.spec import ModelSpec
    cfg = json.loads(Path(config_path).read_text())
    tp, pp, iteration, ep = cfg["tp"], cfg["pp"], cfg.get("iteration", 5), cfg.get("ep", 1)
    spec = ModelSpec.from_dict(cfg["model"])
    from mcore_reference_child import expert_tp
    etp = cfg.get("etp", expert_tp(spec, tp))  # --expert-tensor-parallel-size (an MoE model's experts over ETP ranks)
    on_cpu(tp, pp, ep, etp)
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from mcore_reference_child import _build_model
    padded = spec.padded_vocab_size(tp)
    torch.manual_seed(1234)
    model = _build_model({**spec.to_dict(), "padded_vocab_size": padded, "ep": ep, "etp": etp}, tp, pp).eval()
    _perturb(model, torch)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    out_dir = Path(out)
    ep_rank = ps.get_expert_model_parallel_rank() if ep > 1 else None
    first_dp = ps.get_data_parallel_rank() == 0
    if cfg.get("forward", True):
        tokens = torch.randint(0, spec.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
        mtp: list = []
        logits = _forward(model, tokens, torch, mtp)
        if logits is not None and tp_rank == 0 and first_dp:
            torch.save(tokens, out_dir / "tokens.pt")
            torch.save(logits, out_dir / "logits.pt")
            if mtp:
                torch.save(torch.stack(mtp), out_dir / "mtp_logits.pt")
    dtype = cfg.get("dtype", "float32")
    model.to(getattr(torch, dtype))

    args = _args(spec, tp, pp, padded, iteration, dtype)
    args.expert_model_parallel_size, args.expert_tensor_parallel_size = ep, etp
    name = f"iter_{iteration:07d}"
    rng = [{"random_rng_state": None, "np_rng_state": None, "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": None, "rng_tracker_states": {}}]
    rank_dir = (f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")
                + (f"_{ep_rank:03d}" if ep_rank is not None else ""))  # Megatron-LM's get_checkpoint_name
    saves = first_dp or ep_rank is not None  # a data-parallel replica saves nothing (an EP rank its experts)

    def save(prefix: str, model, args, legacy_forms: dict) -> None:
        """What Megatron-LM's save_checkpoint writes: torch_dist (dist_checkpointing.save of {args, iteration,
        checkpoint_version, model: sharded_state_dict(), rng_state: ShardedObject}) and each legacy form given."""
        rng_object = ShardedObject("rng_state", rng, (pp, tp), (pp_rank, tp_rank),
                                   replica_id=ps.get_data_parallel_rank())
        state = {"args": args, "iteration": iteration, "checkpoint_version": 3.0,
                 "model": model.sharded_state_dict(metadata=sharding_metadata()), "rng_state": rng_object}
        dist_dir = out_dir / f"{prefix}torch_dist" / name
        if dist.get_rank() == 0:
            dist_dir.mkdir(parents=True)
        dist.barrier()
        dist_checkpointing.save(state, str(dist_dir))
        for form, model_state in legacy_forms.items() if saves else ():
            path = out_dir / f"{prefix}{form}" / name / rank_dir / "model_optim_rng.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"args": args, "iteration": iteration, "checkpoint_version": 3.0, "model": model_state,
                        "rng_state": rng}, path)
        forms.extend(f"{prefix}{f}" for f in ("torch_dist", *legacy_forms))

    forms: list[str] = []
    local = model.state_dict_for_save_checkpoint()
    keys_map = model.decoder.layers[0].submodules_config.sharded_state_dict_keys_map if len(model.decoder.layers) else {}
    save("", model, args, {"torch": local, "torch_te": _te_names(local, keys_map)})
    if cfg.get("grouped"):  # --moe-grouped-gemm: megatron-core loads the torch_dist save into its GroupedMLP experts
        grouped = _build_model({**spec.to_dict(), "padded_vocab_size": padded, "ep": ep, "etp": etp}, tp, pp, grouped=True)
        grouped.to(getattr(torch, dtype))
        loaded = dist_checkpointing.load({"model": grouped.sharded_state_dict()}, str(out_dir / "torch_dist" / name))
        grouped.load_state_dict(loaded["model"])
        args = argparse.Namespace(**{**vars(args), "moe_grouped_gemm": True, "moe_use_legacy_grouped_gemm": True})
        save("grouped_", grouped, args, {"torch": grouped.state_dict_for_save_checkpoint()})
        te_args = argparse.Namespace(**{**vars(args), "moe_use_legacy_grouped_gemm": False})
        if saves:  # TEGroupedMLP's legacy names: Transformer Engine's GroupedLinear holds expert i as weight{i}
            path = out_dir / "grouped_torch_te" / name / rank_dir / "model_optim_rng.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"args": te_args, "iteration": iteration, "checkpoint_version": 3.0,
                        "model": _te_grouped_names(_te_names(local, keys_map)), "rng_state": rng}, path)
        forms.append("grouped_torch_te")
    dist.barrier()
    if dist.get_rank() == 0:
        for form in forms:
            (out_dir / form / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    dist.barrier()
    dist.destroy_process_group()


def save_dcp(state: dict, root: Path, form: str, iteration: int) -> None:
    """What Megatron-LM's save_checkpoint does for its DCP forms (torch_dcp, fsdp_dtensor): `torch.distributed.
    checkpoint.save` of the state dict into ROOT/FORM/iter_NNNNNNN, then the tracker (rank 0). Every rank calls it."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    iter_dir = root / form / f"iter_{iteration:07d}"
    if dist.get_rank() == 0:
        iter_dir.mkdir(parents=True)
    dist.barrier()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(iter_dir)))
    dist.barrier()
    if dist.get_rank() == 0:
        (root / form / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def run_as_script(main, *args) -> None:
    """Run a torchrun script's main, then leave at once: dist_checkpointing's results-queue manager process would
    outlive us, holding the pipes torchrun waits on. tests/ goes last on sys.path: its helpers import, but nothing
    there shadows a package."""
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
        sys.path.append(sys.path.pop(0))
    main(*args)
    import multiprocessing
    for child in multiprocessing.active_children():
        child.terminate()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    run_as_script(main, sys.argv[1], sys.argv[2])
