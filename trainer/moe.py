"""The mixture-of-experts MLP of a layer, as megatron-core's MoELayer with SequentialMLP experts holds it.

    mlp.router.weight                                [experts, hidden], replicated over TP
    mlp.experts.local_experts.{j}.linear_fc1.weight  expert j's SwiGLU fc1, split over TP as the dense MLP's
    mlp.experts.local_experts.{j}.linear_fc2.weight  expert j's fc2
    mlp.shared_experts.{gate_weight, linear_fc1.weight, linear_fc2.weight}   a shared expert, where the family has one

Routing is megatron-core's top-k router: either the top-k logits and a softmax over those k, or (with
moe_router_pre_softmax) a softmax over every expert and its top-k probabilities as they are. Each token's output
is the sum over its k experts of probability x expert(token), added in the order of the experts. The router's
input is the same on every TP rank, so every TP rank picks the same experts and calls the same tensor-parallel
layers.

Expert parallelism (EP over the data-parallel ranks, as megatron-core's): an EP rank holds the experts
ckpt_tools.model.layout.local_experts gives it. Each rank routes its own tokens, then the EP group's tokens, weights and
choices are gathered on every rank of the group (megatron-core's all-gather token dispatcher); each rank applies its
experts to the tokens routed to them, and the partial outputs are summed back to the rank whose tokens they are
(a reduce-scatter). Gradients flow back through both collectives.

The load-balancing loss is megatron-core's switch loss (moe_aux_loss_coeff x E x sum_e f_e p_e, f_e the fraction
of token-slots routed to e and p_e the mean router probability of e). As megatron-core's MoEAuxLossAutoScaler
does, it reaches backward through the layer's output (`AuxLoss`), so it trains the router on every pipeline stage
without travelling to the loss; `aux_loss` keeps its last value for the log.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn
from torch.utils.checkpoint import checkpoint

from ckpt_tools.model import layout
from ckpt_tools.model.spec import ModelSpec


def route(logits: torch.Tensor, topk: int, pre_softmax: bool, spec: ModelSpec | None = None,
          expert_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits [n, E] -> (probabilities [n, k], expert indices [n, k], every expert's scores [n, E] fp32).
    With the spec's sigmoid scoring (DeepSeek-V3), megatron-core's topk_routing_with_score_function: sigmoid scores,
    the expert bias added for the choice only, the choice limited to the best groups (a group scored by the sum of its
    best topk / group_topk), the chosen unbiased scores renormalised and scaled."""
    if spec is not None and spec.moe_router_score_function == "sigmoid":
        scores = torch.sigmoid(logits.float())
        choice = scores if expert_bias is None else scores + expert_bias
        if spec.moe_router_num_groups is not None:
            n, groups = choice.shape[0], spec.moe_router_num_groups
            per_group = choice.view(n, groups, -1).topk(topk // spec.moe_router_group_topk, dim=-1)[0].sum(-1)
            chosen = per_group.topk(spec.moe_router_group_topk, dim=-1)[1]
            keep = torch.zeros_like(per_group).scatter_(1, chosen, 1.0).bool()
            choice = choice.masked_fill(~keep.repeat_interleave(choice.shape[1] // groups, dim=1), float("-inf"))
        index = torch.topk(choice, topk, dim=-1)[1]
        probs = scores.gather(1, index)
        probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
        if spec.moe_router_topk_scaling_factor is not None:
            probs = probs * spec.moe_router_topk_scaling_factor
        return probs.type_as(logits), index, scores / scores.sum(dim=-1, keepdim=True)
    scores = torch.softmax(logits.float(), dim=-1)
    if pre_softmax:
        probs, index = torch.topk(scores.type_as(logits), topk, dim=-1)
    else:
        top, index = torch.topk(logits, topk, dim=-1)
        probs = torch.softmax(top.float(), dim=-1).type_as(logits)
    return probs, index, scores


def load_balancing_loss(index: torch.Tensor, scores: torch.Tensor, coeff: float) -> torch.Tensor:
    """The switch loss: coeff x E x sum_e (share of token-slots routed to e) x (mean softmax of e). Without the
    coefficient it is 1 when the experts share the tokens evenly, and grows as the router favours a few (at most
    about E / k with top-k routing)."""
    experts = scores.shape[-1]
    routed = F.one_hot(index, experts).sum(dim=(0, 1)).float() / index.numel()
    return coeff * experts * (routed * scores.mean(dim=0)).sum()


class AuxLoss(torch.autograd.Function):
    """The output unchanged; in backward the auxiliary loss gets the gradient `scale` (1 / micro-batches where the
    LM loss is divided by them, 1 under the pipeline schedule, which divides the gradients at the end)."""
    scale = 1.0

    @staticmethod
    def forward(ctx, output: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(aux)
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, AuxLoss.scale)


class Router(nn.Module):
    def __init__(self, spec: ModelSpec, config: TransformerConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(spec.num_moe_experts, spec.hidden_size, dtype=config.params_dtype))
        # GPT-OSS's router bias (megatron-core's, with add_bias_linear): replicated over TP like the weight
        self.bias = nn.Parameter(torch.empty(spec.num_moe_experts, dtype=config.params_dtype)) \
            if spec.add_bias_linear else None
        # DeepSeek-V3's expert bias: a persistent fp32 buffer, as megatron-core's; it steers the choice only. This
        # trainer keeps it as loaded (megatron-core moves it by the experts' load with moe_router_bias_update_rate).
        self.register_buffer("expert_bias", torch.zeros(spec.num_moe_experts, dtype=torch.float32)
                             if spec.moe_router_enable_expert_bias else None)


class Experts(nn.Module):
    def __init__(self, spec: ModelSpec, config: TransformerConfig, mlp: type[nn.Module], count: int):
        super().__init__()
        self.local_experts = nn.ModuleList(mlp(spec, config, width=spec.moe_ffn_hidden_size) for _ in range(count))
        self.biased = spec.add_bias_linear
        for p in self.parameters():
            p.expert = True  # reduced over the expert-data-parallel ranks, not all data-parallel ones

    def forward(self, x: torch.Tensor, counts: list[int], selective: bool = False) -> torch.Tensor:
        """x: the tokens routed to the local experts, expert by expert (counts[j] rows for expert j) -> each row
        through its expert. One grouped GEMM per linear where torch has one for these tensors, else expert by
        expert."""
        if not self._grouped(x):
            parts = x.split(counts)
            return torch.cat([expert(part, selective) if len(part) else part
                              for expert, part in zip(self.local_experts, parts)])
        first = self.local_experts[0]
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        group = first.linear_fc1.tp_group
        x = tensor_parallel.copy_to_tensor_model_parallel_region(x, group=group)  # ColumnParallelLinear's input
        h = _GroupedLinear.apply(x, offs, *(e.linear_fc1.weight for e in self.local_experts))
        h = checkpoint(first.activation, h, use_reentrant=False) if selective else first.activation(h)
        y = _GroupedLinear.apply(h, offs, *(e.linear_fc2.weight for e in self.local_experts))
        return tensor_parallel.reduce_from_tensor_model_parallel_region(y, group=group)  # RowParallelLinear's sum

    def _grouped(self, x: torch.Tensor) -> bool:
        """torch's grouped GEMM takes these tensors: no biases, rows of 16-byte multiples, and on CUDA bf16 on
        Hopper (elsewhere the per-expert loop: newer GPUs have been reported to give empty groups non-zero
        weight gradients)."""
        if self.biased or not hasattr(torch, "_grouped_mm"):
            return False
        w1, w2 = self.local_experts[0].linear_fc1.weight, self.local_experts[0].linear_fc2.weight
        if any(n * x.element_size() % 16 for n in (*w1.shape, w2.shape[1])) or w1.dtype != x.dtype:
            return False
        return x.device.type == "cpu" or (x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] == 9)


class _GroupedLinear(torch.autograd.Function):
    """x [tokens, in] (rows grouped by expert, offs their cumulative ends) times each expert's weight [out, in],
    transposed: one grouped GEMM. The experts' weights are stacked for the GEMM and stacked again in backward, not
    saved: a saved stack would keep a copy of every local expert's weights until backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, offs: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, offs, *weights)
        return torch._grouped_mm(x, torch.stack(weights).transpose(-2, -1), offs=offs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, offs, *weights = ctx.saved_tensors
        grad = grad.contiguous()
        dx = torch._grouped_mm(grad, torch.stack(weights), offs=offs)
        dw = torch._grouped_mm(grad.t(), x, offs=offs)  # [experts, out, in]: each expert's rows only
        return dx, None, *dw.unbind(0)


class _Gather(torch.autograd.Function):
    """All-gather along dim 0 over the EP group; backward: each rank's part of the summed gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group, ctx.n = group, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter(grad, ctx.group), None


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """The sum over the group of `x`, this rank's dim-0 part (all-reduce and slice: gloo has no reduce-scatter)."""
    x = x.contiguous()
    if x.is_cuda:
        out = torch.empty((x.shape[0] // dist.get_world_size(group),) + tuple(x.shape[1:]), dtype=x.dtype,
                          device=x.device)
        dist.reduce_scatter_tensor(out, x, group=group)
        return out
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x.chunk(dist.get_world_size(group))[dist.get_rank(group)]


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _Gather.apply(grad, ctx.group), None


def shared_expert(spec: ModelSpec, config: TransformerConfig, mlp: type[nn.Module]) -> nn.Module:
    """megatron-core's SharedExpertMLP: a dense MLP every token goes through (split over TP as the dense MLP, on every
    EP rank), with moe_shared_expert_gate its output scaled by sigmoid(gate_weight . x) (Qwen2-MoE's
    shared_expert_gate). gate_weight [1, hidden] is replicated over TP."""

    class SharedExpert(mlp):
        def __init__(self):
            super().__init__(spec, config, width=spec.moe_shared_expert_intermediate_size)
            self.gate_weight = nn.Parameter(torch.empty(1, spec.hidden_size, dtype=config.params_dtype)) \
                if spec.moe_shared_expert_gate else None

        def forward(self, x: torch.Tensor, selective: bool = False) -> torch.Tensor:
            y = super().forward(x, selective)
            return y if self.gate_weight is None else torch.sigmoid(F.linear(x, self.gate_weight)) * y

    return SharedExpert()


class MoE(nn.Module):
    def __init__(self, spec: ModelSpec, config: TransformerConfig, mlp: type[nn.Module],
                 ep: tuple[int, int] | None = None):
        super().__init__()
        self.spec, self.topk, self.pre_softmax = spec, spec.moe_router_topk, spec.moe_router_pre_softmax
        self.num_experts, self.aux_loss_coeff = spec.num_moe_experts, config.moe_aux_loss_coeff
        self.router = Router(spec, config)
        self.experts_here = layout.local_experts(spec, *(ep or (None, 1)))  # global indices, local order
        self.ep_group = ps.get_expert_model_parallel_group() if ep is not None and ep[1] > 1 else None
        self.experts = Experts(spec, config, mlp, len(self.experts_here))
        # registered after the experts, as megatron-core's MoELayer orders its state dict
        self.shared_experts = shared_expert(spec, config, mlp) if spec.moe_shared_expert_intermediate_size else None
        self.aux_loss: torch.Tensor | None = None
        self.balance: torch.Tensor | None = None  # the last training step's load_balancing_loss without its coefficient

    def forward(self, x: torch.Tensor, selective: bool = False) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        logits = F.linear(tokens, self.router.weight, self.router.bias)
        probs, index, scores = route(logits, self.topk, self.pre_softmax, self.spec, self.router.expert_bias)
        aux = load_balancing_loss(index, scores, self.aux_loss_coeff) if self.training and self.aux_loss_coeff \
            else None
        if self.training:
            self.balance = load_balancing_loss(index.detach(), scores.detach(), 1.0)
        if self.ep_group is not None:  # the EP group's tokens and routing on every rank of it
            tokens, probs = _Gather.apply(tokens, self.ep_group), _Gather.apply(probs, self.ep_group)
            gathered = [torch.empty_like(index) for _ in range(dist.get_world_size(self.ep_group))]
            dist.all_gather(gathered, index.contiguous(), group=self.ep_group)
            index = torch.cat(gathered)
        # the token-slots of the local experts, expert by expert (one host sync for the counts); every TP rank
        # finds the same ones: the router's input and weights are the same on each
        flat = index.reshape(-1)
        order = flat.argsort(stable=True)
        ends = [0, *torch.bincount(flat, minlength=self.num_experts).cumsum(0).tolist()]
        lo, hi = self.experts_here[0], self.experts_here[-1] + 1
        slots = order[ends[lo]:ends[hi]]
        rows = slots // self.topk
        y = self.experts(tokens[rows], [ends[e + 1] - ends[e] for e in self.experts_here], selective)
        out = torch.zeros_like(tokens).index_add_(0, rows, y * probs.reshape(-1)[slots, None])
        if self.ep_group is not None:
            out = _ReduceScatter.apply(out, self.ep_group)
        if self.shared_experts is not None:  # this rank's own tokens
            out = out + self.shared_experts(x.reshape(-1, shape[-1]), selective)
        if aux is not None:
            self.aux_loss = aux
            out = AuxLoss.apply(out, aux)
        return out.reshape(shape)
