"""What a resumable Megatron-LM torch_dist checkpoint holds beside the tensors (its common.pt), so that a run with
`--use-distributed-optimizer` resumes from a checkpoint we write: Adam's moments and the fp32 masters as
`optimizer.state.{param,exp_avg,exp_avg_sq}.<key>` (the `fully_reshardable` form, sharded like the weights, loaded
at any TP x PP x DP), and in common.pt

    optimizer          {"optimizer": {"param_groups": [...]}, "param_state_sharding_type": "fully_reshardable"}
    opt_param_scheduler  OptimizerParamScheduler.state_dict() (max_lr, lr_warmup_steps, num_steps, ...)
    content_metadata   {"distrib_optim_sharding_type": "fully_reshardable", ...}: how the loader builds its keys

megatron-core matches the param groups by (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr) and takes Adam's
step from them. A Megatron-LM source's groups and schedule are carried as it saved them (the step set to the one
read); ours are written from the trainer's config (its two groups: decayed, and biases and norms not decayed).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

from ckpt_tools.errors import FormatError

SHARDING = "fully_reshardable"
CONTENT_METADATA = {"distrib_optim_sharding_type": SHARDING, "singleton_local_shards": False,
                    "chained_optim_avoid_prefix": True}
# our optimizer field -> its name in the fully_reshardable keys
FIELD_NAMES = {"master": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
IDENTIFIERS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")
# what OptimizerParamScheduler.load_state_dict reads (each under one of its names, newest first)
SCHEDULER_KEYS = (("max_lr", "start_lr"), ("min_lr",), ("lr_warmup_steps", "warmup_steps", "warmup_iter"),
                  ("lr_decay_steps", "decay_steps", "end_iter"), ("lr_decay_style", "decay_style"),
                  ("num_steps", "num_iters"))
# what the trainer's config must say for Megatron-LM's schedule to be written from it
OUR_KEYS = ("lr", "min_lr", "train_iters", "micro_batch_size", "adam_beta1", "adam_beta2", "adam_eps", "weight_decay")


def decayed(key: str, shape: tuple[int, ...]) -> bool:
    """megatron-core's default weight-decay groups (`no_weight_decay_cond`): decay on the tensors of 2+ dims that are
    not biases, none on biases and 1-D parameters."""
    return len(shape) > 1 and not key.endswith(".bias")


def state_key(field: str, fqn: str) -> str:
    return f"optimizer.state.{FIELD_NAMES[field]}.{fqn}"


@dataclass
class ResumeState:
    iteration: int
    step: float
    consumed_samples: int
    param_groups: list[dict]
    scheduler: dict
    note: str  # where the groups and schedule came from, for the summary line

    def common(self) -> dict:
        """The common.pt entries of the optimizer (beside args, iteration, checkpoint_version). Adam's step is an
        int, as megatron-core saves it: Transformer Engine's and Apex's FusedAdam pass it on as a C++ int."""
        step = int(self.step) if float(self.step).is_integer() else self.step
        groups = [{**g, "step": step} for g in self.param_groups]
        return {"optimizer": {"optimizer": {"param_groups": groups}, "param_state_sharding_type": SHARDING},
                "opt_param_scheduler": self.scheduler, "content_metadata": dict(CONTENT_METADATA)}


def from_megatron(where: object, groups, scheduler_where: object, scheduler, iteration: int, step: float,
                  consumed: int) -> ResumeState:
    """A Megatron-LM source's param groups and scheduler state, as its optimizer saved them."""
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups):
        raise FormatError(f"{where}: no optimizer param groups (found {type(groups).__name__}): Megatron-LM saves them "
                          f"with the optimizer state; restore the checkpoint, or pass --no-optimizer")
    missing = sorted({k for g in groups for k in IDENTIFIERS if k not in g and f"pre_{k}" not in g})
    if missing:
        raise FormatError(f"{where}: the optimizer's param groups lack {', '.join(missing)} (megatron-core matches "
                          f"groups by {', '.join(IDENTIFIERS)}): written by a Megatron-LM this version does not "
                          f"write for; pass --no-optimizer")
    if not isinstance(scheduler, dict):
        raise FormatError(f"{scheduler_where}: no opt_param_scheduler state (found {type(scheduler).__name__}): restore the "
                          f"checkpoint, or pass --no-optimizer")
    lacking = [names[0] for names in SCHEDULER_KEYS if not any(n in scheduler for n in names)]
    if lacking:
        raise FormatError(f"{scheduler_where}: the opt_param_scheduler state lacks {', '.join(lacking)} (found "
                          f"{', '.join(sorted(map(str, scheduler))) or 'nothing'}), which Megatron-LM's scheduler "
                          f"reads at load: restore the checkpoint, or pass --no-optimizer")
    kept = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in groups]
    return ResumeState(iteration, step, consumed, kept, copy.deepcopy(scheduler), "its param groups and schedule")


