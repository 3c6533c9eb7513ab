"""The trainer's flat AdamW update against torch.optim.AdamW (the reference), and the LR schedule."""
from __future__ import annotations

import torch

from trainer.optim import _adamw, _sum_of_squares


def test_flat_update_equals_torch_adamw_with_decay_groups_and_clipping():
    gen = torch.Generator().manual_seed(0)
    n, split = 1000, 700  # elements [0, 700) decay, [700, 1000) do not
    start = torch.randn(n, generator=gen)
    ref = [start[:split].clone().requires_grad_(True), start[split:].clone().requires_grad_(True)]
    torch_opt = torch.optim.AdamW([{"params": [ref[0]], "weight_decay": 0.1}, {"params": [ref[1]], "weight_decay": 0.0}],
                                  lr=3e-3, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    master, m, v = start.clone(), torch.zeros(n), torch.zeros(n)
    weight = torch.zeros(n, dtype=torch.bfloat16)
    for step in range(1, 6):
        grad = torch.randn(n, generator=gen) * (1 + step)
        scale = 0.5 if step % 2 else 1.0  # a clip factor on some steps
        for p, g in zip(ref, (grad[:split], grad[split:])):
            p.grad = g * scale
        torch_opt.step()
        _adamw(master, m, v, grad, weight, split, 3e-3, step, torch.tensor(scale), 0.9, 0.95, 1e-8, 0.1)
        expected = torch.cat([p.detach() for p in ref])
        assert torch.allclose(master, expected, rtol=1e-5, atol=1e-7), (step, (master - expected).abs().max())
        assert torch.equal(weight, master.to(torch.bfloat16))
    state = torch.cat([torch_opt.state[p]["exp_avg_sq"] for p in ref])
    assert torch.allclose(v, state, rtol=1e-5, atol=1e-12)


def test_sum_of_squares_counts_only_counted_segments():
    g = torch.arange(10, dtype=torch.bfloat16)
    got = _sum_of_squares(g, ((0, 4, True, True), (4, 6, True, False), (6, 10, False, True)))
    assert abs(got.item() - sum(x * x for x in (0, 1, 2, 3, 6, 7, 8, 9))) < 1e-4
