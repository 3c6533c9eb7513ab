"""megatron-core 0.19 (the newest release) on this machine's Python 3.11 and CPU torch, as the reference for what
Megatron-LM saves today: its `GPTModel` and its `HybridModel` (the pattern-driven successor, `*-*-...`), built with
megatron-core's own local modules, run, saved by its own `dist_checkpointing.save`, and loaded back by its own
`dist_checkpointing.load`. Run under torchrun (gloo):

    torchrun --nproc-per-node TP*PP tests/mcore_newest.py save CONFIG.json OUT
    torchrun --nproc-per-node TP*PP tests/mcore_newest.py load CONFIG.json
    python tests/mcore_newest.py make fixtures/megatron_019 [CASE...]  # each case of CASES saved (the fixtures)

CONFIG.json: {"kind": "gpt" | "hybrid", "model": ModelSpec fields, "tp": T, "pp": P, "iteration": N,
"pattern": the hybrid layer pattern ("*-*-", "*E*E"), "tokens"/"load"/"out" (load: the save dir, tokens.pt, and where
the logits go)}. save writes OUT/torch_dist/ (megatron-core 0.19 embeds the common state, args included, in the
.distcp files: no common.pt), for a HybridModel also OUT/torch/ (Megatron-LM's legacy form: each rank's
`state_dict_for_save_checkpoint()`), and OUT/reference.pt {tokens, logits} (megatron-core's own logits, fp32).
load builds the model at this TP x PP (a HybridModel with the pattern the checkpoint's args record), loads the save dir's iter dir with `dist_checkpointing.load` of its
`sharded_state_dict()`, `load_state_dict(strict=True)`, and writes its logits and the loaded args' pattern.

The wheel says Python >= 3.12; its Python code runs here when torch (and its compiler modules) is imported first
and a stand-in `triton` answers megatron-core's module-level GPU-kernel imports (none of them runs on CPU).
MCORE_NEWEST names the unpacked wheel (scripts/setup_env.sh stages it into .venv/megatron-core-0.19.2).
The layers are megatron-core's local ones (Transformer Engine is not installable here) with the key map its local
GPT spec declares, so the torch_dist keys are the Transformer Engine names a GPU run saves; HybridStack's final norm
(Transformer Engine's TENorm in megatron-core) is its torch norm.
"""
from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import types
from pathlib import Path

from mcore_newest_blocks import (_hybrid_spec, _mamba_hybrid, _qwen3_next, _qwen3_next_config, stub_fla,
                                 stub_mamba_ssm)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT / ".venv" / "megatron-core-0.19.2"
_LLAMA = {"architecture": "llama", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
          "ffn_hidden_size": 96, "vocab_size": 127, "max_position_embeddings": 16}
_GPT2 = {"architecture": "gpt2", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128,
         "vocab_size": 127, "max_position_embeddings": 16}
_NEMOTRON_H = {**_LLAMA, "architecture": "nemotron_h", "num_layers": 4, "kv_channels": 16, "layer_pattern": "M*M-",
               "mamba_num_heads": 8, "mamba_head_dim": 16, "mamba_state_dim": 16, "mamba_num_groups": 2}
_QWEN3_NEXT = {**_LLAMA, "architecture": "qwen3_next", "num_layers": 4, "kv_channels": 16, "layer_pattern": "GEGEGE*E",
               "rotary_percent": 0.25, "norm_epsilon": 1e-6, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
               "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "num_moe_experts": 4,
               "moe_router_topk": 2, "moe_ffn_hidden_size": 32, "moe_shared_expert_intermediate_size": 48}
_DEEPSEEK_V3 = {**_LLAMA, "architecture": "deepseek_v3", "num_layers": 2, "num_query_groups": 4, "norm_epsilon": 1e-6,
                "q_lora_rank": 24, "kv_lora_rank": 16, "qk_head_dim": 12, "qk_pos_emb_head_dim": 8, "v_head_dim": 12,
                "num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32,
                "moe_shared_expert_intermediate_size": 32, "moe_router_num_groups": 2, "moe_router_group_topk": 1,
                "moe_router_topk_scaling_factor": 2.5, "layer_pattern": "+-+E"}
