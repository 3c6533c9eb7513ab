"""Where a traced step's GPU time goes: reads the chrome traces that `THROUGHPUT_TRACE=DIR
benchmarks/train_throughput.py` writes (one per rank, 2 steps) and prints, per rank, the busy time of the
compute stream and of NCCL, how much of NCCL's time ran beside compute kernels (overlapped) and beside none
(exposed), and the compute stream's idle time.

    python3 benchmarks/trace_summary.py DIR
    python3 benchmarks/trace_summary.py DIR --gaps   # also: the compute stream's idle time by the kernels around it
    python3 benchmarks/trace_summary.py DIR --kernels  # also: GPU time by kernel, one column per trace
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


def short(name: str) -> str:
    """A kernel's name without its template arguments, at most 60 characters."""
    return name.split("<")[0].split("(")[0][:60]


def gaps(path: Path, top: int = 12, floor_us: float = 5.0) -> str:
    """The compute stream's idle time (gaps of at least FLOOR_US between the union of non-NCCL kernels), summed by
    the kernel before and after each gap, largest first; and how many gaps of each size."""
    events = json.loads(path.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    kernels = sorted((e for e in events if e.get("cat") == "kernel" and "dur" in e and "nccl" not in e["name"].lower()),
                     key=lambda e: e["ts"])
    by_pair: dict[tuple[str, str], list[float]] = {}
    sizes = {"5-50 us": 0.0, "50-150 us": 0.0, "0.15-1 ms": 0.0, ">1 ms": 0.0}
    end, last = None, None
    for e in kernels:
        if end is not None and e["ts"] - end >= floor_us:
            gap = e["ts"] - end
            pair = by_pair.setdefault((short(last["name"]), short(e["name"])), [0.0, 0])
            pair[0] += gap
            pair[1] += 1
            key = "5-50 us" if gap < 50 else "50-150 us" if gap < 150 else "0.15-1 ms" if gap < 1000 else ">1 ms"
            sizes[key] += gap
        if end is None or e["ts"] + e["dur"] > end:
            end, last = e["ts"] + e["dur"], e
    by_size = ", ".join(f"{k} {v / 1e3:.1f} ms" for k, v in sizes.items())
    lines = [f"{path.name}: idle by gap size (2 steps): {by_size}"]
    for (a, b), (total, n) in sorted(by_pair.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {total / 1e3:8.2f} ms in {n:5d} gaps  after {a}  before {b}")
    return "\n".join(lines)


def kernel_table(paths: list[Path], top: int = 40) -> str:
    """Per kernel (name without template arguments; NCCL's apart), its summed time in each trace, ms a step (the
    traces hold 2), largest first by the traces' largest; the last row: every kernel."""
    columns = []
    for path in paths:
        events = json.loads(path.read_text())
        events = events["traceEvents"] if isinstance(events, dict) else events
        totals: dict[str, float] = {}
        for e in events:
            if e.get("cat") == "kernel" and "dur" in e:
                totals[short(e["name"])] = totals.get(short(e["name"]), 0.0) + e["dur"] / 2e3
        columns.append(totals)
    names = sorted({n for c in columns for n in c}, key=lambda n: -max(c.get(n, 0.0) for c in columns))
    width = max(len(p.stem) for p in paths)
    lines = ["ms a step: " + " | ".join(p.stem.rjust(width) for p in paths)]
    for n in names[:top]:
        lines.append(" | ".join(f"{c.get(n, 0.0):{width}.2f}" for c in columns) + f"  {n}")
    lines.append(" | ".join(f"{sum(c.values()):{width}.2f}" for c in columns) + "  (all kernels)")
    return "\n".join(lines)


if __name__ == "__main__":
    for trace in sorted(Path(sys.argv[1]).glob("*.json")):
        print(summarize(trace))
        if "--gaps" in sys.argv[2:]:
            print(gaps(trace))
    if "--kernels" in sys.argv[2:]:
        print(kernel_table(sorted(Path(sys.argv[1]).glob("*.json"))))
