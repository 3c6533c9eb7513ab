"""The trainer's MoE layer against megatron-core's own routing functions (trainer/moe.py): the same experts, the
same probabilities and the same load-balancing loss for the same logits, and the loss reaching the router's
gradient through the layer's output as megatron-core's MoEAuxLossAutoScaler makes it."""
from __future__ import annotations

import pytest
import torch

from trainer.moe import AuxLoss, load_balancing_loss, route


@pytest.mark.parametrize("pre_softmax", [False, True])
def test_routing_and_loss_are_megatron_cores(pre_softmax):
    from megatron.core.transformer.moe.moe_utils import (switch_load_balancing_loss_func,
                                                          topk_routing_with_score_function)
    logits = torch.randn(96, 8, generator=torch.Generator().manual_seed(0))
    probs, index, scores = route(logits, 2, pre_softmax)
    want_probs, want_map = topk_routing_with_score_function(logits, 2, use_pre_softmax=pre_softmax)
    dense = torch.zeros_like(logits).scatter(1, index, probs)
    assert torch.equal(want_map, dense != 0)
    torch.testing.assert_close(dense, want_probs, rtol=1e-6, atol=0)
    want_loss = switch_load_balancing_loss_func(scores, want_map.sum(dim=0), logits.shape[0], 2, 8, 0.01)
    torch.testing.assert_close(load_balancing_loss(index, scores, 0.01), want_loss, rtol=1e-6, atol=0)


def test_the_loss_trains_the_router_through_the_output():
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(64, 16, generator=gen), torch.randn(4, 16, generator=gen)

    def grad(through_output: bool) -> torch.Tensor:
        weight = w.clone().requires_grad_()
        probs, index, scores = route(x @ weight.t(), 2, False)
        out = probs.sum(dim=-1, keepdim=True) * x  # an output that depends on the router
        aux = load_balancing_loss(index, scores, 0.1)
        if through_output:
            AuxLoss.scale = 0.5
            AuxLoss.apply(out, aux).square().mean().backward()
        else:
            (out.square().mean() + 0.5 * aux).backward()
        return weight.grad

    assert grad(False).abs().sum() > 0
    torch.testing.assert_close(grad(True), grad(False), rtol=1e-6, atol=1e-9)
