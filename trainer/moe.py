"""The mixture-of-experts MLP of a layer, as megatron-core's MoELayer with SequentialMLP experts holds it.

    mlp.router.weight                                [experts, hidden], replicated over TP
    mlp.experts.local_experts.{j}.linear_fc1.weight  expert j's SwiGLU fc1, split over TP as the dense MLP's
    mlp.experts.local_experts.{j}.linear_fc2.weight  expert j's fc2

Routing is megatron-core's top-k router: either the top-k logits and a softmax over those k, or (with
moe_router_pre_softmax) a softmax over every expert and its top-k probabilities as they are. Each token's output
is the sum over its k experts of probability x expert(token), added in the order of the experts. The router's
input is the same on every TP rank, so every TP rank picks the same experts and calls the same tensor-parallel
layers. Every expert of the layer lives on every rank here (expert parallelism is a layout of the files;
ckpt_tools.layout.local_experts says which EP rank holds which).

The load-balancing loss is megatron-core's switch loss (moe_aux_loss_coeff x E x sum_e f_e p_e, f_e the fraction
of token-slots routed to e and p_e the mean router probability of e). As megatron-core's MoEAuxLossAutoScaler
does, it reaches backward through the layer's output (`AuxLoss`), so it trains the router on every pipeline stage
without travelling to the loss; `aux_loss` keeps its last value for the log.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn

from ckpt_tools.spec import ModelSpec


def route(logits: torch.Tensor, topk: int, pre_softmax: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router logits [n, E] -> (probabilities [n, k], expert indices [n, k], every expert's softmax [n, E] fp32)."""
    scores = torch.softmax(logits.float(), dim=-1)
    if pre_softmax:
        probs, index = torch.topk(scores.type_as(logits), topk, dim=-1)
    else:
        top, index = torch.topk(logits, topk, dim=-1)
        probs = torch.softmax(top.float(), dim=-1).type_as(logits)
    return probs, index, scores


def load_balancing_loss(index: torch.Tensor, scores: torch.Tensor, coeff: float) -> torch.Tensor:
    """The switch loss: coeff x E x sum_e (share of token-slots routed to e) x (mean softmax of e)."""
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


class Experts(nn.Module):
    def __init__(self, spec: ModelSpec, config: TransformerConfig, mlp: type[nn.Module]):
        super().__init__()
        self.local_experts = nn.ModuleList(mlp(spec, config, width=spec.moe_ffn_hidden_size)
                                           for _ in range(spec.num_moe_experts))


class MoE(nn.Module):
    def __init__(self, spec: ModelSpec, config: TransformerConfig, mlp: type[nn.Module]):
        super().__init__()
        self.topk, self.pre_softmax = spec.moe_router_topk, spec.moe_router_pre_softmax
        self.num_experts, self.aux_loss_coeff = spec.num_moe_experts, config.moe_aux_loss_coeff
        self.router = Router(spec, config)
        self.experts = Experts(spec, config, mlp)
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, selective: bool = False) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs, index, scores = route(F.linear(tokens, self.router.weight), self.topk, self.pre_softmax)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts.local_experts):
            rows, slot = (index == e).nonzero(as_tuple=True)
            if rows.numel() == 0:  # the same on every TP rank: the router's input and weights are
                continue
            y = expert(tokens[rows], selective)
            out.index_add_(0, rows, y * probs[rows, slot, None])
        if self.training and self.aux_loss_coeff:
            self.aux_loss = load_balancing_loss(index, scores, self.aux_loss_coeff)
            out = AuxLoss.apply(out, self.aux_loss)
        return out.reshape(shape)