_ERNIE4_5 = {**_LLAMA, "architecture": "ernie4_5", "kv_channels": 24, "add_bias_linear": True}
# megatron-core 0.16.1's MambaModel (Megatron-LM's pretrain_mamba.py before the HybridModel, --hybrid-override-pattern)
# of the same Nemotron-H: run with the installed 0.16.1 ("mcore": "0.16"), saved into fixtures/megatron_mamba_016
OLDER = {"mamba_nemotron_h_tp2": {"kind": "hybrid", "mcore": "0.16", "pattern": "M*M-", "tp": 2, "pp": 1,
                                  "model": _NEMOTRON_H}}
# the committed fixtures (fixtures/megatron_019): megatron-core 0.19.2's GPTModel and HybridModel, TP and PP, tied and
# untied, dense and MoE
CASES = {
    "gpt_llama_tp2": {"kind": "gpt", "tp": 2, "pp": 1, "model": _LLAMA},
    "gpt_gpt2_pp2": {"kind": "gpt", "tp": 1, "pp": 2, "model": _GPT2},
    "hybrid_llama_tp2": {"kind": "hybrid", "pattern": "*-*-", "tp": 2, "pp": 1, "model": _LLAMA},
    "hybrid_gpt2_pp2": {"kind": "hybrid", "pattern": "*-|*-", "tp": 1, "pp": 2, "model": _GPT2},
    "hybrid_mixtral_tp2": {"kind": "hybrid", "pattern": "*E*E", "tp": 2, "pp": 1,
                           "model": {**_LLAMA, "architecture": "mixtral", "num_moe_experts": 4, "moe_router_topk": 2}},
    # GPT-OSS: sinks, an 8-position window on layer 0 (16 tokens), GPTModel's YaRN unrounded, biased experts (ETP 1)
    # with the clamped GLU of +1
    # Nemotron-H: a HybridModel of Mamba-2 (8 heads of 16 in 2 groups, a state of 16), attention without positions
    # and squared-ReLU MLP layers, megatron-core's own MambaMixer (its forward needs GPU kernels: no logits here)
    "hybrid_nemotron_h_tp2": {"kind": "hybrid", "pattern": "M*M-", "tp": 2, "pp": 1, "model": _NEMOTRON_H},
    # Qwen3-Next: gated DeltaNet layers (2 key heads of 8, 4 value heads of 8) and a gated attention layer, zero-centred
    # norms, a quarter of each head rotated, top-2 of 4 experts and a gated shared expert (GPTModel, the layers
    # Megatron-LM builds for --experimental-attention-variant gated_delta_net)
    "gpt_qwen3_next_tp2": {"kind": "gpt", "tp": 2, "pp": 1, "model": _QWEN3_NEXT},
    "hybrid_qwen3_next_tp2": {"kind": "hybrid", "pattern": "GEGEGE*E", "tp": 2, "pp": 1, "model": _QWEN3_NEXT},
    # DeepSeek-V3: multi-latent attention (q and kv latents, a rotary part per head), a dense first layer, then MoE
    # layers of sigmoid routing with an expert bias over groups, a shared expert
    "gpt_deepseek_v3_tp2": {"kind": "gpt", "tp": 2, "pp": 1, "model": _DEEPSEEK_V3},
    # ERNIE 4.5: RoPE on adjacent pairs of dims (rotary_interleaved), a bias on every linear layer, tied embeddings.
    # HybridModel's save is refused (megatron-core's HybridModel builds its rotary tables without the flag;
    # test_megatron_019): its torch_dist form only, without a reference
    "gpt_ernie4_5_tp2": {"kind": "gpt", "tp": 2, "pp": 1, "model": _ERNIE4_5},
    "hybrid_ernie4_5_tp2": {"kind": "hybrid", "pattern": "*-*-", "tp": 2, "pp": 1, "model": _ERNIE4_5,
                            "refused": True},
    # GLM-4: QKV biases, RoPE on the first half of each head in adjacent pairs
    "gpt_glm_tp2": {"kind": "gpt", "tp": 2, "pp": 1,
                    "model": {**_LLAMA, "architecture": "glm", "kv_channels": 24, "rotary_percent": 0.5}},
    "gpt_gpt_oss_tp2": {"kind": "gpt", "tp": 2, "pp": 1,
                        "model": {**_LLAMA, "architecture": "gpt_oss", "ffn_hidden_size": 32, "kv_channels": 16,
                                  "num_moe_experts": 4, "moe_router_topk": 2, "sliding_window": 8,
                                  "window_attn_skip_freq": 2, "activation_clamp": 7.0, "rope_scaling": "yarn",
                                  "rope_scaling_factor": 4.0, "rope_original_max_position_embeddings": 8,
                                  "rope_truncate": False, "rotary_base": 150000.0}},
}


