"""Where a traced step's GPU time goes: reads the chrome traces that `THROUGHPUT_TRACE=DIR
benchmarks/train_throughput.py` writes (one per rank, 2 steps) and prints, per rank, the busy time of the
compute stream and of NCCL, how much of NCCL's time ran beside compute kernels (overlapped) and beside none
(exposed), and the compute stream's idle time.

    python3 benchmarks/trace_summary.py DIR
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def intersect(xs, ys) -> float:
    total, j = 0.0, 0
    for a, b in xs:
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k = j
        while k < len(ys) and ys[k][0] < b:
            total += max(0.0, min(b, ys[k][1]) - max(a, ys[k][0]))
            k += 1
    return total


def summarize(path: Path) -> str:
    events = json.loads(path.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    nccl = union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" in e["name"].lower()])
    compute = union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower()])
    if not compute:
        return f"{path.name}: no kernels"
    span = compute[-1][1] - compute[0][0]
    gemm = sum(e["dur"] for e in kernels if e["name"].startswith(("nvjet", "sm90_xmma", "cutlass")))
    overlapped = intersect(nccl, compute)
    return (f"{path.name}: span {span / 1e3:.1f} ms (2 steps); compute busy {length(compute) / 1e3:.1f} ms, idle "
            f"{(span - length(compute)) / 1e3:.1f} ms; GEMMs {gemm / 1e3:.1f} ms; NCCL busy {length(nccl) / 1e3:.1f} ms, "
            f"beside compute {overlapped / 1e3:.1f} ms, exposed {(length(nccl) - overlapped) / 1e3:.1f} ms")


if __name__ == "__main__":
    for trace in sorted(Path(sys.argv[1]).glob("*.json")):
        print(summarize(trace))
