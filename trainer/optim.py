"""AdamW over fp32 master weights, Megatron's LR schedule, and global-norm gradient clipping.

Two optimizers with one interface: `MasterAdamW` keeps every master and Adam moment on every
data-parallel rank (gradients all-reduced); `ShardedMasterAdamW` is Megatron's distributed
optimizer (ZeRO-1): the fp32 masters and moments are split over the DP ranks, gradients are
reduce-scattered, each rank steps its slice and the updated weights are all-gathered. Both expose
the state per parameter key, so the optimizer file on disk is the same for both and for any DP.

`step` takes no host sync: the grad norm, the clip factor and the learning-rate step stay on the
device (fused AdamW divides the gradients by its `grad_scale` inside the kernel).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from ckpt_tools import layout
from trainer.config import TrainConfig
from trainer.model import GPTStage

FIELDS = ("master", "exp_avg", "exp_avg_sq")


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


def counted_once(stage: GPTStage, tp_rank: int) -> list[bool]:
    """Per parameter: does its gradient belong in the global norm? A TP-replicated tensor counts on
    TP rank 0 only, and the tied output copy on the last stage not at all (its embedding twin counts)."""
    keys = stage.global_keys()
    pp_size = len(stage.layer_counts)
    flags = []
    for name, _ in stage.named_parameters():
        replicated = layout.find_rule(keys[name], stage.spec, pp_size).split == layout.REPLICATED
        tied_copy = name == "output_layer.weight" and stage.spec.tie_word_embeddings
        flags.append(not (replicated and tp_rank != 0) and not tied_copy)
    return flags


def _sum_of_squares(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64 if device.type == "cpu" else torch.float32, device=device)
    if tensors:
        norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
        total = total + torch.stack(norms).to(total.dtype).pow(2).sum()
    return total


def _groups(tensors: list[torch.Tensor], decays: list[bool], cfg: TrainConfig) -> list[dict]:
    return [{"params": [t for t, d in zip(tensors, decays) if d], "weight_decay": cfg.weight_decay},
            {"params": [t for t, d in zip(tensors, decays) if not d], "weight_decay": 0.0}]


class MasterAdamW:
    """torch's fused AdamW stepping fp32 masters; bf16 weights are refreshed from them after a step.

    In fp32 the master is the parameter itself. Gradients are averaged over DP in one flat
    all-reduce, copied into persistent fp32 buffers (bf16 runs), clipped by the global norm.
    """

    def __init__(self, stage: GPTStage, cfg: TrainConfig, dp_group=None):
        self.stage, self.dp_group = stage, dp_group
        self.dp = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.named = list(stage.named_parameters())
        self.params = [p for _, p in self.named]
        self.counted = counted_once(stage, ps.get_tensor_model_parallel_rank())
        self.mixed = any(p.dtype != torch.float32 for p in self.params)
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone() for p in self.params]
        self.opt = torch.optim.AdamW(_groups(self.masters, [p.dim() > 1 for p in self.params], cfg), lr=cfg.lr,
                                     betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, fused=True)

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]

    def _reduce_grads(self, grads: list[torch.Tensor]) -> None:
        """Average every gradient over the DP group: one all-reduce of one flat buffer."""
        if self.dp == 1:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.dp_group)
        flat /= self.dp
        torch._foreach_copy_(grads, [f.view_as(g) for f, g in zip(flat.split([g.numel() for g in grads]), grads)])

    @torch.no_grad()
    def step(self, lr: float, max_norm: float) -> torch.Tensor:
        """Reduce, clip and apply this step's gradients; returns the global grad norm (on device)."""
        grads = self._grads()
        self._reduce_grads(grads)
        if self.mixed:
            for m in self.masters:
                if m.grad is None:
                    m.grad = torch.empty_like(m)
            torch._foreach_copy_([m.grad for m in self.masters], grads)
            grads = [m.grad for m in self.masters]
        else:
            for m, g in zip(self.masters, grads):
                m.grad = g
        sq = _sum_of_squares([g for g, c in zip(grads, self.counted) if c], grads[0].device)
        return self._apply(sq, lr, max_norm)

    def _apply(self, sq: torch.Tensor, lr: float, max_norm: float) -> torch.Tensor:
        dist.all_reduce(sq, group=ps.get_model_parallel_group())
        norm = sq.sqrt()
        if max_norm > 0:  # grads are divided by grad_scale in the fused kernel: 1 when not clipped
            self.opt.grad_scale = torch.where(norm > max_norm, (norm + 1e-6) / max_norm, 1.0).float()
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        self._refresh_weights()
        return norm

    def _refresh_weights(self) -> None:
        if self.mixed:
            torch._foreach_copy_(self.params, self.masters)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

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
                self.opt.state[m] = {"step": s["step"].detach().clone().float().to(m.device),
                                     "exp_avg": s["exp_avg"].detach().clone().to(m.device),
                                     "exp_avg_sq": s["exp_avg_sq"].detach().clone().to(m.device)}


