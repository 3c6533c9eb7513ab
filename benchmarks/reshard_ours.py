"""Reshard of our format into our format: from the source's bytes (paths.by_bytes, verbs/ours_copy.reshard: the
source's shards and optimizer fields cut to the target's rank files by the layout table's pieces, copied file to file
in the kernel, a row-parallel shard gathered in memory) against the same writer over the source read through its
torch reader (`copy_bytes=False`: every tensor made by torch; the path a damaged or declined source takes), and
against `cp -r` of the output. (Before the torch path of reshard was removed, the "torch path" column was reshard.run:
docs/benchmarks.md has both runs.)

Source: the copy-speed matrix's "ours bf16" (benchmarks/matrix.py: a Llama of 24 heads in 12 query groups, bf16
weights with fp32 master, exp_avg and exp_avg_sq, TP2 x PP2; 1 GB of weights is 7.2 GB on disk). Jobs: TP2 -> TP1
(join), TP2 -> TP3 (a split that is not a power of two), PP2 -> PP3 with uneven stages; the optimizer carried. Each
command a subprocess, warm page cache, rounds alternating, median wall time, `sync` after each; peak RSS by GNU time.
A byte-path run that the byte path declines fails the benchmark.

Usage: python benchmarks/reshard_ours.py [--size-gb 1.0] [--repeats 3] [--quick] [--markdown FILE]
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def command(src: Path, out: Path, tp: int, pp: int, layers: list[int] | None, copy_bytes: bool) -> list[str]:
    # the byte path alone (a source it declines fails the benchmark), or the source read through its torch reader
    head = "import sys; from ckpt_tools.verbs import paths; from ckpt_tools.verbs.request import Request; "
    byte = (f"sys.exit('the byte path declined the job') if paths.by_bytes(sys.argv[1], sys.argv[2], "
            f"Request({tp}, {pp}, {layers!r}), quiet=True) is None else None")
    torch_reader = (f"paths.reshard(sys.argv[1], sys.argv[2], Request({tp}, {pp}, {layers!r}), quiet=True, "
                    "copy_bytes=False, tuned=True)")
    code = head + (byte if copy_bytes else torch_reader)
    return [sys.executable, "-c", code, str(src), str(out)]


def main() -> None:
    import torch
    from matrix import make_spec, uneven
    from merge_reshard import child_env, generate
    from per_tensor_import import PATHS_HEADER, paths_args, print_table, timed_paths
    a, repeats, work = paths_args(__doc__, "ckpt-reshard-ours-")
    env = child_env(work)
    try:
        spec = make_spec(a.size_gb, a.quick)
        generate(work / "ours", spec, torch.bfloat16)
        jobs = {"TP2 -> TP1": (1, 2, None), "TP2 -> TP3": (3, 2, None),
                "PP2 -> PP3 (uneven)": (2, 3, [int(n) for n in uneven(spec.num_layers).split(",")])}
        rows = [[job, *timed_paths({"byte path": command(work / "ours", work / "out", *target, True),
                                    "torch path": command(work / "ours", work / "out", *target, False)},
                                   work / "out", work, env, repeats)]
                for job, target in jobs.items()]
        print(f"{spec.num_layers} layers, hidden {spec.hidden_size}, ffn {spec.ffn_hidden_size}, vocab "
              f"{spec.vocab_size}; ours bf16 + fp32 master, exp_avg, exp_avg_sq, TP2 x PP2")
        print_table(["reshard ours -> ours"] + PATHS_HEADER, rows, a.markdown)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    main()
