"""Benchmark `ckpt merge / reshard / import --nproc-per-node N` (ckpt_tools.team) against `cp -r`, N = 1, 2, 4.

1. writes the synthetic Llama-style checkpoint of benchmarks/merge_reshard.py (TP2 x PP2, bf16 model + fp32
   optimizer state, our format) and merges it once to an HF dir (the import source);
2. times, as subprocesses (warm page cache, interleaved rounds, median wall time, each command followed by `sync`),
   `cp -r` of the checkpoint and of the HF dir, and with 1, 2 and 4 processes: `ckpt reshard --tp 4 --pp 1` (model +
   optimizer, our format), `ckpt reshard --tp 1 --pp 1 --format torch_dist` (model + optimizer), `ckpt merge
   --max-shard-size 200MB` and `ckpt import --tp 2 --pp 2 --format torch_dist`;
3. prints one table: wall / cp of the same bytes (the whole checkpoint for reshard, its model shards for merge, the
   HF dir for import), the same less the team's start-up (a merge of a 1 MB checkpoint with as many processes), the
   speed-up over one process, and the peak RSS of the largest process (GNU time: the launcher or, waited for by it,
   any process of the team).

A team's fixed cost is its start-up: on one node the launcher starts the processes and they meet through process 0
(no torch imported for it; under 1 s here), across nodes torchrun and gloo (3-5 s); the figures that matter are
per-process byte rates at larger sizes and core counts.
Usage: python benchmarks/team_scaling.py [--size-gb 2] [--procs 1,2,4] [--repeats 3] [--quick] [--markdown FILE]
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from merge_reshard import CKPT, MIB, child_env, generate, layers_for, make_spec, remove, run, tree_bytes

from ckpt_tools.forms import checkpoint as fmt

CP_ALL, CP_MODEL, CP_HF = "cp -r checkpoint", "cp model shards", "cp -r HF dir"
STARTUP = "start-up (merge of a 1 MB checkpoint)"


def operations(src: Path, hf: Path, tiny: Path, out: Path, procs: list[int]) -> dict[str, tuple[list[str], str]]:
    """name -> (argv, the cp row it is compared with)."""
    models = " ".join(shlex.quote(str(f)) for f in sorted(fmt.resolve(src).glob("pytorch_model_*.bin")))
    ops = {CP_ALL: (["cp", "-r", str(src), str(out)], ""),
           CP_MODEL: (["sh", "-c", f"mkdir {shlex.quote(str(out))} && cp {models} {shlex.quote(str(out))}/"], ""),
           CP_HF: (["cp", "-r", str(hf), str(out)], "")}
    verbs = {STARTUP: (["merge", str(tiny), str(out)], ""),
             "reshard --tp 4 --pp 1": (["reshard", str(src), str(out), "--tp", "4", "--pp", "1"], CP_ALL),
             "reshard --format torch_dist": (["reshard", str(src), str(out), "--tp", "1", "--pp", "1", "--format",
                                              "torch_dist"], CP_ALL),
             "merge --format hf": (["merge", str(src), str(out), "--max-shard-size", "200MB"], CP_MODEL),
             "import --format torch_dist": (["import", str(hf), str(out), "--tp", "2", "--pp", "2", "--format",
                                             "torch_dist"], CP_HF)}
    for name, (argv, base) in verbs.items():
        for n in procs:
            ops[f"{name}, {n} proc"] = (CKPT + argv + ["-q", "--nproc-per-node", str(n)], base)
    return ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.0, help="on-disk size of the checkpoint (default 2)")
    ap.add_argument("--procs", default="1,2,4", help="team sizes (default 1,2,4)")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds (default 3; 1 with --quick)")
    ap.add_argument("--quick", action="store_true", help="tiny model, one round, no warm-up: a smoke run")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch dir (default: a new temp dir, removed after)")
    ap.add_argument("--markdown", type=Path, default=None, help="also write the table as markdown to this file")
    args = ap.parse_args()
    procs = [int(n) for n in args.procs.split(",")]
    repeats = args.repeats or (1 if args.quick else 3)
    spec = make_spec(layers_for(args.size_gb, args.quick), args.quick)
    work = Path(tempfile.mkdtemp(prefix="ckpt-team-", dir=args.workdir))
    try:
        src, hf, out, log, env = work / "src", work / "hf", work / "out", work / "last.log", child_env(work)
        tiny = work / "tiny"
        generate(src, spec)
        generate(tiny, make_spec(4, True))
        subprocess.run(CKPT + ["merge", str(src), str(hf), "-q", "--max-shard-size", "200MB"], check=True, env=env)
        ops = operations(src, hf, tiny, out, procs)
        if not args.quick:
            for argv, _ in ops.values():
                run(argv, out, log, env)
        walls: dict[str, list[float]] = {name: [] for name in ops}
        rss: dict[str, int] = {}
        for r in range(repeats):
            for name, (argv, _) in ops.items():
                wall, peak, _ = run(argv, out, log, env)
                walls[name].append(wall)
                rss[name] = max(rss.get(name, 0), peak)
            print(f"round {r + 1}/{repeats} done", file=sys.stderr)
        median = {name: statistics.median(w) for name, w in walls.items()}
        header = ["operation", "processes", "wall s (median)", "wall / cp", "(wall - start-up) / cp",
                  "speed-up over 1 process", "peak RSS of one process MiB"]
        rows = []
        for name, (_, base) in ops.items():
            verb, _, n = name.rpartition(", ")
            one, start = f"{verb}, 1 proc", f"{STARTUP}, {n}"
            work_s = median[name] - median[start] if base else None
            rows.append([verb or name, n.split()[0] if verb else "-", f"{median[name]:.2f}",
                         f"{median[name] / median[base]:.2f}" if base else "-",
                         f"{work_s / median[base]:.2f}" if base else "-",
                         f"{median[one] / median[name]:.2f}" if base else "-",
                         f"{rss[name] / MIB:,.0f}"])
        sizes = f"checkpoint {tree_bytes(src) / 1e9:.2f} GB, HF dir {tree_bytes(hf) / 1e9:.2f} GB"
        print(f"{sizes}; {os.cpu_count()} cores; {repeats} round(s)")
        widths = [max(len(x) for x in col) for col in zip(header, *rows)]
        for cells in [header, ["-" * w for w in widths], *rows]:
            print("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())
        if args.markdown:
            lines = [f"{sizes}; {os.cpu_count()} cores; {repeats} round(s)", "",
                     "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            args.markdown.write_text("\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n")
    finally:
        remove(work)


if __name__ == "__main__":
    main()