def location() -> Path | None:
    """The unpacked megatron-core 0.19 wheel, or None when it is not staged."""
    path = Path(os.environ.get("MCORE_NEWEST", DEFAULT))
    return path if (path / "megatron" / "core" / "__init__.py").is_file() else None


def activate() -> None:
    """Make `import megatron.core` give megatron-core 0.19 in this process (see the module's docstring)."""
    import torch  # noqa: F401 - before the stand-in, so that torch's own triton probes see no triton
    for name in ("torch._dynamo", "functorch.compile", "torch._dynamo.debug_utils", "torch._inductor.codecache",
                 "torch._inductor.compile_fx"):
        with contextlib.suppress(ImportError):
            __import__(name)

    if importlib.util.find_spec("triton") is None:  # a GPU machine has the real one
        stand_in_triton()
    sys.path.insert(0, str(location()))
    for name in [n for n in sys.modules if n == "megatron" or n.startswith("megatron.")]:
        del sys.modules[name]


def stand_in_triton() -> None:
    """A stand-in `triton` for megatron-core's module-level GPU-kernel imports (none of them runs on the CPU)."""
    class Stand(types.ModuleType):
        __version__ = "3.4.0"

        def __getattr__(self, name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            return lambda *a, **k: a[0] if len(a) == 1 and callable(a[0]) and not k else (lambda fn: fn)

    for name in ("triton", "triton.language"):
        module = Stand(name)
        module.__spec__, module.__path__ = importlib.machinery.ModuleSpec(name, None), []
        sys.modules[name] = module
    sys.modules["triton"].language = sys.modules["triton.language"]


def build(cfg: dict, padded: int):
    """megatron-core 0.19's GPTModel or HybridModel for this rank (local modules)."""
    import torch
    from megatron.core import parallel_state
    from mcore_reference_child import _build_model

    from ckpt_tools.model.spec import ModelSpec
    spec = ModelSpec.from_dict(cfg["model"])
    tp, pp = cfg["tp"], cfg["pp"]
    if spec.hybrid:
        return _mamba_hybrid(spec, cfg, padded)
    if spec.linear_num_key_heads is not None and cfg["kind"] == "gpt":
        return _qwen3_next(spec, cfg, padded)
    if spec.linear_num_key_heads is not None:  # HybridModel's 'G', '*' and 'E' layers
        from megatron.core.models.hybrid.hybrid_model import HybridModel
        return HybridModel(config=_qwen3_next_config(spec, cfg), hybrid_stack_spec=_hybrid_spec(spec, torch),
                           vocab_size=padded, max_sequence_length=spec.max_position_embeddings,
                           hybrid_layer_pattern=cfg["pattern"], pre_process=parallel_state.is_pipeline_first_stage(),
                           post_process=parallel_state.is_pipeline_last_stage(),
                           share_embeddings_and_output_weights=spec.tie_word_embeddings, position_embedding_type="rope",
                           rotary_percent=spec.rotary_percent, rotary_base=int(spec.rotary_base))
    gpt = _build_model({**spec.to_dict(), "padded_vocab_size": padded}, tp, pp)
    if cfg["kind"] == "gpt":
        return gpt
    from megatron.core.models.hybrid.hybrid_model import HybridModel
    config = gpt.config
    config.num_layers = len(cfg["pattern"].replace("|", ""))
    return HybridModel(config=config, hybrid_stack_spec=_hybrid_spec(spec, torch), vocab_size=padded,
                       max_sequence_length=spec.max_position_embeddings, hybrid_layer_pattern=cfg["pattern"],
                       pre_process=parallel_state.is_pipeline_first_stage(),
                       post_process=parallel_state.is_pipeline_last_stage(),
                       share_embeddings_and_output_weights=spec.tie_word_embeddings,
                       position_embedding_type=spec.position_embedding_type, rotary_base=int(spec.rotary_base))


def _local_state(model) -> dict:
    """megatron-core's own shards of this rank: its model's state dict, tensors only (`_extra_state` is None)."""
    import torch
    return {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}


def _start(cfg: dict):
    if cfg.get("mcore") == "0.16":  # the installed megatron-core, imported as the trainer imports it
        import trainer  # noqa: F401
        stand_in_triton()
    else:
        activate()
    stub_mamba_ssm()
    stub_fla()
    import torch
    from mcore_checkpoints import _shim_cuda, shim_masks
    from mcore_reference_child import expert_tp

    from ckpt_tools.model.spec import ModelSpec
    _shim_cuda(torch)
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    shim_masks()
    ps.initialize_model_parallel(tensor_model_parallel_size=cfg["tp"], pipeline_model_parallel_size=cfg["pp"],
                                 expert_tensor_parallel_size=expert_tp(ModelSpec.from_dict(cfg["model"]), cfg["tp"]))
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    return torch, dist, ps


def save(cfg: dict, out: Path) -> None:
    torch, dist, ps = _start(cfg)
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from mcore_checkpoints import _args, _forward, _perturb

    from ckpt_tools.model.spec import ModelSpec
    spec = ModelSpec.from_dict(cfg["model"])
    tp, pp, iteration = cfg["tp"], cfg["pp"], cfg.get("iteration", 5)
    padded = spec.padded_vocab_size(tp)
    torch.manual_seed(1234)
    model = build(cfg, padded).eval()
    _perturb(model, torch)
    tokens = torch.randint(0, spec.vocab_size, (2, 16), generator=torch.Generator().manual_seed(7))
    logits = None if spec.hybrid else _forward(model, tokens, torch)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    refused = cfg.get("refused", False)  # a save `ckpt` refuses: its torch_dist form only, no reference
    if logits is not None and tp_rank == 0 and not refused:
        torch.save({"tokens": tokens, "logits": logits}, out / "reference.pt")
    if spec.hybrid:  # what each rank holds, by megatron-core's own modules
        torch.save(_local_state(model), out / f"local_tp{tp_rank}_pp{pp_rank}.pt")
    args = _args(spec, tp, pp, padded, iteration, "float32")
    if cfg["kind"] == "hybrid":  # what Megatron-LM's parser records for --hybrid-layer-pattern
        vars(args).update(hybrid_layer_pattern=cfg["pattern"], num_layers=len(cfg["pattern"].replace("|", "")),
                          is_hybrid_model=True, spec=["megatron.core.models.hybrid.hybrid_layer_specs",
                                                      "hybrid_stack_spec"])
    if cfg.get("mcore") == "0.16":  # pretrain_mamba.py's: the pattern under its older name
        vars(args).pop("hybrid_layer_pattern")
        vars(args).update(hybrid_override_pattern=cfg["pattern"], hybrid_attention_ratio=0.0, hybrid_mlp_ratio=0.0,
                          spec=["megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"])
    if spec.linear_num_key_heads is not None:  # what pretrain_gpt.py's (or pretrain_hybrid.py's, its pattern giving
        # the 'G' layers) command line for Qwen3-Next records
        vars(args).pop("hf_family", None)
        if cfg["kind"] == "gpt":
            vars(args).update(experimental_attention_variant="gated_delta_net", linear_attention_freq=4)
        vars(args).update(attention_output_gate=True, apply_layernorm_1p=True, qk_layernorm=True, swiglu=True,
                          rotary_percent=spec.rotary_percent, moe_shared_expert_gate=True, moe_layer_freq=1,
                          transformer_impl="transformer_engine",
                          **{k: getattr(spec, k) for k in ("linear_num_key_heads", "linear_num_value_heads",
                                                           "linear_key_head_dim", "linear_value_head_dim",
                                                           "linear_conv_kernel_dim")})
    if spec.hybrid:  # what pretrain_hybrid.py's command line for Nemotron-H records
        vars(args).pop("hf_family", None)
        vars(args).update(squared_relu=True, swiglu=False, position_embedding_type="none",
                          use_rotary_position_embeddings=False, normalization="RMSNorm",
                          **{k: getattr(spec, k) for k in ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups",
                                                           "mamba_num_heads")})
    rng = [{"random_rng_state": None, "np_rng_state": None, "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": None, "rng_tracker_states": {}}]
    name = f"iter_{iteration:07d}"
    state = {"args": args, "iteration": iteration, "checkpoint_version": 3.0, "model": model.sharded_state_dict(),
             "rng_state": ShardedObject("rng_state", rng, (pp, tp), (pp_rank, tp_rank), replica_id=0)}
    forms = ["torch_dist"]
    if dist.get_rank() == 0:
        (out / "torch_dist" / name).mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save(state, str(out / "torch_dist" / name))
    if cfg["kind"] == "hybrid" and not refused:
        rank_dir = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pp > 1 else "")
        path = out / "torch" / name / rank_dir / "model_optim_rng.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        args.ckpt_format = "torch"
        torch.save({"args": args, "iteration": iteration, "checkpoint_version": 3.0,
                    "model": model.state_dict_for_save_checkpoint(), "rng_state": rng}, path)
        forms.append("torch")
    dist.barrier()
    if dist.get_rank() == 0:
        for form in forms:
            (out / form / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    dist.barrier()
    dist.destroy_process_group()


def load(cfg: dict) -> None:
    torch, dist, ps = _start(cfg)
    from megatron.core import dist_checkpointing
    from mcore_checkpoints import _forward

    from ckpt_tools.model.spec import ModelSpec
    spec = ModelSpec.from_dict(cfg["model"])
    save_dir = Path(cfg["load"])
    iter_dir = save_dir / f"iter_{int((save_dir / 'latest_checkpointed_iteration.txt').read_text()):07d}" \
        if (save_dir / "latest_checkpointed_iteration.txt").read_text().strip() != "release" else save_dir / "release"
    common = dist_checkpointing.load_common_state_dict(str(iter_dir))
    padded = common["args"].padded_vocab_size
    if cfg["kind"] == "hybrid":  # the pattern the checkpoint records, as --use-checkpoint-args takes it
        args = common["args"]
        cfg = {**cfg, "pattern": getattr(args, "hybrid_layer_pattern", None) or args.hybrid_override_pattern}
    model = build(cfg, padded).eval()
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(iter_dir))
    model.load_state_dict(loaded["model"], strict=True)
    if spec.hybrid:  # no forward on the CPU: what each rank loaded, and megatron-core's own save of it
        _dump_and_save(cfg, model, common, iter_dir.name, torch, dist, ps)
        return
    tokens = torch.load(cfg["tokens"], weights_only=True)
    logits = _forward(model, tokens, torch)
    if logits is not None and ps.get_tensor_model_parallel_rank() == 0:
        args = common["args"]
        torch.save({"logits": logits, "pattern": getattr(args, "hybrid_layer_pattern", None),
                    "num_layers": args.num_layers}, cfg["out"])
    dist.barrier()
    dist.destroy_process_group()


