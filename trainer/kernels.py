"""A Triton kernel for the trainer's AdamW step on CUDA: one pass over the flat buffers.

Per element it reads the gradient (fp32 where micro-batches are accumulated in fp32, the default;
else bf16), the fp32 master and both fp32 moments, and writes the master, the moments and the bf16
weight: 30 bytes per parameter in bf16 training (28 with a bf16 gradient), the least an fp32-master
AdamW can move. The math is `trainer.optim._adamw`'s (torch.optim.AdamW's),
which stays the reference and the CPU path; tests/test_gpu.py compares the two.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _adamw_kernel(master, exp_avg, exp_avg_sq, grad, weight, inv_scale, n, decay_end, lr, decay_factor,
                  step_size, bias2_sqrt, beta1, beta2, eps, WRITE_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(grad + offs, mask=mask, other=0.0).to(tl.float32) * tl.load(inv_scale)
    p = tl.load(master + offs, mask=mask, other=0.0)
    m = tl.load(exp_avg + offs, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq + offs, mask=mask, other=0.0)
    p = tl.where(offs < decay_end, p * decay_factor, p)
    m = m + (1.0 - beta1) * (g - m)
    v = v * beta2 + (1.0 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) / bias2_sqrt + eps)
    tl.store(master + offs, p, mask=mask)
    tl.store(exp_avg + offs, m, mask=mask)
    tl.store(exp_avg_sq + offs, v, mask=mask)
    if WRITE_WEIGHT:
        tl.store(weight + offs, p.to(weight.dtype.element_ty), mask=mask)


def adamw(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
          weight: torch.Tensor | None, decay_end: int, lr: float, step: int, inv_scale: torch.Tensor,
          beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """In place on contiguous 1-D CUDA tensors; elements [0, decay_end) get the weight decay."""
    n = master.numel()
    grid = (triton.cdiv(n, BLOCK),)
    _adamw_kernel[grid](master, exp_avg, exp_avg_sq, grad, weight if weight is not None else master,
                        inv_scale.float().reshape(1), n, decay_end, lr, 1.0 - lr * weight_decay,
                        lr / (1.0 - beta1 ** step), (1.0 - beta2 ** step) ** 0.5, beta1, beta2, eps,
                        WRITE_WEIGHT=weight is not None, BLOCK=BLOCK)