class ShardedMasterAdamW(MasterAdamW):
    """Megatron's distributed optimizer: DP rank r owns elements [r*c, (r+1)*c) of the flat
    parameter list (c = ceil(N / DP)); only that slice has fp32 masters and Adam moments here."""

    def __init__(self, stage: GPTStage, cfg: TrainConfig, dp_group=None):  # not super(): no full masters here
        self.stage, self.dp_group = stage, dp_group
        self.dp = dist.get_world_size(dp_group) if dp_group is not None else 1
        rank = dist.get_rank(dp_group) if dp_group is not None else 0
        self.named = list(stage.named_parameters())
        self.params = [p for _, p in self.named]
        self.counted = counted_once(stage, ps.get_tensor_model_parallel_rank())
        self.mixed = any(p.dtype != torch.float32 for p in self.params)
        self.sizes = [p.numel() for p in self.params]
        total = sum(self.sizes)
        self.chunk = -(-total // self.dp)
        self.lo, self.hi = rank * self.chunk, min(total, (rank + 1) * self.chunk)
        device = self.params[0].device
        self.flat_master = torch.zeros(self.chunk, dtype=torch.float32, device=device)
        self.flat_grad = torch.zeros(self.chunk, dtype=torch.float32, device=device)
        # (parameter index, slice in this rank's chunk, slice in the parameter) of every overlap
        self.pieces: list[tuple[int, slice, slice]] = []
        start = 0
        for i, n in enumerate(self.sizes):
            a, b = max(start, self.lo), min(start + n, self.hi)
            if a < b:
                self.pieces.append((i, slice(a - self.lo, b - self.lo), slice(a - start, b - start)))
            start += n
        self.views = [self.flat_master[c] for _, c, _ in self.pieces]
        for v, (_, c, _) in zip(self.views, self.pieces):
            v.grad = self.flat_grad[c]
        self._load_masters([p.detach().reshape(-1) for p in self.params])
        self.steps = 0
        decays = [self.params[i].dim() > 1 for i, _, _ in self.pieces]
        self.opt = torch.optim.AdamW(_groups(self.views, decays, cfg), lr=cfg.lr,
                                     betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, fused=True)

    def _load_masters(self, flats: list[torch.Tensor]) -> None:
        for v, (i, _, s) in zip(self.views, self.pieces):
            v.copy_(flats[i][s])

    @torch.no_grad()
    def step(self, lr: float, max_norm: float) -> torch.Tensor:
        grads = self._grads()
        flat = torch.zeros(self.chunk * self.dp, dtype=torch.float32, device=self.flat_grad.device)
        torch._foreach_copy_(list(flat[:sum(self.sizes)].split(self.sizes)), [g.reshape(-1) for g in grads])
        if self.dp > 1:
            dist.reduce_scatter_tensor(self.flat_grad, flat, group=self.dp_group)
            self.flat_grad /= self.dp
        else:
            self.flat_grad.copy_(flat)
        counted = [v.grad for v, (i, _, _) in zip(self.views, self.pieces) if self.counted[i]]
        sq = _sum_of_squares(counted, self.flat_grad.device)
        if self.dp > 1:
            dist.all_reduce(sq, group=self.dp_group)
        self.steps += 1
        return self._apply(sq, lr, max_norm)

    def _refresh_weights(self) -> None:
        """All-gather the updated slices in the weights' dtype and copy them into the weights."""
        dtype = self.params[0].dtype
        full = self._gather(self.flat_master, dtype)
        torch._foreach_copy_(self.params, [f.view_as(p) for f, p in zip(full.split(self.sizes), self.params)])

    def _gather(self, chunk: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        local = chunk.to(dtype)
        if self.dp == 1:
            return local[:sum(self.sizes)]
        full = torch.empty(self.chunk * self.dp, dtype=dtype, device=chunk.device)
        dist.all_gather_into_tensor(full, local, group=self.dp_group)
        return full[:sum(self.sizes)]

    def state_by_key(self) -> dict[str, dict[str, torch.Tensor]]:
        """The full state of every parameter (a collective over DP: every DP rank must call it)."""
        fields = {}
        for f in FIELDS:
            chunk = torch.zeros_like(self.flat_master)
            for v, (_, c, _) in zip(self.views, self.pieces):
                chunk[c] = v if f == "master" else self.opt.state.get(v, {}).get(f, torch.zeros_like(v))
            fields[f] = self._gather(chunk, torch.float32).split(self.sizes)
        step = torch.tensor(float(self.steps))
        return {name: {**{f: fields[f][i].view_as(p).cpu() for f in FIELDS}, "step": step}
                for i, (name, p) in enumerate(self.named)}

    @torch.no_grad()
    def load_by_key(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        for (name, p) in self.named:
            p.copy_(state[name]["master"])
        self._load_masters([state[name]["master"].reshape(-1).to(self.flat_master.device) for name, _ in self.named])
        self.steps = int(float(state[self.named[0][0]]["step"]))
        if self.steps == 0:
            return
        for v, (i, _, s) in zip(self.views, self.pieces):
            st = state[self.named[i][0]]
            self.opt.state[v] = {"step": torch.tensor(float(self.steps), device=v.device),
                                 **{f: st[f].reshape(-1)[s].clone().to(v.device) for f in ("exp_avg", "exp_avg_sq")}}


def make_optimizer(stage: GPTStage, cfg: TrainConfig) -> MasterAdamW:
    group = ps.get_data_parallel_group()
    cls = ShardedMasterAdamW if cfg.use_distributed_optimizer else MasterAdamW
    return cls(stage, cfg, group)
