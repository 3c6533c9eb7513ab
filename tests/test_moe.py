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


EXPERTS_CHILD = '''
import sys, torch, torch.distributed as dist
from megatron.core import parallel_state as ps
from ckpt_tools.model.spec import ModelSpec
from trainer.layers import megatron_config
from trainer.model import MLP
from trainer.moe import Experts
dist.init_process_group("gloo")
ps.initialize_model_parallel(tensor_model_parallel_size=2)
spec = ModelSpec.from_dict({"architecture": "mixtral", "num_layers": 1, "hidden_size": 32, "num_attention_heads": 4,
                            "num_query_groups": 2, "ffn_hidden_size": 48, "vocab_size": 64, "num_moe_experts": 3})
experts = Experts(spec, megatron_config(spec, 2, 1, torch.float32, True), MLP, 3)
gen = torch.Generator().manual_seed(dist.get_rank() // 2)
with torch.no_grad():  # each TP rank its part of every expert, each expert its own weights
    for i, p in enumerate(experts.parameters()):
        p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * i + dist.get_rank())))
x, counts = torch.randn(20, 32, generator=gen), [7, 0, 13]
results = []
for grouped in (True, False):
    Experts._grouped = lambda self, x, g=grouped: g
    xi = x.clone().requires_grad_()
    y = experts(xi, counts, selective=grouped)
    y.square().sum().backward()
    results.append((y.detach(), xi.grad, [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in experts.parameters()]))
    experts.zero_grad()
(y1, gx1, gp1), (y2, gx2, gp2) = results
torch.testing.assert_close(y1, y2, rtol=1e-5, atol=1e-5)
torch.testing.assert_close(gx1, gx2, rtol=1e-5, atol=1e-5)
for a, b in zip(gp1, gp2):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
assert y1.abs().sum() > 0 and all(g.abs().sum() > 0 for g in gp1[:2] + gp1[-2:])
print("rank", dist.get_rank(), "ok")
'''


def test_grouped_gemm_experts_equal_the_expert_loop_at_tp2(tmp_path):
    """The experts as one grouped GEMM per linear (torch._grouped_mm, TP's input copy and output sum by hand) give
    the per-expert loop's outputs and gradients (inputs' and every weight's), an empty expert included."""
    from conftest import torchrun
    script = tmp_path / "experts_child.py"
    script.write_text(EXPERTS_CHILD)
    out = torchrun(2, [str(script)], timeout=300)
    assert out.stdout.count("ok") == 2, out.stdout