def _dump_and_save(cfg: dict, model, common: dict, name: str, torch, dist, ps) -> None:
    """Each rank's loaded shards to OUT/local_tp<t>_pp<p>.pt, and megatron-core's own torch_dist save of the loaded
    model (the args it loaded with) to OUT/torch_dist."""
    from megatron.core import dist_checkpointing
    out = Path(cfg["out"])
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    torch.save(_local_state(model), out / f"local_tp{tp_rank}_pp{pp_rank}.pt")
    if dist.get_rank() == 0:
        (out / "torch_dist" / name).mkdir(parents=True)
    dist.barrier()
    dist_checkpointing.save({"args": common["args"], "iteration": common.get("iteration", 0),
                             "checkpoint_version": 3.0, "model": model.sharded_state_dict()},
                            str(out / "torch_dist" / name))
    dist.barrier()
    if dist.get_rank() == 0:
        (out / "torch_dist" / "latest_checkpointed_iteration.txt").write_text(
            "release" if name == "release" else str(int(name.split("_")[1])))
    dist.barrier()
    dist.destroy_process_group()


def make(out: str, *only: str) -> None:
    """Save every case of CASES (or those named) under `out` (each with megatron-core 0.19 under torchrun), replacing
    what is there."""
    import shutil
    import subprocess
    import tempfile
    for name, case in {**CASES, **{k: v for k, v in OLDER.items() if k in only}}.items():
        if only and name not in only:
            continue
        target = Path(out) / name
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump({**case, "iteration": 7}, f)
            f.flush()
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                            str(case["tp"] * case["pp"]), __file__, "save", f.name, str(target)], check=True)
        print(f"{target}: {', '.join(sorted(p.name for p in target.iterdir()))}")


def main(mode: str, config_path: str, out: str | None = None) -> None:
    import warnings
    warnings.filterwarnings("ignore")
    cfg = json.loads(Path(config_path).read_text())
    save(cfg, Path(out)) if mode == "save" else load(cfg)


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(*sys.argv[2:])
    else:
        from mcore_checkpoints import run_as_script
        run_as_script(main, *sys.argv[1:])
