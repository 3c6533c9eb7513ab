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
from ckpt_tools.forms.checkpoint import Meta, model_file
from ckpt_tools.forms.megatron_args import build_args
from ckpt_tools.forms.megatron_lm import TRACKER, model_path
from ckpt_tools.model.ranks import Rank



def megatron_args(meta: Meta, vocab_recorded: bool = True) -> argparse.Namespace:
    """A Namespace with the arguments Megatron-LM would have had for this model and layout: the package's
    model and layout fields (ckpt_tools.forms.megatron_args), and a training run's."""
    cfg = meta.raw.get("config", {})
    dtype = meta.raw.get("dtypes", {}).get("params", "float32")
    args = build_args(meta.spec, meta.tp_size, list(getattr(meta, "layer_counts", None) or
                                                    [meta.spec.num_layers // meta.pp_size] * meta.pp_size),
                      meta.padded_vocab, dtype, "torch", meta.iteration, "fixtures/tokenizer")
    vars(args).update(
        vocab_size=meta.spec.vocab_size if vocab_recorded else None, init_method_std=0.02,
        data_parallel_size=1, world_size=meta.tp_size * meta.pp_size, rank=0, use_distributed_optimizer=False,
        seq_length=cfg.get("seq_length", 64), micro_batch_size=cfg.get("micro_batch_size", 2),
        global_batch_size=cfg.get("micro_batch_size", 2), train_iters=cfg.get("train_iters", meta.iteration),
        lr=cfg.get("lr", 3e-3), min_lr=cfg.get("min_lr", 3e-4), lr_decay_style="cosine",
        lr_warmup_iters=cfg.get("lr_warmup_iters", 0), weight_decay=0.01, clip_grad=1.0,
        adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, seed=cfg.get("seed", 1234),
        consumed_train_samples=meta.raw.get("consumed_samples", 0), save=None, load=None,
        save_interval=meta.iteration, no_save_optim=None, no_save_rng=None, data_parallel_random_init=False)
    return args


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
            model = io.load_file(Path(ckpt_dir) / model_file(Rank(tp_rank, pp_rank)))["model"]
            path = model_path(iter_dir, Rank(tp_rank, pp_rank), meta.pp_size)
            path.parent.mkdir(parents=True, exist_ok=True)
            n_params = sum(1 for v in model.values() if torch.is_tensor(v))
            torch.save({"args": args, "checkpoint_version": 3.0, "iteration": meta.iteration, "model": model,
                        "optimizer": _optimizer(n_params, args.lr), "opt_param_scheduler": scheduler,
                        "rng_state": _rng_state()}, path)
    (Path(out_dir) / TRACKER).write_text(str(meta.iteration))
    return Path(out_dir)
