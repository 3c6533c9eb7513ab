"""Benchmark `ckpt merge` and `ckpt reshard` against `cp -r` on a synthetic sharded checkpoint.

For two model sizes (N layers and N/2 layers, same widths, so the same largest tensor) this script
1. writes a Llama-style checkpoint in our format (DESIGN.md Contract 2) with the project's own code:
   full tensors from `trainer.model.full_init` (seeded, no training), split by the layout table,
   written TP2 x PP2 with `TorchFileWriter` (bf16 model + fp32 master/exp_avg/exp_avg_sq), meta.json
   built by the toolkit's own meta writer and committed (temp dir, rename, `latest`) by
   `ckpt_tools.forms.checkpoint.commit`, as the trainer does;
2. times, as subprocesses, `cp -r` of the save dir, `cp` of the model shards only (the bytes merge
   reads), `ckpt merge SRC OUT --format hf` (bf16; it takes the torch-free path), the same merge
   forced onto its torch path (CKPT_MERGE_TORCH=1), and `ckpt reshard SRC OUT --tp 4 --pp 1` (model +
   optimizer); each command is followed by `sync` (counted in its wall time) so every row pays for
   its writes reaching the disk; peak RSS is the command's own (GNU time's %M, else os.wait4);
3. prints one table (and writes it as markdown with --markdown PATH).

Caches are WARM: every command runs once untimed first, so the source files are in the page cache
for every timed run (caches are not dropped; that needs root). Runs are interleaved round by round
and repeated (--repeats, median wall time, max peak RSS); outputs are deleted (and synced) between
runs. Python's bytecode cache is on for the commands (kept under the scratch dir), as for any installed
package. --merge-only times only cp of the model shards, the two merges and merge's start-up (a larger
--size-gb then needs no room for reshard's output). Usage: python benchmarks/merge_reshard.py [--size-gb 2.5] [--quick]
[--merge-only] [--markdown FILE]
"""
from __future__ import annotations

import argparse
import math
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ckpt_tools import io
from ckpt_tools.forms import checkpoint as fmt
from ckpt_tools.forms.writers import TorchFileWriter
from ckpt_tools.model import layout, shard_ops
from ckpt_tools.model.ranks import Rank
from ckpt_tools.model.spec import ModelSpec
from trainer.model import full_init

TP, PP, ITERATION, SEED = 2, 2, 1000, 1234
# the trainer's config keys that give Megatron-LM's param groups and schedule (reshard --format torch_dist carries
# the optimizer state with them)
SCHEDULE = {"lr": 3e-4, "min_lr": 3e-5, "train_iters": 2000, "micro_batch_size": 2, "global_batch_size": 8,
            "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_eps": 1e-8, "weight_decay": 0.1}
MIB = 2**20
CKPT = [sys.executable, "-m", "ckpt_tools.cli"]


# ---------------------------------------------------------------- the synthetic checkpoint
def make_spec(layers: int, quick: bool) -> ModelSpec:
    """Llama-style (RMSNorm, SwiGLU, RoPE, GQA, untied); 4 query groups so TP4 divides them."""
    if quick:
        return ModelSpec("llama", num_layers=layers, hidden_size=64, num_attention_heads=8,
                         num_query_groups=4, ffn_hidden_size=176, vocab_size=1000)
    return ModelSpec("llama", num_layers=layers, hidden_size=1024, num_attention_heads=16, num_query_groups=4,
                     ffn_hidden_size=2816, vocab_size=32000, max_position_embeddings=4096)


def _tensors(spec: ModelSpec, pp: int = PP) -> list[tuple[str, int]]:
    """(global key, full numel x TP copies on disk) of every tensor at TP x PP."""
    padded, counts = spec.padded_vocab_size(TP), layout.layers_per_stage(spec.num_layers, pp)
    out = []
    for p in range(pp):
        for _, key in layout.stage_keys(spec, counts, p):
            split = layout.find_rule(key, spec, pp).split
            if split != layout.EXTRA:
                copies = TP if split == layout.REPLICATED else 1
                out.append((key, math.prod(layout.full_shape(key, spec, padded, pp)) * copies))
    return out


def disk_bytes(spec: ModelSpec) -> int:
    """Bytes of the shards: bf16 parameter + three fp32 optimizer fields per element."""
    return sum(n for _, n in _tensors(spec)) * (2 + 3 * 4)


