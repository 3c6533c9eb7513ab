"""AdamW over fp32 master weights, Megatron's LR schedule, and global-norm gradient clipping.

One optimizer, two modes. The stage's weights are moved into one flat buffer, ordered in segments
of equal treatment (weight decay or not; counted in the grad norm or not). Plain mode keeps the
fp32 masters and both Adam moments of every element on every data-parallel rank and all-reduces
the gradients; distributed mode (Megatron's distributed optimizer, ZeRO-1) gives DP rank r the
elements [r*c, (r+1)*c) of the flat buffer (c = ceil(N / DP)): gradients are reduce-scattered,
each rank steps its slice, the new weights are all-gathered. The state is exposed per parameter
key, so the optimizer file on disk is the same in both modes and for any DP size.

The segments are ordered decay first, so the update needs one boundary. On CUDA it is one Triton
kernel (trainer/kernels.py: fp32 or bf16 gradient in; master, moments and bf16 weight out). In bf16
training the micro-batches' gradients are summed in an fp32 buffer (`main_grad`, Megatron's
accumulate_allreduce_grads_in_fp32) unless the config turns it off. A step takes
no host sync: the grad norm and the clip factor stay on the device.
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
        replicated = layout.is_replicated(keys[name], stage.spec, pp_size)
        tied_copy = name == "output_layer.weight" and stage.spec.tie_word_embeddings
        flags.append(not (replicated and tp_rank != 0) and not tied_copy)
    return flags


def _sum_of_squares(grad: torch.Tensor, segments: tuple) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float32, device=grad.device)
    for a, b, _, counted in segments:
        if counted:
            total = total + torch.linalg.vector_norm(grad[a:b], dtype=torch.float32).square()
    return total


def _adamw(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
           weight: torch.Tensor | None, decay_end: int, lr: float, step: int, inv_scale: torch.Tensor,
           beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """torch.optim.AdamW's update (decoupled decay, bias correction), in place on flat tensors whose
    elements [0, decay_end) get the weight decay; the gradient is scaled by the clip factor on the
    way in, the weight (bf16) written on the way out. trainer.kernels.adamw is the CUDA twin."""
    g = grad.float() * inv_scale
    master[:decay_end].mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1 ** step))
    if weight is not None:
        weight.copy_(master)


def _into_main_grad(p: torch.nn.Parameter) -> None:
    if p.grad is not None and p.main_grad is not None:
        p.main_grad.add_(p.grad)
        p.grad = None


class MasterAdamW:
    def __init__(self, stage: GPTStage, cfg: TrainConfig, dp_group=None, distributed: bool = False):
        self.cfg, self.dp_group, self.distributed = cfg, dp_group, distributed
        self.dp = dist.get_world_size(dp_group) if dp_group is not None else 1
        named = list(stage.named_parameters())
        self.keys = [name for name, _ in named]
        counted = counted_once(stage, ps.get_tensor_model_parallel_rank())
        kinds = [(p.dim() > 1, c) for (_, p), c in zip(named, counted)]
        order = sorted(range(len(named)), key=lambda i: (not kinds[i][0], not kinds[i][1]))
        self.named = [named[i] for i in order]
        self._counted = [kinds[i] for i in order]
        self.params = [p for _, p in self.named]
        self.sizes = [p.numel() for p in self.params]
        total = sum(self.sizes)
        device, dtype = self.params[0].device, self.params[0].dtype
        self.chunk = -(-total // self.dp) if distributed else total
        rank = dist.get_rank(dp_group) if distributed and dp_group is not None else 0
        self.lo, self.hi = rank * self.chunk, min(total, (rank + 1) * self.chunk)
        # the weights become views of one flat buffer (padded to DP x chunk for the all-gather)
        self.flat = torch.zeros(self.chunk * (self.dp if distributed else 1), dtype=dtype, device=device)
        self.starts, start = [], 0
        for p, n in zip(self.params, self.sizes):
            self.flat[start:start + n].copy_(p.detach().reshape(-1))
            p.data = self.flat[start:start + n].view_as(p)
            self.starts.append(start)
            start += n
        segments, start = [], 0
        for i in order:
            n = named[i][1].numel()
            a, b = max(start, self.lo) - self.lo, min(start + n, self.hi) - self.lo
            if a < b:
                if segments and segments[-1][1] == a and segments[-1][2:] == kinds[i]:
                    segments[-1] = (segments[-1][0], b, *kinds[i])
                else:
                    segments.append((a, b, *kinds[i]))
            start += n
        self.segments = tuple(segments)
        local = self.flat[self.lo:self.hi]
        self.mixed = dtype != torch.float32
        self.master = local.float().clone() if self.mixed or distributed else local
        self.weight = None if self.master is local else local  # written by the update from the masters
        # fp32 gradient accumulation (Megatron-LM's accumulate_allreduce_grads_in_fp32, its default in bf16): each
        # micro-batch's bf16 gradient is added into one flat fp32 buffer as soon as autograd has it (the weights'
        # `.grad` is then cleared), and the DP reduction runs on that buffer in fp32
        self.main_grad = None
        if self.mixed and cfg.accumulate_allreduce_grads_in_fp32:
            self.main_grad = torch.zeros(self.flat.numel(), dtype=torch.float32, device=device)
            for p, s, n in zip(self.params, self.starts, self.sizes):
                if not hasattr(p, "main_grad"):  # one hook per parameter, whichever optimizer's buffer it feeds
                    p.register_post_accumulate_grad_hook(_into_main_grad)
                p.main_grad = self.main_grad[s:s + n].view_as(p)
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.steps = 0
        self.lr = cfg.lr
        self.decay_end = next((a for a, _, decay, _ in self.segments if not decay), self.hi - self.lo)
        # MoE experts split over EP ranks: their gradients are summed over the ranks that hold the same experts
        # (megatron-core's expert-data-parallel group) and their squares over the EP group for the norm
        self.expert = [getattr(p, "expert", False) for p in self.params]
        self.ep_split = any(self.expert) and ps.get_expert_model_parallel_world_size() > 1
        if self.ep_split and distributed:
            raise ValueError("the distributed optimizer with experts split over EP ranks is not supported")
        self._update = _adamw
        if device.type == "cuda":
            from trainer import kernels
            self._update = kernels.adamw

    @property
    def param_groups(self) -> list[dict]:
        common = {"lr": self.lr, "betas": (self.cfg.adam_beta1, self.cfg.adam_beta2), "eps": self.cfg.adam_eps}
        return [{**common, "weight_decay": self.cfg.weight_decay}, {**common, "weight_decay": 0.0}]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        if self.main_grad is not None:
            self.main_grad.zero_()

    def grad_of(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        """The gradient accumulated so far this step: the fp32 buffer's view, else `.grad`."""
        return p.main_grad if self.main_grad is not None else p.grad

    def scale_main_grad(self, factor: float) -> None:
        """Scale the fp32-accumulated gradients (the pipeline schedule scales only `.grad`)."""
        if self.main_grad is not None:
            self.main_grad.mul_(factor)

    def _local_grad(self) -> torch.Tensor:
        """This rank's slice of the DP-averaged flat gradient."""
        if self.main_grad is not None:
            flat = self.main_grad  # fp32, already padded to DP x chunk in distributed mode
        else:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
            flat = torch.cat([g.reshape(-1) for g in grads])
        if not self.distributed:
            if self.ep_split:
                self._reduce_split(flat)
            elif self.dp > 1:
                dist.all_reduce(flat, group=self.dp_group)
                flat /= self.dp
            return flat
        if self.main_grad is None:
            flat = torch.nn.functional.pad(flat.float(), (0, self.flat.numel() - flat.numel()))
        if self.dp == 1:
            return flat[:self.hi - self.lo]
        local = torch.empty(self.chunk, dtype=torch.float32, device=flat.device)
        dist.reduce_scatter_tensor(local, flat, group=self.dp_group)
        return (local / self.dp)[:self.hi - self.lo]

    def _parts(self, expert: bool) -> list[slice]:
        return [slice(s, s + n) for s, n, e in zip(self.starts, self.sizes, self.expert) if e == expert]

    def _reduce_split(self, flat: torch.Tensor) -> None:
        """Average dense gradients over DP and expert gradients over the expert-data-parallel ranks (each expert's
        gradient already sums the tokens of its whole EP group), both divided by DP: the mean over all tokens."""
        for expert, group in ((False, self.dp_group), (True, ps.get_expert_data_parallel_group())):
            parts = self._parts(expert)
            joined = torch.cat([flat[p] for p in parts])
            if dist.get_world_size(group) > 1:
                dist.all_reduce(joined, group=group)
            joined /= self.dp
            at = 0
            for p in parts:
                n = p.stop - p.start
                flat[p] = joined[at:at + n]
                at += n

    def _sum_of_squares(self, grad: torch.Tensor) -> torch.Tensor:
        """This model-parallel rank's share of the squared global grad norm; with experts split over EP ranks, their
        squares summed over the EP group (the dense ones are the same on every EP rank)."""
        if not self.ep_split:
            return _sum_of_squares(grad, self.segments)
        sums = {False: torch.zeros((), device=grad.device), True: torch.zeros((), device=grad.device)}
        for start, n, expert, (_, counted) in zip(self.starts, self.sizes, self.expert, self._counted):
            if counted:
                sums[expert] = sums[expert] + torch.linalg.vector_norm(grad[start:start + n], dtype=torch.float32).square()
        dist.all_reduce(sums[True], group=ps.get_expert_model_parallel_group())
        return sums[False] + sums[True]

    @torch.no_grad()
    def step(self, lr: float, max_norm: float) -> torch.Tensor:
        """Reduce, clip and apply this step's gradients; returns the global grad norm (on device)."""
        grad = self._local_grad()
        sq = self._sum_of_squares(grad)
        if self.distributed and self.dp > 1:
            dist.all_reduce(sq, group=self.dp_group)
        dist.all_reduce(sq, group=ps.get_model_parallel_group())
        norm = sq.sqrt()
        inv_scale = torch.ones((), device=grad.device)
        if max_norm > 0:
            inv_scale = torch.where(norm > max_norm, max_norm / (norm + 1e-6), 1.0)
        self.steps += 1
        self.lr = lr
        self._update(self.master, self.exp_avg, self.exp_avg_sq, grad, self.weight, self.decay_end, lr, self.steps,
                     inv_scale, self.cfg.adam_beta1, self.cfg.adam_beta2, self.cfg.adam_eps, self.cfg.weight_decay)
        if self.distributed and self.dp > 1:
            dist.all_gather_into_tensor(self.flat, self.flat[self.lo:self.lo + self.chunk].clone(), group=self.dp_group)
        return norm

    # ------------------------------------------------------------ state per parameter key
    def _pieces(self):
        """(parameter index, slice of the local buffers, slice of the flattened parameter)."""
        for i, (start, n) in enumerate(zip(self.starts, self.sizes)):
            a, b = max(start, self.lo), min(start + n, self.hi)
            if a < b:
                yield i, slice(a - self.lo, b - self.lo), slice(a - start, b - start)

    def _full(self, local: torch.Tensor) -> torch.Tensor:
        """The flat fp32 tensor over all parameters from each DP rank's slice (a collective)."""
        if not self.distributed:
            return local
        padded = torch.nn.functional.pad(local, (0, self.chunk - local.numel()))
        if self.dp == 1:
            return padded
        full = torch.empty(self.chunk * self.dp, dtype=torch.float32, device=local.device)
        dist.all_gather_into_tensor(full, padded, group=self.dp_group)
        return full

    def state_by_key(self) -> dict[str, dict[str, torch.Tensor]]:
        """The full state of every parameter; in distributed mode a gather over DP (every rank calls it)."""
        fields = {f: self._full(getattr(self, f)) for f in FIELDS}
        step = torch.tensor(float(self.steps))
        by_key = {name: {**{f: fields[f][s:s + n].view_as(p).clone() for f in FIELDS}, "step": step}
                  for (name, p), s, n in zip(self.named, self.starts, self.sizes)}
        return {name: by_key[name] for name in self.keys}  # in the stage's parameter order

    @torch.no_grad()
    def load_by_key(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Set masters, weights and moments from full per-key state (`exp_avg` None: fresh moments)."""
        for (name, p) in self.named:
            p.copy_(state[name]["master"])
        self.steps = int(float(state[self.named[0][0]]["step"]))
        for i, local, part in self._pieces():
            s = state[self.named[i][0]]
            self.master[local].copy_(s["master"].reshape(-1)[part])
            for f in ("exp_avg", "exp_avg_sq"):
                target = getattr(self, f)[local]
                target.copy_(s[f].reshape(-1)[part]) if self.steps > 0 else target.zero_()


def make_optimizer(stage: GPTStage, cfg: TrainConfig) -> MasterAdamW:
    return MasterAdamW(stage, cfg, ps.get_data_parallel_group(), distributed=cfg.use_distributed_optimizer)
