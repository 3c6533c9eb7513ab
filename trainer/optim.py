"""AdamW over fp32 master weights, Megatron's LR schedule, and global-norm gradient clipping.

One optimizer, two modes. The stage's weights are moved into one flat buffer, ordered in segments
of equal treatment (weight decay or not; counted in the grad norm or not) and cut into buckets.
Autograd adds each micro-batch's gradient into a flat gradient buffer of the same layout (fp32 in
bf16 training: Megatron's accumulate_allreduce_grads_in_fp32, unless the config turns it off), and
a bucket whose gradients are all in is reduced over DP while backward goes on (Megatron's
overlap_grad_reduce). Plain mode all-reduces the buckets and keeps the fp32 masters and both Adam
moments of every element on every data-parallel rank; distributed mode (Megatron's distributed
optimizer, ZeRO-1) pads each bucket to a multiple of DP and gives DP rank r the r-th part of each:
buckets are reduce-scattered, each rank steps its parts, the new weights are all-gathered bucket by
bucket, and the next forward waits for each bucket only where it first uses it (Megatron-LM's
overlap_param_gather): the all-gathers run beside that forward's first layers. The state is exposed
per parameter key, so the optimizer file on disk is the same in both modes and for any DP size and
bucket size.

The segments are ordered decay first, so the update needs one boundary. On CUDA it is one Triton
kernel (trainer/kernels.py: fp32 or bf16 gradient in; master, moments and bf16 weight out); the
1/DP of the mean and the clip factor are one scalar it applies on the way in. A step takes no host
sync: the grad norm and the clip factor stay on the device.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from ckpt_tools.model import layout
from trainer import model, wgrad
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
        tied_copy = layout.alias_of(keys[name], stage.spec) is not None
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
    """Autograd's hook: move this backward's gradient into the flat buffer and tell the bucket. A weight whose GEMM
    has added its gradient into the buffer already (trainer/wgrad.py) hands autograd a placeholder: dropped."""
    if p.grad is not None:
        if not wgrad.fused(p):
            p.main_grad.add_(p.grad)
        p.grad = None
        p.grad_arrived()


@dataclass
class Bucket:
    """A run of the flat buffer reduced over DP as one collective. In distributed mode its size is padded to a
    multiple of DP and DP rank r owns the r-th of its DP equal parts (`local`: where that part starts in the
    rank's local buffers). `deferred` buckets hold gradients that other ranks' copies must be summed into first
    (sequence-parallel norms, per-head q/k norms, tied embeddings); they are reduced after those syncs."""
    start: int
    size: int
    local: int
    params: list[int]
    deferred: bool
    arrived: int = 0
    handle: object = None
    gather: object = None  # the all-gather of its new weights, waited where a forward first uses them


class MasterAdamW:
    def __init__(self, stage: GPTStage, cfg: TrainConfig, dp_group=None, distributed: bool = False):
        self.cfg, self.dp_group = cfg, dp_group
        self.dp = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.distributed = distributed and self.dp > 1
        stage.params_ready(stage)  # an earlier optimizer's weight all-gathers still running end before the copy
        named = list(stage.named_parameters())
        self.keys = [name for name, _ in named]
        counted = counted_once(stage, ps.get_tensor_model_parallel_rank())
        kinds = [(p.dim() > 1, c) for (_, p), c in zip(named, counted)]
        order = sorted(range(len(named)), key=lambda i: (not kinds[i][0], not kinds[i][1]))
        self.named = [named[i] for i in order]
        self._counted = [kinds[i] for i in order]
        self.params = [p for _, p in self.named]
        self.sizes = [p.numel() for p in self.params]
        device, dtype = self.params[0].device, self.params[0].dtype
        self.buckets = self._make_buckets(stage, cfg)
        self.starts = [0] * len(self.params)
        for b in self.buckets:
            at = b.start
            for i in b.params:
                self.starts[i] = at
                at += self.sizes[i]
        # the elements this rank steps, as (flat start, flat end, local start): all of each bucket in plain mode,
        # its own part of each bucket in distributed mode
        part = (lambda b: b.size // self.dp) if self.distributed else (lambda b: b.size)
        rank = dist.get_rank(dp_group) if self.distributed else 0
        self.owned = [(b.start + rank * part(b), b.start + (rank + 1) * part(b), b.local) for b in self.buckets]
        local_size = sum(b - a for a, b, _ in self.owned)
        # the weights become views of one flat buffer (each bucket padded to a multiple of DP for the all-gather)
        total = self.buckets[-1].start + self.buckets[-1].size
        self.flat = torch.zeros(total, dtype=dtype, device=device)
        for p, s, n in zip(self.params, self.starts, self.sizes):
            self.flat[s:s + n].copy_(p.detach().reshape(-1))
            p.data = self.flat[s:s + n].view_as(p)
        segments = []
        for i, _, local, _ in self._pieces():
            a, b = local.start, local.stop
            if segments and segments[-1][1] == a and segments[-1][2:] == self._counted[i]:
                segments[-1] = (segments[-1][0], b, *self._counted[i])
            else:
                segments.append((a, b, *self._counted[i]))
        self.segments = tuple(segments)
        self.mixed = dtype != torch.float32
        if self.distributed:  # this rank's parts, in fp32, and a buffer the update writes its new weights into
            self.master = torch.cat([self.flat[a:b] for a, b, _ in self.owned]).float()
            self.weight = torch.empty(local_size, dtype=dtype, device=device)
        else:
            self.master = self.flat.float().clone() if self.mixed else self.flat
            self.weight = self.flat if self.mixed else None
        # every micro-batch's gradient is added into one flat buffer as soon as autograd has it (the weight's
        # `.grad` is then cleared). In bf16 training it is fp32 by default (Megatron-LM's
        # accumulate_allreduce_grads_in_fp32, which its --bf16 turns on), and the DP reduction runs on it
        grad_dtype = torch.float32 if self.mixed and cfg.accumulate_allreduce_grads_in_fp32 else dtype
        self.main_grad = torch.zeros(total, dtype=grad_dtype, device=device)
        self.reduced = torch.empty(local_size, dtype=grad_dtype, device=device) if self.distributed else self.main_grad
        for b_index, b in enumerate(self.buckets):
            for i in b.params:
                p, s, n = self.params[i], self.starts[i], self.sizes[i]
                if not hasattr(p, "main_grad"):  # one hook per parameter, whichever optimizer's buffer it feeds
                    p.register_post_accumulate_grad_hook(_into_main_grad)
                p.main_grad = self.main_grad[s:s + n].view_as(p)
                p.grad_arrived = functools.partial(self._arrived, b_index)
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.steps = 0
        self.lr = cfg.lr
        self.decay_end = next((a for a, _, decay, _ in self.segments if not decay), local_size)
        # MoE experts split over EP ranks: their gradients are summed over the ranks that hold the same experts
        # (megatron-core's expert-data-parallel group) and their squares over the EP group for the norm
        self.expert = [getattr(p, "expert", False) for p in self.params]
        self.ep_split = any(self.expert) and ps.get_expert_model_parallel_world_size() > 1
        if self.ep_split and self.distributed:
            raise ValueError("the distributed optimizer with experts split over EP ranks is not supported")
        # buckets reduced while backward runs (Megatron-LM's --overlap-grad-reduce). Not with experts: a rank whose
        # experts got no tokens would reach its buckets in another order than its DP peers
        self.overlap = cfg.overlap_grad_reduce and self.dp > 1 and not any(self.expert)
        self.backward_passes = cfg.num_micro_batches
        # the new weights' all-gathers left running into the next forward, which waits for a bucket where it first
        # uses one of its weights (GPTStage.params_ready); they are launched in that order of first use
        self.overlap_param_gather = self.distributed and cfg.overlap_param_gather
        self._bucket_of = {id(self.params[i]): index for index, b in enumerate(self.buckets) for i in b.params}
        self._buckets_of_module: dict[int, list[int]] = {}
        order = list(dict.fromkeys(i for unit in stage.units() for i in self._buckets_of(unit)))
        self.gather_order = [self.buckets[i] for i in order + sorted(set(range(len(self.buckets))) - set(order))]
        stage.params_ready = self.wait_params if self.overlap_param_gather else model.ready
        self._update = _adamw
        if device.type == "cuda":
            from trainer import kernels
            self._update = kernels.adamw

    def _make_buckets(self, stage: GPTStage, cfg: TrainConfig) -> list[Bucket]:
        """Runs of parameters in flat order, each closed past `ddp_bucket_size` elements (Megatron-LM's default:
        max(40M, 1M x DP)) or where deferred and overlapped parameters meet."""
        limit = cfg.ddp_bucket_size or max(40_000_000, 1_000_000 * self.dp)
        pairs = layout.aliases(stage.spec) if len(stage.layer_counts) > 1 else {}
        shared = set(pairs) | set(pairs.values())  # an aliased pair's copies, their grads summed across stages
        keys = stage.global_keys()
        deferred = [p.dim() < 2 or getattr(p, "sequence_parallel", False) or getattr(p, "partial_over_tp", False)
                    or keys[name] in shared for name, p in self.named]
        runs: list[list[int]] = []
        for i in range(len(self.params)):
            if not runs or deferred[i] != deferred[runs[-1][0]] or sum(self.sizes[j] for j in runs[-1]) >= limit:
                runs.append([])
            runs[-1].append(i)
        buckets, start, local = [], 0, 0
        for run in runs:
            size = sum(self.sizes[i] for i in run)
            if self.distributed:
                size = -(-size // self.dp) * self.dp
            buckets.append(Bucket(start, size, local if self.distributed else start, run, deferred[run[0]]))
            start += size
            local += size // self.dp if self.distributed else size
        return buckets

    @property
    def param_groups(self) -> list[dict]:
        common = {"lr": self.lr, "betas": (self.cfg.adam_beta1, self.cfg.adam_beta2), "eps": self.cfg.adam_eps}
        return [{**common, "weight_decay": self.cfg.weight_decay}, {**common, "weight_decay": 0.0}]

    def zero_grad(self) -> None:
        for b in self.buckets:  # a reduction still in flight (a backward without its step) finishes first
            if b.handle is not None:
                b.handle.wait()
        for p in self.params:
            p.grad = None
        self.main_grad.zero_()
        for b in self.buckets:
            b.arrived, b.handle = 0, None

    def grad_of(self, p: torch.nn.Parameter) -> torch.Tensor:
        """The gradient accumulated so far this step (a view of the flat buffer)."""
        return p.main_grad

    # ------------------------------------------------------------ the DP reduction
    def _arrived(self, index: int) -> None:
        b = self.buckets[index]
        if b.handle is not None:  # its reduction has started: this gradient would be lost or race it
            raise RuntimeError(f"a gradient reached bucket {index} after its DP reduction began (expected "
                               f"{len(b.params)} parameters x {self.backward_passes} backward passes a step): "
                               f"set overlap_grad_reduce: false for this model")
        b.arrived += 1
        if self.overlap and not b.deferred and b.arrived == len(b.params) * self.backward_passes:
            self._launch(b)  # its last gradient of this step: reduce it while backward goes on

    def _launch(self, b: Bucket) -> None:
        grads = self.main_grad[b.start:b.start + b.size]
        if self.distributed:
            part = b.size // self.dp
            b.handle = dist.reduce_scatter_tensor(self.reduced[b.local:b.local + part], grads, group=self.dp_group,
                                                  async_op=True)
        else:
            b.handle = dist.all_reduce(grads, group=self.dp_group, async_op=True)

    def reduced_grad(self) -> torch.Tensor:
        """This rank's part of the gradient summed over DP (the mean times DP): the buckets not reduced during
        backward are reduced now, in bucket order."""
        if self.ep_split:
            self._reduce_split(self.main_grad)
        elif self.dp > 1:
            for b in self.buckets:
                if b.handle is None:
                    self._launch(b)
            for b in self.buckets:
                b.handle.wait()
        return self.reduced

    def _parts(self, expert: bool) -> list[slice]:
        return [slice(s, s + n) for s, n, e in zip(self.starts, self.sizes, self.expert) if e == expert]

    def _reduce_split(self, flat: torch.Tensor) -> None:
        """Sum dense gradients over DP and expert gradients over the expert-data-parallel ranks (each expert's
        gradient already sums the tokens of its whole EP group); both are divided by DP after: the mean over all
        tokens."""
        for expert, group in ((False, self.dp_group), (True, ps.get_expert_data_parallel_group())):
            parts = self._parts(expert)
            if dist.get_world_size(group) == 1 or not parts:
                continue
            joined = torch.cat([flat[p] for p in parts])
            dist.all_reduce(joined, group=group)
            torch._foreach_copy_([flat[p] for p in parts], list(joined.split([p.stop - p.start for p in parts])))

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
    def step(self, lr: float, max_norm: float, grad_scale: float = 1.0) -> torch.Tensor:
        """Reduce, clip and apply this step's gradients, each multiplied by `grad_scale` / DP (a factor the update
        applies on the way in, not a pass over the buffer); returns the global grad norm (on device)."""
        grad = self.reduced_grad()
        scale = grad_scale / self.dp
        sq = self._sum_of_squares(grad)
        if self.distributed:
            dist.all_reduce(sq, group=self.dp_group)
        dist.all_reduce(sq, group=ps.get_model_parallel_group())
        norm = sq.sqrt() * scale
        inv_scale = torch.full((), scale, device=grad.device)
        if max_norm > 0:
            inv_scale = torch.where(norm > max_norm, max_norm / (norm + 1e-6), 1.0) * scale
        self.steps += 1
        self.lr = lr
        self.wait_params()  # a gather no forward waited for still reads the weights this update writes
        self._update(self.master, self.exp_avg, self.exp_avg_sq, grad, self.weight, self.decay_end, lr, self.steps,
                     inv_scale, self.cfg.adam_beta1, self.cfg.adam_beta2, self.cfg.adam_eps, self.cfg.weight_decay)
        if self.distributed:
            for b in self.gather_order:
                b.gather = dist.all_gather_into_tensor(self.flat[b.start:b.start + b.size],
                                                       self.weight[b.local:b.local + b.size // self.dp],
                                                       group=self.dp_group, async_op=True)
            if not self.overlap_param_gather:
                self.wait_params()
        return norm

    def _buckets_of(self, module: torch.nn.Module) -> list[int]:
        """The indices of the buckets that hold the weights of `module`."""
        if (indices := self._buckets_of_module.get(id(module))) is None:
            held = {self._bucket_of[id(p)] for p in module.parameters() if id(p) in self._bucket_of}
            indices = self._buckets_of_module[id(module)] = sorted(held)
        return indices

    def wait_params(self, module: torch.nn.Module | None = None) -> None:
        """Make the current stream wait for the new weights of `module` (all weights: None) where their all-gathers
        are still running (NCCL: a stream wait, no host sync; gloo waits on the host). A bucket is waited for once:
        the forward that uses the weights next runs on the stream that waited."""
        for b in self.buckets if module is None else [self.buckets[i] for i in self._buckets_of(module)]:
            if b.gather is not None:
                b.gather.wait()
                b.gather = None

    # ------------------------------------------------------------ state per parameter key
    def _pieces(self):
        """(parameter index, flat slice, slice of the local buffers, slice of the flattened parameter) for each
        piece of a parameter this rank steps."""
        for i, (start, n) in enumerate(zip(self.starts, self.sizes)):
            for lo, hi, local in self.owned:
                a, b = max(start, lo), min(start + n, hi)
                if a < b:
                    yield i, slice(a, b), slice(local + a - lo, local + b - lo), slice(a - start, b - start)

    def _full(self, local: torch.Tensor) -> torch.Tensor:
        """The flat fp32 tensor over all parameters from each DP rank's parts (a collective)."""
        if not self.distributed:
            return local
        full = torch.empty(self.flat.numel(), dtype=torch.float32, device=local.device)
        for b in self.buckets:
            part = b.size // self.dp
            dist.all_gather_into_tensor(full[b.start:b.start + b.size], local[b.local:b.local + part],
                                        group=self.dp_group)
        return full

    def state_by_key(self) -> dict[str, dict[str, torch.Tensor]]:
        """The full state of every parameter; in distributed mode a gather over DP (every rank calls it)."""
        self.wait_params()
        fields = {f: self._full(getattr(self, f)) for f in FIELDS}
        step = torch.tensor(float(self.steps))
        by_key = {name: {**{f: fields[f][s:s + n].view_as(p).clone() for f in FIELDS}, "step": step}
                  for (name, p), s, n in zip(self.named, self.starts, self.sizes)}
        return {name: by_key[name] for name in self.keys}  # in the stage's parameter order

    @torch.no_grad()
    def load_by_key(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Set masters, weights and moments from full per-key state (`exp_avg` None: fresh moments)."""
        self.wait_params()
        for (name, p) in self.named:
            p.copy_(state[name]["master"])
        self.steps = int(float(state[self.named[0][0]]["step"]))
        for i, _, local, part in self._pieces():
            s = state[self.named[i][0]]
            self.master[local].copy_(s["master"].reshape(-1)[part])
            for f in ("exp_avg", "exp_avg_sq"):
                target = getattr(self, f)[local]
                target.copy_(s[f].reshape(-1)[part]) if self.steps > 0 else target.zero_()


def make_optimizer(stage: GPTStage, cfg: TrainConfig) -> MasterAdamW:
    """The optimizer of the stage; on GPUs its linear layers then add their weight gradients into its buffer inside
    their GEMM (`gradient_accumulation_fusion`, trainer/wgrad.py)."""
    opt = MasterAdamW(stage, cfg, ps.get_data_parallel_group(), distributed=cfg.use_distributed_optimizer)
    if cfg.gradient_accumulation_fusion and opt.params[0].device.type == "cuda":
        wgrad.enable(stage, compiled=cfg.compile)
    return opt
