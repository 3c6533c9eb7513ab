"""The trainer's GEMMs one by one on a GPU, at the 1.1B model's shapes (and the 7B shape at TP4): TFLOP/s of the
forward (bf16 out), the input gradient (bf16 out) and the weight gradient added into the fp32 buffer inside the GEMM
(trainer/wgrad.py, `addmm(..., out_dtype=float32)`), next to the same weight gradient written in bf16. One run, a
table; the peak is the H100/H200 dense bf16 989 TFLOP/s.

    python3 benchmarks/gemm_shapes.py [--iters 50] [--markdown FILE]
"""
from __future__ import annotations

import argparse

import torch
from attention_backends import report

PEAK = 989e12
# (model, tokens a micro-batch, [(linear, in, out)])
MODELS = [("1.1B", 4096, [("linear_qkv", 2048, 2560), ("linear_proj", 2048, 2048), ("linear_fc1", 2048, 11264),
                          ("linear_fc2", 5632, 2048), ("output_layer", 2048, 32000)]),
          ("7B TP4", 4096, [("linear_qkv", 4096, 3072), ("linear_proj", 1024, 4096), ("linear_fc1", 4096, 5504),
                            ("linear_fc2", 2752, 4096), ("output_layer", 4096, 8000)])]


def timed(fn, iters: int) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--markdown")
    args = ap.parse_args()
    bf = dict(device="cuda", dtype=torch.bfloat16)
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}", "",
             "| model | linear | [tokens, in] -> out | fwd | dgrad | wgrad into fp32 | wgrad bf16 "
             "| wgrad fp32 / bf16 |",
             "|---|---|---|---|---|---|---|---|"]
    total = {}
    for model, t, linears in MODELS:
        for name, k, n in linears:
            x, w, dy = torch.randn(t, k, **bf), torch.randn(n, k, **bf), torch.randn(t, n, **bf)
            main_grad = torch.zeros(n, k, device="cuda", dtype=torch.float32)
            flops = 2 * t * k * n
            ms = {"fwd": timed(lambda: x @ w.t(), args.iters), "dgrad": timed(lambda: dy @ w, args.iters),
                  "wgrad32": timed(lambda: torch.addmm(main_grad, dy.t(), x, out_dtype=torch.float32, out=main_grad),
                                   args.iters),
                  "wgrad16": timed(lambda: dy.t() @ x, args.iters)}
            for key, v in ms.items():
                total[(model, key)] = total.get((model, key), 0.0) + v
            cell = {key: f"{v:.3f} ms, {flops / v / 1e9 / (PEAK / 1e12) * 100:.0f}%" for key, v in ms.items()}
            lines.append(f"| {model} | {name} | [{t}, {k}] -> {n} | {cell['fwd']} | {cell['dgrad']} | "
                         f"{cell['wgrad32']} | {cell['wgrad16']} | {ms['wgrad32'] / ms['wgrad16']:.2f} |")
    lines.append("")
    for model, _, _ in MODELS:
        lines.append(f"{model}, one of each linear: " + ", ".join(f"{k} {total[(model, k)]:.3f} ms"
                                                                  for k in ("fwd", "dgrad", "wgrad32", "wgrad16")))
    report(lines, args.markdown)


if __name__ == "__main__":
    main()