def layers_for(size_gb: float, quick: bool) -> int:
    """The smallest multiple of 4 layers (so N and N/2 both split over PP2) reaching size_gb."""
    if quick:
        return 4
    fixed = disk_bytes(make_spec(4, False))
    per_layer = (disk_bytes(make_spec(8, False)) - fixed) / 4
    layers = 4 + max(0, math.ceil((size_gb * 1e9 - fixed) / per_layer))
    return -(-layers // 4) * 4


def generate(save_dir: Path, spec: ModelSpec, dtype: torch.dtype = torch.bfloat16, weights_only: bool = False) -> None:
    """Write SAVE_DIR/checkpoint-<ITERATION>/ and SAVE_DIR/latest the way the trainer does (no training): the
    parameters in DTYPE (bf16: the trainer's mixed precision), fp32 master/exp_avg/exp_avg_sq. WEIGHTS_ONLY: the
    parameters at iteration 0 with the fresh optimizer recorded in meta.json and not written (contract 2), the
    size of an import's output."""
    padded, counts = spec.padded_vocab_size(TP), layout.layers_per_stage(spec.num_layers, PP)
    iteration = 0 if weights_only else ITERATION
    tmp = save_dir / fmt.temp_name(iteration)
    tmp.mkdir(parents=True)
    lr = 3e-4
    for p in range(PP):
        model = [TorchFileWriter(tmp / fmt.model_file(Rank(t, p))) for t in range(TP)]
        optim = [] if weights_only else [TorchFileWriter(tmp / fmt.optimizer_file(Rank(t, p))) for t in range(TP)]
        model_state: list[dict] = [{} for _ in range(TP)]
        optim_state: list[dict] = [{} for _ in range(TP)]
        for local, key in layout.stage_keys(spec, counts, p):
            if layout.find_rule(key, spec, PP).split == layout.EXTRA:
                for t in range(TP):
                    model_state[t][local] = None
                continue
            master = full_init(key, spec, padded, SEED)  # fp32, TP/PP-invariant
            fields = {} if weights_only else {"master": master, "exp_avg": master * 1e-2,
                                              "exp_avg_sq": master.square() * 1e-4}
            params = shard_ops.split(key, master.to(dtype), spec, TP, PP)
            parts = {f: shard_ops.split(key, v, spec, TP, PP) for f, v in fields.items()}
            for t in range(TP):
                model_state[t][local] = model[t].tensor(params[t])
                if not weights_only:
                    optim_state[t][local] = {f: optim[t].tensor(parts[f][t]) for f in fields}
                    optim_state[t][local]["step"] = optim[t].tensor(torch.tensor(float(iteration)))
        for t in range(TP):
            model[t].close({"model": model_state[t]})
            if optim:
                optim[t].close({"optimizer": optim_state[t],
                                "param_groups": [{"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}],
                                "scheduler": {"iteration": iteration, "lr": lr}, "scaler": None})
            io.save_file({"torch": torch.get_rng_state(), "python": random.getstate(), "cuda": None,
                          "iteration": iteration, "consumed_samples": iteration * 8}, tmp / fmt.rng_file(Rank(t, p)))
    files = {f.name: fmt.file_record(f) for f in sorted(tmp.iterdir())}
    # the toolkit's own meta.json builder (reshard and import write theirs with it)
    meta = fmt.build_meta(spec, TP, counts, padded, iteration, iteration * 8, str(dtype).removeprefix("torch."), 1,
                           {"seq_length": 2048, **SCHEDULE}, files, {"op": "synthetic", "by": "benchmarks/merge_reshard.py"},
                           fresh_optimizer=weights_only)
    fmt.commit(save_dir, iteration, meta)


# ---------------------------------------------------------------- measuring
def tree_bytes(path: Path, pattern: str = "*") -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob(pattern) if f.is_file())


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    os.sync()


TIME = Path("/usr/bin/time")  # GNU time: the peak RSS of its own child


def child_env(work: Path) -> dict[str, str]:
    """The commands' environment: Python's bytecode cache on, kept under WORK.

    A pip-installed package has its bytecode compiled; with PYTHONDONTWRITEBYTECODE set (as on some
    CI machines) every `ckpt` run would compile the toolkit's modules from source again (~0.07 s
    here), a cost no user pays. The untimed warm-up run fills the cache.
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
    return env


def run(argv: list[str], out: Path, log: Path, env: dict[str, str] | None = None,
        keep: bool = False) -> tuple[float, int, int]:
    """(wall s including a trailing sync, the command's peak RSS in bytes, output bytes); OUT removed after
    (kept with KEEP).

    A child forked from this (torch-sized) process starts with our RSS as its high-water mark, so
    os.wait4's ru_maxrss alone would credit `cp` with ~360 MiB; GNU time, a tiny process, forks the
    command itself and reports its true peak. Without /usr/bin/time, wait4's figure is used.
    """
    remove(out)
    rss_file = log.with_suffix(".rss")
    prefix = [str(TIME), "-f", "%M", "-o", str(rss_file)] if TIME.is_file() else []
    with open(log, "w") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(prefix + argv, stdout=err, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's rusage, not all children's
        proc.returncode = os.waitstatus_to_exitcode(status)
        os.sync()
        wall = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"{' '.join(argv)} failed (exit {proc.returncode}):\n{log.read_text()[-2000:]}")
    rss_kib = int(rss_file.read_text().split()[-1]) if prefix else usage.ru_maxrss
    nbytes = tree_bytes(out)
    if not keep:
        remove(out)
    return wall, rss_kib * 1024, nbytes


CP_ALL, CP_MODEL, MERGE, MERGE_TORCH, RESHARD, STARTUP, STARTUP_MERGE = (
    "cp -r (whole checkpoint)", "cp model shards", "ckpt merge --format hf", "ckpt merge, torch path",
    "ckpt reshard --tp 4 --pp 1", "python startup (imports only)", "python startup, merge's imports (no torch)")
DIST, DIST_TORCH = "ckpt reshard --tp 1 --pp 1 --format torch_dist", "the same, torch path (copy_bytes=False)"
BASE = {CP_ALL: CP_ALL, CP_MODEL: CP_MODEL, MERGE: CP_MODEL, MERGE_TORCH: CP_MODEL,
        RESHARD: CP_ALL, DIST: CP_ALL, DIST_TORCH: CP_ALL}  # what each is compared with
MERGE_ONLY = (CP_MODEL, MERGE, MERGE_TORCH, STARTUP_MERGE)


def operations(src: Path, ckpt_dir: Path, out: Path) -> dict[str, list[str]]:
    models = " ".join(shlex.quote(str(f)) for f in sorted(ckpt_dir.glob("pytorch_model_*.bin")))
    merge = ["merge", str(src), str(out), "--format", "hf", "--quiet"]
    return {
        CP_ALL: ["cp", "-r", str(src), str(out)],
        CP_MODEL: ["sh", "-c", f"mkdir {shlex.quote(str(out))} && cp {models} {shlex.quote(str(out))}/"],
        MERGE: CKPT + merge,
        MERGE_TORCH: ["env", "CKPT_MERGE_TORCH=1"] + CKPT + merge,
        RESHARD: CKPT + ["reshard", str(src), str(out), "--tp", "4", "--pp", "1", "--quiet"],
        STARTUP: [sys.executable, "-c", "import torch, ckpt_tools.cli, ckpt_tools.verbs.merge"],  # with torch
        STARTUP_MERGE: [sys.executable, "-c", "import ckpt_tools.cli, ckpt_tools.verbs.merge, "
                                              "ckpt_tools.forms.byte_ranges"],
        DIST: CKPT + ["reshard", str(src), str(out), "--tp", "1", "--pp", "1", "--format", "torch_dist", "--quiet"],
        DIST_TORCH: [sys.executable, "-c", "import sys, torch; torch.set_num_threads(1); "
                     "from ckpt_tools.verbs.reshard import reshard; reshard(sys.argv[1], sys.argv[2], 1, 1, "
                     "quiet=True, form='torch_dist', copy_bytes=False)", str(src), str(out)],
    }


def largest(spec: ModelSpec, element_size: int) -> int:
    """Bytes of the largest full (TP=1) tensor at the given element size (padded vocab)."""
    padded = spec.padded_vocab_size(TP)
    return max(math.prod(layout.full_shape(k, spec, padded, PP)) for k, _ in _tensors(spec)) * element_size


def bench(spec: ModelSpec, work: Path, repeats: int, warm: bool, names: tuple[str, ...] | None) -> list[dict]:
    src, out = work / f"src-{spec.num_layers}L", work / "out"
    start = time.perf_counter()
    generate(src, spec)
    ckpt_dir = fmt.resolve(src)
    print(f"generated {spec.num_layers} layers: {tree_bytes(src) / 1e9:.2f} GB in "
          f"{time.perf_counter() - start:.0f}s", file=sys.stderr)
    ops = {n: argv for n, argv in operations(src, ckpt_dir, out).items() if names is None or n in names}
    log, env = work / "last.log", child_env(work)
    if warm:  # warm the page cache (and Python's bytecode cache) for every command
        for argv in ops.values():
            run(argv, out, log, env)
    results: dict[str, list[tuple[float, int, int]]] = {name: [] for name in ops}
    for r in range(repeats):  # interleaved: a slow phase of the machine hits every command alike
        for name, argv in ops.items():
            results[name].append(run(argv, out, log, env))
        print(f"  {spec.num_layers} layers, round {r + 1}/{repeats}: "
              + ", ".join(f"{n} {v[-1][0]:.1f}s" for n, v in results.items()), file=sys.stderr)
    model_bytes = tree_bytes(ckpt_dir, "pytorch_model_*")
    read = {CP_ALL: tree_bytes(src), CP_MODEL: model_bytes, MERGE: model_bytes, MERGE_TORCH: model_bytes,
            RESHARD: tree_bytes(src), STARTUP: 0, STARTUP_MERGE: 0, DIST: tree_bytes(src), DIST_TORCH: tree_bytes(src)}
    big = {MERGE: largest(spec, 2), MERGE_TORCH: largest(spec, 2), RESHARD: largest(spec, 4), DIST: largest(spec, 4),
           DIST_TORCH: largest(spec, 4)}
    median = {name: statistics.median(w for w, _, _ in runs) for name, runs in results.items()}
    rows = [{"layers": spec.num_layers, "op": name, "read": read[name], "written": runs[0][2], "wall": median[name],
             "ratio": median[name] / median[BASE[name]] if name in BASE else None,
             "rss": max(m for _, m, _ in runs), "largest": big.get(name), "walls": [w for w, _, _ in runs]}
            for name, runs in results.items()]
    remove(src)
    return rows


# ---------------------------------------------------------------- report
HEADER = ["layers", "operation", "bytes read / written", "wall s (median)", "wall / cp",
          "peak RSS MiB", "largest tensor MiB", "RSS / largest", "RSS <= 2x largest + 512 MiB"]


def table_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        big = r["largest"]
        walls = ", ".join(f"{w:.2f}" for w in r["walls"])
        out.append([str(r["layers"]), r["op"], f"{r['read'] / 1e9:.2f} GB / {r['written'] / 1e9:.2f} GB",
                    f"{r['wall']:.2f} ({walls})", f"{r['ratio']:.2f}" if r["ratio"] is not None else "-",
                    f"{r['rss'] / MIB:,.0f}", f"{big / MIB:,.0f}" if big else "-",
                    f"{r['rss'] / big:.2f}" if big else "-",
                    ("yes" if r["rss"] <= 2 * big + 512 * MIB else "NO") if big else "-"])
    return out


def render(rows: list[dict], markdown: bool) -> str:
    body = table_rows(rows)
    if markdown:
        lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in body]) + "\n"
    widths = [max(len(x) for x in col) for col in zip(HEADER, *body)]
    lines = [HEADER, ["-" * w for w in widths]] + body
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip() for cells in lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.5, help="on-disk size of the larger checkpoint (default 2.5)")
    ap.add_argument("--quick", action="store_true", help="tiny model (a few MB), one round, no warm-up: a CI smoke run")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds per model (default 3; 1 with --quick)")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch dir (default: a new temp dir, removed after)")
    ap.add_argument("--markdown", type=Path, default=None, help="also write the table as markdown to this file")
    ap.add_argument("--merge-only", action="store_true", help="time only cp of the model shards and merge")
    args = ap.parse_args()
    repeats = args.repeats or (1 if args.quick else 3)
    layers = layers_for(args.size_gb, args.quick)
    specs = [make_spec(layers // 2, args.quick), make_spec(layers, args.quick)]
    need = (1.2 if args.merge_only else 2.2) * disk_bytes(specs[-1])  # one source + the largest output
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.workdir))
    if shutil.disk_usage(work).free < need:
        shutil.rmtree(work)
        sys.exit(f"{work}: needs {need / 1e9:.1f} GB free disk; lower --size-gb or pick --workdir elsewhere")
    load_before = os.getloadavg()[0]
    try:
        names = MERGE_ONLY if args.merge_only else None
        rows = [row for spec in specs for row in bench(spec, work, repeats, not args.quick, names)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    s = specs[-1]
    note = (f"llama hidden {s.hidden_size}, ffn {s.ffn_hidden_size}, {s.num_attention_heads} heads in "
            f"{s.num_query_groups} query groups, vocab {s.vocab_size}; source TP{TP} x PP{PP}, bf16 params + fp32 "
            f"master/exp_avg/exp_avg_sq.\nWarm page cache; {repeats} round(s): median wall (each run in brackets), "
            f"max peak RSS; every command followed by sync. merge (its torch-free path; 'torch path': the same merge\n"
            f"with CKPT_MERGE_TORCH=1) is compared with cp of the model shards (the bytes it reads), reshard (into our format and,\n"
            f"model + optimizer, into Megatron-LM's torch_dist: by copying the source's shards as its chunks, and through\n"
            f"torch) with cp -r of the whole checkpoint. Largest tensor: the largest full tensor, "
            f"bf16 for merge, fp32 for reshard.\n{os.cpu_count()} CPUs, 1-min load average {load_before:.1f} "
            f"before, {os.getloadavg()[0]:.1f} after.\n")
    print("\n" + note)
    print(render(rows, markdown=False))
    if args.markdown:
        args.markdown.write_text(note.replace("\n", " ").strip() + "\n\n" + render(rows, markdown=True))


if __name__ == "__main__":
    main()