def from_ours(where: Path, config: dict, dp_size: int | None, iteration: int, step: float,
              consumed: int) -> ResumeState:
    """Megatron-LM's param groups and scheduler state for a checkpoint of our trainer (its config.yaml values).
    Refused when the config does not say them (a checkpoint not trained by the trainer, e.g. a Megatron-LM one
    resharded into our format): a made-up schedule would win silently at load."""
    lacking = [k for k in OUR_KEYS if config.get(k) is None]
    if lacking or not (config.get("global_batch_size") or dp_size):
        raise FormatError(f"{where}: its config does not say {', '.join(lacking) or 'the data-parallel size'}, so "
                          f"Megatron-LM's param groups and LR schedule cannot be written for its optimizer state: "
                          f"pass --no-optimizer (Megatron-LM then starts a fresh optimizer)")
    try:
        lr, min_lr, weight_decay = float(config["lr"]), float(config["min_lr"]), float(config["weight_decay"])
        micro, micros = int(config["micro_batch_size"]), int(config.get("num_micro_batches") or 1)
        gbs = int(config.get("global_batch_size") or micro * micros * int(dp_size))
        train_iters = int(config["train_iters"])
        decay_iters = int(config.get("lr_decay_iters") or train_iters)
        warmup = int(config.get("lr_warmup_iters") or 0)
        betas = (float(config["adam_beta1"]), float(config["adam_beta2"]))
        eps = float(config["adam_eps"])
    except (TypeError, ValueError) as e:
        raise FormatError(f"{where}: its config holds a value that is not a number ({e}): restore meta.json, or "
                          f"pass --no-optimizer") from None
    base = {"lr": lr, "betas": betas, "eps": eps, "amsgrad": False, "maximize": False, "foreach": None,
            "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": True,
            "bias_correction": True, "adam_w_mode": True, "max_lr": lr, "min_lr": min_lr, "lr_mult": 1.0,
            "is_expert_parallel": False, "is_decoupled_lr": False, "default_config": True}
    groups = [{**base, "wd_mult": 1.0, "weight_decay": weight_decay},
              {**base, "wd_mult": 0.0, "weight_decay": weight_decay}]
    scheduler = {"max_lr": lr, "lr_warmup_steps": warmup * gbs, "num_steps": iteration * gbs,
                 "lr_decay_style": "cosine", "lr_decay_steps": decay_iters * gbs, "min_lr": min_lr,
                 "start_wd": weight_decay, "end_wd": weight_decay, "wd_incr_style": "constant",
                 "wd_incr_steps": train_iters * gbs}
    return ResumeState(iteration, step, consumed or iteration * gbs, groups, scheduler,
                       "param groups and schedule from the trainer's config")


def resume_state(shards) -> ResumeState:
    """What Megatron-LM needs to resume beside the tensors, from a source's reader (shards.Reader): the source's own
    param groups and schedule when it is a Megatron-LM checkpoint, else Megatron-LM's for the trainer's config."""
    meta = shards.meta
    consumed = int(meta.raw.get("consumed_samples") or 0)
    saved = shards.megatron_optimizer()
    if saved is not None:
        where, groups, scheduler_where, scheduler = saved
        return from_megatron(where, groups, scheduler_where, scheduler, meta.iteration, shards.step(), consumed)
    return from_ours(meta.dir / "meta.json", dict(meta.raw.get("config") or {}),
                     meta.raw.get("parallel", {}).get("dp_size"), meta.iteration, shards.step(), consumed)
