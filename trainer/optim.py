"""AdamW over fp32 master weights, Megatron's LR schedule, and global-norm gradient clipping."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from ckpt_tools import layout
from trainer.config import TrainConfig
from trainer.model import GPTStage


def lr_at(cfg: TrainConfig, iteration: int) -> float:
    """Linear warmup to `lr`, then cosine decay to `min_lr` at lr_decay_iters (Megatron's schedule)."""
    warmup = cfg.lr_warmup_iters
    if warmup > 0 and iteration < warmup:
        return cfg.lr * (iteration + 1) / warmup
    decay = cfg.lr_decay_iters or cfg.train_iters
    if iteration >= decay:
        return cfg.min_lr
    ratio = (iteration - warmup) / max(1, decay - warmup)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * ratio))


class MasterAdamW:
    """torch AdamW stepping fp32 masters; bf16 model weights are refreshed from them after a step.

    In fp32 the master is the parameter itself. State is exposed per parameter key, so that the
    optimizer file is keyed like the model file and does not depend on DP.
    """

    def __init__(self, stage: GPTStage, cfg: TrainConfig):
        self.named = list(stage.named_parameters())
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone() for _, p in self.named]
        decay = [m for (_, p), m in zip(self.named, self.masters) if p.dim() > 1]
        no_decay = [m for (_, p), m in zip(self.named, self.masters) if p.dim() <= 1]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)

    @torch.no_grad()
    def step(self, lr: float, grad_scale: float) -> None:
        for (_, p), m in zip(self.named, self.masters):
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            m.grad = g.float() if m is not p else g
            if grad_scale != 1.0:
                m.grad.mul_(grad_scale)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        for (_, p), m in zip(self.named, self.masters):
            if m is not p:
                p.copy_(m)

    def zero_grad(self) -> None:
        for _, p in self.named:
            p.grad = None
        for m in self.masters:
            m.grad = None

    def state_by_key(self) -> dict[str, dict[str, torch.Tensor]]:
        out = {}
        for (name, _), m in zip(self.named, self.masters):
            st = self.opt.state.get(m, {})
            out[name] = {"master": m.detach().clone() if m.dtype != torch.float32 else m.detach(),
                         "exp_avg": st.get("exp_avg", torch.zeros_like(m)),
                         "exp_avg_sq": st.get("exp_avg_sq", torch.zeros_like(m)),
                         "step": st.get("step", torch.tensor(0.0))}
        return out

    @torch.no_grad()
    def load_by_key(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        for (name, p), m in zip(self.named, self.masters):
            s = state[name]
            m.copy_(s["master"])
            if m is not p:
                p.copy_(m)
            if float(s["step"]) > 0:
                self.opt.state[m] = {"step": s["step"].detach().clone().float(),
                                     "exp_avg": s["exp_avg"].detach().clone().to(m.device),
                                     "exp_avg_sq": s["exp_avg_sq"].detach().clone().to(m.device)}


def counted_once(stage: GPTStage, tp_rank: int) -> list[torch.Tensor]:
    """Gradients that belong in the global norm: a TP-replicated tensor counts on TP rank 0 only,
    and the tied output copy on the last stage not at all (its embedding twin counts)."""
    keys = stage.global_keys()
    pp_size = len(stage.layer_counts)
    grads = []
    for name, p in stage.named_parameters():
        if p.grad is None:
            continue
        if layout.find_rule(keys[name], stage.spec, pp_size).split == layout.REPLICATED and tp_rank != 0:
            continue
        if name == "output_layer.weight" and stage.spec.tie_word_embeddings:
            continue
        grads.append(p.grad)
    return grads


def clip_coefficient(stage: GPTStage, tp_rank: int, max_norm: float) -> tuple[float, float]:
    """(global grad norm over TP x PP, the factor that clips it to max_norm)."""
    grads = counted_once(stage, tp_rank)
    device = grads[0].device if grads else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        sq += g.double().pow(2).sum()
    dist.all_reduce(sq, group=ps.get_model_parallel_group())
    norm = float(sq.sqrt())
    if max_norm <= 0 or norm <= max_norm:
        return norm, 1.0
    return norm, max_norm / (norm + 1e-6)
