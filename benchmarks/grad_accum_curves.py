"""Loss curves of one short bf16 run with gradients accumulated in fp32 (the default) and in bf16, against the
same run in fp32: how far each bf16 curve strays from the fp32 one.

Three runs of the bundled trainer (`python -m trainer`, one process, GPU if there is one) on the fixture corpus,
same seed, same data order, same initial weights: fp32; bf16 weights with fp32 masters and
`accumulate_allreduce_grads_in_fp32=true`; the same with `false`. Each step accumulates --micro-batches
micro-batches. Prints, per bf16 run, the mean and max over iterations of |loss - fp32 loss| (all iterations, and
the last half), and writes the per-iteration curves as JSON with --curves FILE.

    python benchmarks/grad_accum_curves.py                 # a 4-layer, hidden-256 Llama, 100 steps of 32 x 1 x 128 tokens
    python benchmarks/grad_accum_curves.py --quick         # tiny model, 4 steps (CPU smoke run)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "fixtures" / "configs" / "tiny_llama.yaml"
MODEL = dict(num_layers=4, hidden_size=256, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=704,
             max_position_embeddings=128, seq_length=128, micro_batch_size=1, lr=3e-4, min_lr=3e-5,
             lr_warmup_iters=10)
QUICK = dict(num_layers=2, hidden_size=64, ffn_hidden_size=176, seq_length=32)
RUNS = {"fp32": dict(dtype="fp32"),
        "bf16, fp32 accumulation": dict(dtype="bf16", accumulate_allreduce_grads_in_fp32="true"),
        "bf16, bf16 accumulation": dict(dtype="bf16", accumulate_allreduce_grads_in_fp32="false")}


def run(name: str, settings: dict, work: Path) -> list[float]:
    save = work / name.replace(" ", "").replace(",", "_")
    cmd = [sys.executable, "-m", "trainer", "--config", str(CONFIG)]
    for k, v in {**settings, "save_dir": save, "data_cache_dir": work / "cache", "log_interval": 1,
                 "save_interval": 0, "tp_degree": 1, "pp_degree": 1}.items():
        cmd += ["--set", f"{k}={v}"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "MASTER_PORT": str(29700 + len(os.listdir(work)))}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name}: the trainer failed\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return [json.loads(line)["loss"] for line in (save / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--micro-batches", type=int, default=32)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--curves", help="write the per-iteration losses of every run as JSON here")
    args = p.parse_args()
    model = dict(MODEL, **(QUICK if args.quick else {}))
    iters = 4 if args.quick else args.iters
    common = dict(model, train_iters=iters, num_micro_batches=args.micro_batches)
    with tempfile.TemporaryDirectory() as tmp:
        curves = {name: run(name, {**common, **settings}, Path(tmp)) for name, settings in RUNS.items()}
    ref = curves["fp32"]
    half = len(ref) // 2
    print(f"{iters} steps of {args.micro_batches} micro-batches x {model['micro_batch_size']} x "
          f"{model['seq_length']} tokens; fp32 loss {ref[0]:.4f} -> {ref[-1]:.4f}\n")
    print("| run | final loss | mean abs diff to fp32 | max abs diff | mean abs diff, last half |")
    print("|---|---|---|---|---|")
    for name, losses in curves.items():
        if name == "fp32":
            continue
        diff = [abs(a - b) for a, b in zip(losses, ref)]
        print(f"| {name} | {losses[-1]:.4f} | {statistics.mean(diff):.4f} | {max(diff):.4f} | "
              f"{statistics.mean(diff[half:]):.4f} |")
    if args.curves:
        Path(args.curves).write_text(json.dumps(curves))


if __name__ == "__main__":
    main()
