"""Fixtures of Megatron-LM's LEGACY models (`--use-legacy-models`, `language_model.*` keys), written by Megatron-LM's
own legacy GPTModel (megatron/legacy/model, removed from Megatron-LM after core_v0.16.1, so not in CI) on CPU:

    git -C <Megatron-LM clone> archive core_v0.16.1 megatron | tar -x -C /tmp/mlm
    MLM=/tmp/mlm torchrun --nproc-per-node 2 tests/legacy_megatron_checkpoints.py fixtures/megatron_legacy CASE

CASE is one of CASES (each at TP x PP = 2 processes). The model is built from Megatron-LM's own argument parser
(`parse_args` + `validate_args` + `core_transformer_config_from_args`), run forward on fixed tokens (the pipeline
by send/recv, the vocab-parallel logits gathered over TP), and saved as Megatron-LM's save_checkpoint does in the
torch form: `iter_0000001/mp_rank_TT[_PPP]/model_optim_rng.pt` = {args, checkpoint_version 3.0, iteration, model:
state_dict_for_save_checkpoint()}. OUT/CASE/reference.pt holds the tokens and the logits [b, s, padded vocab].

Megatron-LM needs a CUDA machine and some compiled kernels; these CPU stand-ins change no arithmetic:
megatron.training's package __init__ (tokenizers, wandb...) is skipped, Apex's fused layer norm is F.layer_norm,
the CUDA global memory buffer and RNG tracker are CPU allocations and no-ops, `.cuda()` is the identity.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import types
from pathlib import Path

COMMON = ["--use-legacy-models", "--ckpt-format", "torch", "--transformer-impl", "local", "--hidden-size", "64",
          "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
          "--micro-batch-size", "1", "--global-batch-size", "1", "--tokenizer-type", "NullTokenizer",
          "--vocab-size", "127", "--hidden-dropout", "0", "--attention-dropout", "0", "--no-masked-softmax-fusion",
          "--no-bias-dropout-fusion", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
          "--use-cpu-initialization", "--attention-softmax-in-fp32"]
CASES = {
    # Llama-style: RMSNorm, rope, SwiGLU, grouped-query attention, untied, no biases; TP2 (one query group per rank)
    "llama_tp2": (2, 1, ["--num-layers", "2", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                         "--no-rope-fusion", "--swiglu", "--ffn-hidden-size", "96", "--disable-bias-linear",
                         "--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
                         "--no-bias-gelu-fusion"]),
    # GPT-2-style: LayerNorm, learned positions, biases, GELU (Megatron-LM's default fused tanh GELU), tied; PP2
    # (the last stage holds the head's copy of the embedding, `word_embeddings_for_head`)
    "gpt_pp2": (1, 2, ["--num-layers", "4"]),
}
PADDED_VOCAB = 128


def _megatron(mlm: str, argv: list[str]):
    """Megatron-LM's own args and legacy GPTModel class, with the CPU stand-ins."""
    sys.path.insert(0, mlm)
    import torch
    import megatron  # noqa: F401
    training = types.ModuleType("megatron.training")
    training.__path__ = [os.path.join(mlm, "megatron/training")]
    sys.modules["megatron.training"] = training
    state = {}
    training.get_args = lambda: state["args"]
    training.get_timers = lambda: None
    for name in ("get_adlr_autoresume", "get_signal_handler", "get_tokenizer", "get_tensorboard_writer",
                 "get_wandb_writer", "get_one_logger"):
        setattr(training, name, lambda: None)
    import megatron.training.arguments as arguments
    arguments.get_device_arch_version = lambda: 10  # validate_args asks cuda:0 at TP > 1
    sys.modules.setdefault("fused_layer_norm_cuda", types.ModuleType("fused_layer_norm_cuda"))
    import megatron.legacy.model.fused_layer_norm as fln
    fln.fused_layer_norm_affine = lambda x, w, b, shape, eps: torch.nn.functional.layer_norm(x, shape, w, b, eps)
    sys.argv = ["pretrain_gpt.py"] + argv
    args = arguments.parse_args()
    arguments.validate_args(args)
    from megatron.core.enums import ModelType
    args.padded_vocab_size = PADDED_VOCAB  # what the tokenizer builder sets (127 padded to a multiple of 128)
    args.model_type = ModelType.encoder_or_decoder  # what pretrain() sets
    args.apply_layernorm_1p = getattr(args, "layernorm_zero_centered_gamma", False)
    state["args"] = args
    return args, arguments.core_transformer_config_from_args(args)


def main(out: str, case: str) -> None:
    import torch
    import torch.distributed as dist
    tp, pp, extra = CASES[case]
    args, config = _megatron(os.environ.get("MLM", "/tmp/mlm"), COMMON + extra + [
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)])
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    mpu.initialize_model_parallel(tp, pp)
    init_num_microbatches_calculator(0, None, args.global_batch_size, args.micro_batch_size, 1)

    class CpuBuffer:
        def get_tensor(self, shape, dtype, name, mem_alloc_context=None):
            return torch.empty(shape, dtype=dtype)

    class NoRng:
        def fork(self, *a, **k):
            return contextlib.nullcontext()

        def is_initialized(self):
            return False
    mpu.get_global_memory_buffer = lambda: CpuBuffer()
    tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: NoRng()
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.cuda.current_device = lambda: "cpu"
    import megatron.legacy.model.language_model as lm
    import megatron.legacy.model.transformer as lt
    from megatron.legacy.model import GPTModel
    lt.get_cuda_rng_tracker = tensor_parallel.get_cuda_rng_tracker
    lm.RotaryEmbedding = functools.partial(lm.RotaryEmbedding, use_cpu_initialization=True)
    torch.manual_seed(1234)
    first, last = mpu.is_pipeline_first_stage(), mpu.is_pipeline_last_stage()
    model = GPTModel(config, num_tokentypes=0, parallel_output=True, pre_process=first, post_process=last).eval()
    with torch.no_grad():  # norm weights and biases are ones and zeros at init: give them values
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name) + p.numel())) * 0.2)
    tokens = torch.randint(0, 127, (2, 16), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(16).unsqueeze(0).expand(2, -1)
    mask = torch.tril(torch.ones(1, 1, 16, 16)) < 0.5
    if not first:
        x = torch.empty(16, 2, 64)
        dist.recv(x, src=mpu.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(x)
    with torch.no_grad():
        output = model(tokens, positions, mask)
    if not last:
        dist.send(output.contiguous(), dst=mpu.get_pipeline_model_parallel_next_rank())
    tp_rank, pp_rank = mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank()
    root = Path(out) / case
    sub = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    path = root / "iter_0000001" / sub / "model_optim_rng.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 1, "model": model.state_dict_for_save_checkpoint(),
                "num_floating_point_operations_so_far": 0}, path)
    if last:
        parts = [torch.empty_like(output) for _ in range(tp)]
        dist.all_gather(parts, output.contiguous(), group=mpu.get_tensor_model_parallel_group())
        if tp_rank == 0:
            torch.save({"tokens": tokens, "logits": torch.cat(parts, dim=-1).float()}, root / "reference.pt")
            (root / "latest_checkpointed_iteration.txt").write_text("1")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
