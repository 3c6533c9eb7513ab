"""Causal attention forward + backward on one GPU, by backend, at the trainer's shapes: what the attention kernels of
a step cost and whether another of torch's backends would be faster. One run, a table of ratios to the backend the
trainer uses (trainer/attention.py's ATTENTION_BACKENDS: cuDNN first).

    python3 benchmarks/attention_backends.py [--iters 20] [--markdown FILE]

Rows: torch's SDPA with one backend allowed (cuDNN, flash, memory-efficient), keys and values as the model's groups
(enable_gqa) or expanded to every head; the inputs as the trainer lays them out (permuted views of [s, b, heads, d]) or
contiguous [b, heads, s, d]; and FlexAttention (compiled, a causal block mask). TFLOP/s counts the causal half of
4 x b x heads x s^2 x d a pass (backward 2.5 x the forward).
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# (name, batch, heads, groups, seq, head dim): the 1.1B model (TinyLlama shape) and the 7B shape at TP1 and TP4
SHAPES = [("1.1B", 2, 32, 4, 2048, 64), ("7B TP1", 1, 32, 32, 4096, 128), ("7B TP4", 1, 8, 8, 4096, 128)]
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def inputs(b: int, h: int, g: int, s: int, d: int, permuted: bool):
    """q [b, h, s, d], k and v [b, g, s, d], requiring gradients; permuted: views of [s, b, heads, d] tensors."""
    def one(heads):
        if permuted:
            return torch.randn(s, b, heads, d, device="cuda", dtype=torch.bfloat16).permute(1, 2, 0, 3)
        return torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = one(h), one(g), one(g)
    return [t.detach().requires_grad_() for t in (q, k, v)]


def sdpa_pass(backend: SDPBackend, gqa: str):
    def run(q, k, v):
        hpg = q.shape[1] // k.shape[1]
        if gqa == "expanded" and hpg > 1:
            k, v = k.repeat_interleave(hpg, dim=1), v.repeat_interleave(hpg, dim=1)
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa == "gqa" and hpg > 1)
    return run


def flex_pass(s: int):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, s, s, device="cuda")
    compiled = torch.compile(flex_attention)

    def run(q, k, v):
        return compiled(q, k, v, block_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
    return run


def timed(run, q, k, v, iters: int) -> float | None:
    """ms a forward + backward, or None where the backend refuses the inputs."""
    grad = torch.randn(q.shape, device="cuda", dtype=q.dtype)
    try:
        for _ in range(3):
            run(q, k, v).backward(grad)
    except RuntimeError as e:
        print(f"    refused: {str(e).splitlines()[0][:120]}")
        return None
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        run(q, k, v).backward(grad)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--markdown")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}",
             "", "| shape | backend | k, v | inputs | ms fwd+bwd | TFLOP/s | vs the trainer's |",
             "|---|---|---|---|---|---|---|"]
    for name, b, h, g, s, d in SHAPES:
        flops = 3.5 * 4 * b * h * s * s * d / 2
        rows = [(be, gqa, lay, sdpa_pass(BACKENDS[be], gqa)) for be in BACKENDS for gqa in ("gqa", "expanded")
                for lay in ("permuted", "contiguous") if g != h or gqa == "gqa"]
        rows.append(("flex", "gqa", "contiguous", flex_pass(s)))
        base = None
        for be, gqa, lay, run in rows:
            print(f"{name}: {be} {gqa} {lay}", flush=True)
            ms = timed(run, *inputs(b, h, g, s, d, lay == "permuted"), args.iters)
            if be == "cudnn" and gqa == "gqa" and lay == "permuted":
                base = ms
            cells = ["-", "-", "-"] if ms is None else [f"{ms:.3f}", f"{flops / ms / 1e9:.0f}",
                                                         f"{base / ms:.2f}" if base else "-"]
            lines.append(f"| {name} | {be} | {gqa} | {lay} | " + " | ".join(cells) + " |")
    report(lines, args.markdown)


def report(lines: list[str], markdown: str | None) -> None:
    """The table, printed, and written to MARKDOWN where given (gemm_shapes.py's too)."""
    text = "\n".join(lines)
    print(text)
    if markdown:
        with open(markdown, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
