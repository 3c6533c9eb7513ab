"""Where a traced step's GPU time goes: reads the chrome traces that `THROUGHPUT_TRACE=DIR
benchmarks/train_throughput.py` writes (one per rank, 2 steps) and prints, per rank, the busy time of the
compute stream and of NCCL, how much of NCCL's time ran beside compute kernels (overlapped) and beside none
(exposed), and the compute stream's idle time.

    python3 benchmarks/trace_summary.py DIR
    python3 benchmarks/trace_summary.py DIR --gaps      # also: the idle time by the kernels around each gap
    python3 benchmarks/trace_summary.py DIR --kernels   # also: GPU time by kernel, one column per trace
"""
from __future__ import annotations

import argparse
import gzip
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


STEPS = 2  # the steps a trace of benchmarks/train_throughput.py holds


def load_kernels(path: Path) -> list[dict]:
    """The GPU kernel events of a chrome trace (.json, or .json.gz)."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    events = json.loads(raw)
    events = events["traceEvents"] if isinstance(events, dict) else events
    return [e for e in events if e.get("cat") == "kernel" and "dur" in e]


def is_nccl(e: dict) -> bool:
    return "nccl" in e["name"].lower()


def summarize(path: Path) -> str:
    kernels = load_kernels(path)
    nccl = union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if is_nccl(e)])
    compute = union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if not is_nccl(e)])
    if not compute:
        return f"{path.name}: no kernels"
    span = compute[-1][1] - compute[0][0]
    gemm = sum(e["dur"] for e in kernels if e["name"].startswith(("nvjet", "sm90_xmma", "cutlass")))
    overlapped = intersect(nccl, compute)
    return (f"{path.name}: span {span / 1e3:.1f} ms ({STEPS} steps); compute busy {length(compute) / 1e3:.1f} ms, "
            f"idle {(span - length(compute)) / 1e3:.1f} ms; GEMMs {gemm / 1e3:.1f} ms; NCCL busy "
            f"{length(nccl) / 1e3:.1f} ms, beside compute {overlapped / 1e3:.1f} ms, exposed "
            f"{(length(nccl) - overlapped) / 1e3:.1f} ms")


def short(name: str) -> str:
    """A kernel's name without its argument list, template arguments, anonymous namespaces and `void`."""
    if name.endswith(")"):  # the argument list: the last balanced (...)
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                name = name[:i]
                break
    kept, depth = [], 0
    for ch in name:
        if ch == "<":
            depth += 1
        elif ch == ">" and depth:
            depth -= 1
        elif depth == 0:
            kept.append(ch)
    name = "".join(kept).replace("(anonymous namespace)::", "").strip()
    return name.removeprefix("void ").strip()[:70]


def gaps(path: Path, top: int = 12, floor_us: float = 5.0) -> str:
    """Idle time between the GPU's non-NCCL kernels (on any stream: gaps of at least FLOOR_US in their union), summed
    by the kernel that ended last before each gap and the one after it, largest first; and by the gap's size."""
    kernels = sorted((e for e in load_kernels(path) if not is_nccl(e)), key=lambda e: e["ts"])
    by_pair: dict[tuple[str, str], list[float]] = {}
    bounds = ((50, f"{floor_us:g}-50 us"), (150, "50-150 us"), (1000, "0.15-1 ms"), (float("inf"), ">1 ms"))
    sizes = {label: 0.0 for _, label in bounds}
    end, last = None, None
    for e in kernels:
        if end is not None and e["ts"] - end >= floor_us:
            gap = e["ts"] - end
            pair = by_pair.setdefault((short(last["name"]), short(e["name"])), [0.0, 0])
            pair[0] += gap
            pair[1] += 1
            sizes[next(label for bound, label in bounds if gap < bound)] += gap
        if end is None or e["ts"] + e["dur"] > end:
            end, last = e["ts"] + e["dur"], e
    by_size = ", ".join(f"{k} {v / 1e3:.2f} ms" for k, v in sizes.items())
    lines = [f"{path.name}: idle by gap size ({STEPS} steps): {by_size}"]
    for (a, b), (total, n) in sorted(by_pair.items(), key=lambda kv: (-kv[1][0], kv[0]))[:top]:
        lines.append(f"  {total / 1e3:8.2f} ms in {n:5d} gaps  after {a}  before {b}")
    return "\n".join(lines)


def kernel_table(paths: list[Path], top: int = 40) -> str:
    """Per kernel name (`short`), its summed time in each trace in ms a step, one column per trace, largest first by
    the traces' largest (NCCL's kernels among them); the last rows: every kernel, and every kernel but NCCL's."""
    if not paths:
        return "no traces"
    columns, nccl = [], []
    for path in paths:
        totals: dict[str, float] = {}
        kernels = load_kernels(path)
        for e in kernels:
            totals[short(e["name"])] = totals.get(short(e["name"]), 0.0) + e["dur"] / (1e3 * STEPS)
        columns.append(totals)
        nccl.append(sum(e["dur"] for e in kernels if is_nccl(e)) / (1e3 * STEPS))
    names = sorted({n for c in columns for n in c}, key=lambda n: (-max(c.get(n, 0.0) for c in columns), n))
    width = max(len(p.name) for p in paths)
    lines = ["ms a step: " + " | ".join(p.name.rjust(width) for p in paths)]
    for n in names[:top]:
        lines.append(" | ".join(f"{c.get(n, 0.0):{width}.2f}" for c in columns) + f"  {n}")
    lines.append(" | ".join(f"{sum(c.values()):{width}.2f}" for c in columns) + "  (all kernels)")
    lines.append(" | ".join(f"{sum(c.values()) - x:{width}.2f}" for c, x in zip(columns, nccl)) + "  (all but NCCL)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="the traces (*.json or *.json.gz), one per rank")
    ap.add_argument("--gaps", action="store_true", help="also: the idle time by the kernels around each gap")
    ap.add_argument("--kernels", action="store_true", help="also: GPU time by kernel, one column per trace")
    args = ap.parse_args()
    traces = sorted([*args.dir.glob("*.json"), *args.dir.glob("*.json.gz")])
    if not traces:
        sys.exit(f"{args.dir}: no *.json or *.json.gz traces")
    for trace in traces:
        print(summarize(trace))
        if args.gaps:
            print(gaps(trace))
    if args.kernels:
        print(kernel_table(traces))


if __name__ == "__main__":
    main()
