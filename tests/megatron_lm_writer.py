"""Test-side writer: one of OUR checkpoints -> a Megatron-LM checkpoint dir (DESIGN.md Contract 3).

The files look like what Megatron-LM's training loop saves with `--ckpt-format torch`: an
argparse.Namespace under Megatron-LM's argument names, the model state dict (our keys are
megatron-core's), iteration, checkpoint_version 3.0, rng_state as get_rng_state builds it (python,
numpy, torch, cuda RNG and the tracker states), a dummy optimizer and opt_param_scheduler. They are
written with plain torch.save, i.e. with real pickled Namespace / numpy objects, so reading them
exercises the loader's allow-list.
"""
from __future__ import annotations

import argparse
import random
from pathlib import Path

import numpy as np
import torch

from ckpt_tools import io
from ckpt_tools.checkpoint import Meta, model_file
from ckpt_tools.megatron_lm import TRACKER, model_path

PARAMS_DTYPE = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def megatron_args(meta: Meta, vocab_recorded: bool = True) -> argparse.Namespace:
    """A Namespace with the arguments Megatron-LM would have had for this model and layout."""
    s, cfg = meta.spec, meta.raw.get("config", {})
    rope = s.position_embedding_type == "rope"
    dtype = meta.raw.get("dtypes", {}).get("params", "float32")
    gqa = s.num_query_groups != s.num_attention_heads
    return argparse.Namespace(
        # network size
        num_layers=s.num_layers, hidden_size=s.hidden_size, ffn_hidden_size=s.ffn_hidden_size,
        num_attention_heads=s.num_attention_heads, group_query_attention=gqa,
        num_query_groups=s.num_query_groups if gqa else 1,  # Megatron-LM's default when GQA is off
        kv_channels=s.kv_channels, max_position_embeddings=s.max_position_embeddings,
        position_embedding_type=s.position_embedding_type, add_position_embedding=not rope,
        use_rotary_position_embeddings=False, rotary_base=int(s.rotary_base), rotary_percent=1.0,
        rotary_interleaved=False, rotary_seq_len_interpolation_factor=None,
        use_rope_scaling=s.rope_scaling == "llama3", rope_scaling_factor=s.rope_scaling_factor,
        normalization=s.normalization, norm_epsilon=s.norm_epsilon, apply_layernorm_1p=False,
        qk_layernorm=s.qk_layernorm, apply_residual_connection_post_layernorm=False,
        swiglu=s.activation == "swiglu", openai_gelu=False, squared_relu=False, quick_geglu=False,
        bias_gelu_fusion=s.add_bias_linear and s.activation == "gelu_tanh", bias_swiglu_fusion=True,
        add_bias_linear=s.add_bias_linear, add_qkv_bias=s.qkv_bias,
        untie_embeddings_and_output_weights=not s.tie_word_embeddings,
        make_vocab_size_divisible_by=s.make_vocab_size_divisible_by, padded_vocab_size=meta.padded_vocab,
        vocab_size=s.vocab_size if vocab_recorded else None,
        num_experts=None, multi_latent_attention=False, mtp_num_layers=None,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        transformer_impl="local", use_legacy_models=False, spec=None,
        # parallelism
        tensor_model_parallel_size=meta.tp_size, pipeline_model_parallel_size=meta.pp_size,
        virtual_pipeline_model_parallel_size=None, decoder_first_pipeline_num_layers=None,
        decoder_last_pipeline_num_layers=None, account_for_embedding_in_pipeline_split=False,
        account_for_loss_in_pipeline_split=False, pipeline_model_parallel_layout=None,
        context_parallel_size=1, expert_model_parallel_size=1, sequence_parallel=False,
        data_parallel_size=1, world_size=meta.tp_size * meta.pp_size, rank=0,
        use_distributed_optimizer=False,
        # precision
        bf16=dtype == "bfloat16", fp16=dtype == "float16", params_dtype=PARAMS_DTYPE[dtype],
        # training and data
        seq_length=cfg.get("seq_length", 64), micro_batch_size=cfg.get("micro_batch_size", 2),
        global_batch_size=cfg.get("micro_batch_size", 2), train_iters=cfg.get("train_iters", meta.iteration),
        lr=cfg.get("lr", 3e-3), min_lr=cfg.get("min_lr", 3e-4), lr_decay_style="cosine",
        lr_warmup_iters=cfg.get("lr_warmup_iters", 0), weight_decay=0.01, clip_grad=1.0,
        adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, seed=cfg.get("seed", 1234),
        consumed_train_samples=meta.raw.get("consumed_samples", 0), consumed_valid_samples=0,
        iteration=meta.iteration, tokenizer_type="HuggingFaceTokenizer", tokenizer_model="fixtures/tokenizer",
        ckpt_format="torch", save=None, load=None, save_interval=meta.iteration, no_save_optim=None,
        no_save_rng=None, data_parallel_random_init=False,
    )


def _rng_state() -> list[dict]:
    return [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": None, "rng_tracker_states": {}}]


def _optimizer(n_params: int, lr: float) -> dict:
    """Megatron's FP32Optimizer.state_dict(): torch Adam's state_dict (left empty here)."""
    return {"optimizer": {"state": {}, "param_groups": [{
        "lr": lr, "weight_decay": 0.01, "betas": (0.9, 0.95), "eps": 1e-8, "amsgrad": False,
        "wd_mult": 1.0, "lr_mult": 1.0, "is_decoupled_lr": False, "params": list(range(n_params))}]},
        "fp32_from_fp16_params": []}


def write_megatron_lm(ckpt_dir: Path, out_dir: Path, vocab_recorded: bool = True) -> Path:
    """Convert our `checkpoint-N` dir into Megatron-LM's layout under out_dir; returns out_dir."""
    meta = Meta.read(ckpt_dir)
    args = megatron_args(meta, vocab_recorded)
    iter_dir = Path(out_dir) / f"iter_{meta.iteration:07d}"
    scheduler = {"max_lr": args.lr, "lr_warmup_steps": args.lr_warmup_iters * args.global_batch_size,
                 "num_steps": args.consumed_train_samples, "lr_decay_style": "cosine",
                 "lr_decay_steps": args.train_iters * args.global_batch_size, "min_lr": args.min_lr,
                 "start_wd": 0.01, "end_wd": 0.01, "wd_incr_style": "constant", "wd_incr_steps": 0}
    for pp_rank in range(meta.pp_size):
        for tp_rank in range(meta.tp_size):
            model = io.load_file(Path(ckpt_dir) / model_file(tp_rank, pp_rank))["model"]
            path = model_path(iter_dir, tp_rank, pp_rank, meta.pp_size)
            path.parent.mkdir(parents=True, exist_ok=True)
            n_params = sum(1 for v in model.values() if torch.is_tensor(v))
            torch.save({"args": args, "checkpoint_version": 3.0, "iteration": meta.iteration, "model": model,
                        "optimizer": _optimizer(n_params, args.lr), "opt_param_scheduler": scheduler,
                        "rng_state": _rng_state()}, path)
    (Path(out_dir) / TRACKER).write_text(str(meta.iteration))
    return Path(out_dir)
