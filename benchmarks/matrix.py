"""Every input x every operation against `cp` of the same bytes, in one run: the copy-speed matrix.

Inputs, each a TP2 x PP2 checkpoint of one Llama-style model (24 heads in 12 query groups, so TP 3 divides it):
- ours bf16: our format, bf16 parameters + fp32 master/exp_avg/exp_avg_sq (what the trainer saves in bf16);
- ours fp32: the same with fp32 parameters;
- Megatron-LM torch_dist and Megatron-LM legacy torch: written by megatron-core itself (bf16, weights only;
  tests/mcore_checkpoints.py under torchrun, gloo on CPU);
- HF: the HF model that `ckpt merge` makes of "ours bf16" (vocab trimmed, bf16 safetensors).
Operations: merge to HF; reshard with TP join (TP1), TP split (TP4), TP 3 (not a power of two), PP 2 -> 3 with
uneven stages; export into Megatron-LM's torch_dist and legacy torch (ours -> both; each Megatron-LM form -> the
other); import of the HF model into ours (TP3 x PP2, a fresh optimizer), into torch_dist and into torch (TP2 x
PP2). Reshard writes the source's own form (ours -> ours, torch_dist -> torch_dist, torch -> torch) and carries
the optimizer state where the source has one (export of ours into the legacy torch form: weights only, the
form this version writes an optimizer into being torch_dist).

Each cell times the command (subprocess, followed by `sync`, warm page cache, median of --repeats runs) against
`cp -r` of the output that command wrote, the two alternating: the cost of writing the same bytes. Peak RSS is the
command's own (GNU time). The largest tensor is the model's largest full tensor in the element size the command
moves (fp32 where an optimizer is carried). Targets (issue 21): wall <= 1.25 x cp; RSS <= 2 x largest + 512 MiB.
Start-up: `ckpt --help` and a merge of a tiny checkpoint, with torch left unimported.

Sizes beyond the page cache and the disk (20 GB of weights: ours bf16 alone would be 140 GB) take `--inputs-by ckpt`:
the HF model is merged from a weights-only checkpoint of ours, the Megatron-LM forms are what `ckpt import` makes
of it (torch_dist, TP2 x PP2) and what `ckpt reshard` makes of that (torch), each input made when its cells come
and removed after them; with `--cold` the first run of each cell counts (no untimed warm-up: the page cache cannot
hold the files). `--ops` picks operations by a part of their name, `--procs N` adds each chosen cell run by a team
of N processes (`--nproc-per-node N`); `--drop-caches` (root) drops the page cache before every command and every cp,
so that both read from the disk (a command's output, just written, would otherwise be read by its cp from memory).

    python benchmarks/matrix.py [--size-gb 1] [--repeats 3] [--markdown FILE]
    python benchmarks/matrix.py --quick          # tiny model, one round: a CI smoke run
    python benchmarks/matrix.py --size-gb 20 --inputs-by ckpt --cold --drop-caches --only HF,torch_dist \
        --ops "import -> ours,import -> torch_dist,merge,TP2 -> TP3" --procs 2
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import megatron_forms  # noqa: E402
import merge_reshard  # noqa: E402
from merge_reshard import CKPT, MIB, child_env, remove, run, tree_bytes  # noqa: E402

from ckpt_tools.model.spec import ModelSpec  # noqa: E402

TP, PP = 2, 2
INPUTS = ("ours bf16", "ours fp32", "torch_dist", "torch", "HF")
FORM = {"ours bf16": "ours", "ours fp32": "ours", "torch_dist": "torch_dist", "torch": "torch"}
OPERATIONS = ("merge -> HF", "reshard TP2 -> TP1", "reshard TP2 -> TP4", "reshard TP2 -> TP3",
              "reshard PP2 -> PP3 (uneven)", "export -> torch_dist", "export -> torch",
              "import -> ours TP3xPP2", "import -> torch_dist TP2xPP2", "import -> torch TP2xPP2")


def make_spec(size_gb: float, quick: bool) -> ModelSpec:
    """As many layers (a multiple of 2, not of 3: PP 3 is uneven) as make SIZE_GB of bf16 weights."""
    if quick:
        return ModelSpec("llama", num_layers=4, hidden_size=96, num_attention_heads=12, num_query_groups=12,
                         ffn_hidden_size=264, vocab_size=1000, max_position_embeddings=256)
    one = ModelSpec("llama", num_layers=1, hidden_size=1536, num_attention_heads=24, num_query_groups=12,
                    ffn_hidden_size=4104, vocab_size=32000, max_position_embeddings=4096)
    layers = max(4, megatron_forms.layers_for(one, size_gb, 2))
    layers += 2 if layers % 3 == 0 else 0
    return ModelSpec(**{**one.to_dict(), "num_layers": layers})


def uneven(layers: int) -> str:
    """A PP 3 split whose stages differ: the first stage one layer lighter (it holds the embedding)."""
    base = layers // 3
    first = base - 1 if layers % 3 == 0 else base
    rest = layers - first
    return f"{first},{rest - rest // 2},{rest // 2}"


def largest(spec: ModelSpec, element_size: int) -> int:
    """Bytes of the model's largest full tensor at ELEMENT_SIZE."""
    return megatron_forms.largest(spec) // 2 * element_size  # megatron_forms counts bf16


# ---------------------------------------------------------------- the inputs
def make_inputs(work: Path, spec: ModelSpec, env: dict, chosen: list[str], by: str) -> Iterator[tuple[str, Path]]:
    """(name, dir) of each chosen input in turn. By megatron-core: all made first, as Megatron-LM saves them. By
    ckpt: each made when its turn comes and removed once its cells are measured (one large input on disk at a time,
    beside the one it is made from)."""
    def ckpt(*argv: str) -> None:
        subprocess.run(CKPT + list(argv) + ["--quiet"], env=env, check=True, stdout=subprocess.DEVNULL)

    if by == "megatron-core":
        sources = {}
        for name, dtype in (("ours bf16", torch.bfloat16), ("ours fp32", torch.float32)):
            sources[name] = work / name.replace(" ", "-")
            merge_reshard.generate(sources[name], spec, dtype)
        mcore = megatron_forms.generate(work, spec)
        sources["torch_dist"], sources["torch"] = mcore / "torch_dist", mcore / "torch"
        sources["HF"] = work / "hf"
        ckpt("merge", str(sources["ours bf16"]), str(sources["HF"]), "--format", "hf")
        yield from ((n, sources[n]) for n in chosen)
        return
    for name, dtype in (("ours bf16", torch.bfloat16), ("ours fp32", torch.float32)):
        if name in chosen:
            merge_reshard.generate(work / "ours", spec, dtype)
            yield name, work / "ours"
            remove(work / "ours")
    if not {"HF", "torch_dist", "torch"} & set(chosen):
        return
    merge_reshard.generate(work / "weights", spec, torch.bfloat16, weights_only=True)
    ckpt("merge", str(work / "weights"), str(work / "hf"), "--format", "hf")
    remove(work / "weights")
    if "HF" in chosen:
        yield "HF", work / "hf"
    if not {"torch_dist", "torch"} & set(chosen):
        return remove(work / "hf")
    ckpt("import", str(work / "hf"), str(work / "torch_dist"), "--tp", str(TP), "--pp", str(PP), "--format",
         "torch_dist")
    remove(work / "hf")
    if "torch_dist" in chosen:
        yield "torch_dist", work / "torch_dist"
    if "torch" in chosen:
        ckpt("reshard", str(work / "torch_dist"), str(work / "torch"), "--tp", str(TP), "--pp", str(PP), "--format",
             "torch", "--vocab-size", str(spec.vocab_size))
        remove(work / "torch_dist")
        yield "torch", work / "torch"
        remove(work / "torch")
    remove(work / "torch_dist")


def team(op: str, procs: int) -> str:
    return f"{op} ({procs} processes)"


def base_op(op: str) -> tuple[str, int]:
    """(the operation, the processes that run it) of a cell's operation name."""
    if not op.endswith(" processes)"):
        return op, 1
    name, _, procs = op.rpartition(" (")
    return name, int(procs.split()[0])


def command(op: str, name: str, src: Path, out: str, spec: ModelSpec) -> list[str] | None:
    """The ckpt command of one cell, or None where the operation does not apply to the input."""
    op, procs = base_op(op)
    if procs > 1:
        argv = command(op, name, src, out, spec)
        return None if argv is None else argv + ["--nproc-per-node", str(procs)]
    vocab = [] if name.startswith("ours") or name == "HF" else ["--vocab-size", str(spec.vocab_size)]
    reshard = CKPT + ["reshard", str(src), str(out), "--quiet", *vocab]
    if op == "merge -> HF":
        return None if name == "HF" else CKPT + ["merge", str(src), str(out), "--format", "hf", "--quiet", *vocab]
    if op.startswith("import"):
        if name != "HF":
            return None
        target = op.split()[2]
        tp, pp = (3, 2) if target == "ours" else (TP, PP)
        return CKPT + ["import", str(src), str(out), "--tp", str(tp), "--pp", str(pp), "--format", target, "--quiet"]
    if name == "HF":
        return None
    form = FORM[name]
    if op.startswith("export"):
        target = op.split()[-1]
        weights_only = ["--no-optimizer"] if target == "torch" and form == "ours" else []  # torch: no optimizer form
        return None if target == form else reshard + ["--tp", "1", "--pp", str(PP), "--format", target, *weights_only]
    if op == "reshard PP2 -> PP3 (uneven)":
        return reshard + ["--tp", str(TP), "--pp", "3", "--layers-per-stage", uneven(spec.num_layers), "--format", form]
    tp = op.split("TP")[-1]
    return reshard + ["--tp", tp, "--pp", str(PP), "--format", form]


def element_size(op: str, name: str) -> int:
    """What the command moves: fp32 when an optimizer is carried (ours), else the weights' dtype."""
    op = base_op(op)[0]
    carried = name.startswith("ours") and op not in ("merge -> HF", "export -> torch")
    if name == "ours fp32" or carried or op.startswith("import -> ours"):
        return 4
    return 2


# ---------------------------------------------------------------- measuring
OUT = "{out}"  # the output path in a cell's command


def at(argv: list[str], out: Path) -> list[str]:
    return [str(out) if a == OUT else a for a in argv]


def drop_caches() -> None:
    """Write back and drop the page cache (root only), so that the next run reads its input from the disk."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1\n")


def measure(cells: dict, work: Path, repeats: int, warm: bool, env: dict, drop: bool = False,
            done: Callable[[dict], None] | None = None) -> dict:
    """Per cell: the command's and cp -r of its output's wall times, the command's peak RSS and output bytes. A cell
    is measured in one go (its output kept for cp only while it is measured: the whole matrix's outputs would not fit
    on the disk), the command and cp alternating, so that a slow phase of the machine hits both alike."""
    out, copy, log = work / "out", work / "copy", work / "last.log"
    results = {}
    for i, (key, argv) in enumerate(cells.items()):
        ref = work / "ref"
        if drop:
            drop_caches()
        first = run(at(argv, ref), ref, log, env, keep=True)  # warm-up: fills the caches, keeps the output for cp
        r = results[key] = {"wall": [], "cp": [], "rss": [], "bytes": first[2]}
        for k in range(repeats):
            if not warm and k == 0:
                wall, rss, _ = first
            else:
                if drop:
                    drop_caches()
                wall, rss, _ = run(at(argv, out), out, log, env)
            r["wall"].append(wall)
            r["rss"].append(rss)
            if drop:
                drop_caches()
            r["cp"].append(run(["cp", "-r", str(ref), str(copy)], copy, log, env)[0])
        remove(ref)
        print(f"  {i + 1}/{len(cells)} {key[0]} of {key[1]}: {statistics.median(r['wall']):.2f} s, cp "
              f"{statistics.median(r['cp']):.2f} s", file=sys.stderr)
        if done is not None:
            done(results)
    return results


def startup(work: Path, env: dict, repeats: int) -> dict:
    """`ckpt --help` wall time, and whether the CLI and merge's path import torch."""
    walls = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        subprocess.run(CKPT + ["--help"], env=env, check=True, stdout=subprocess.DEVNULL)
        walls.append(time.perf_counter() - start)
    probe = ("import sys, ckpt_tools.cli, ckpt_tools.verbs.merge, ckpt_tools.forms.byte_ranges; "
             "print(json.dumps('torch' in sys.modules))")
    torch_loaded = subprocess.run([sys.executable, "-c", "import json; " + probe], env=env, check=True,
                                  capture_output=True, text=True).stdout.strip()
    return {"help_s": statistics.median(walls[1:]), "merge_imports_torch": json.loads(torch_loaded)}


# ---------------------------------------------------------------- report
def render(spec: ModelSpec, sizes: dict, ops: list[str], results: dict, markdown: bool) -> str:
    def cell(op, name):
        r = results.get((op, name))
        if r is None:
            return "-"
        ratio = statistics.median(r["wall"]) / statistics.median(r["cp"])
        rss = max(r["rss"])
        big = largest(spec, element_size(op, name))
        flag = "" if ratio <= 1.25 and rss <= 2 * big + 512 * MIB else " !"
        return f"{ratio:.2f}x, {rss / MIB:,.0f} MiB{flag}"

    header = ["operation"] + [f"{n} ({sizes[n] / 1e9:.2f} GB)" for n in INPUTS if n in sizes]
    rows = [[op] + [cell(op, n) for n in INPUTS if n in sizes] for op in ops]
    rows = [r for r in rows if any(c != "-" for c in r[1:])]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
                     for cells in [header, ["-" * w for w in widths]] + rows) + "\n"


def details(results: dict, spec: ModelSpec) -> str:
    lines = ["| operation | input | wall s (median) | cp -r of its output s | output MB | peak RSS MiB | "
             "largest tensor MiB |", "|---|---|---|---|---|---|---|"]
    for (op, name), r in results.items():
        lines.append(f"| {op} | {name} | {statistics.median(r['wall']):.3f} | {statistics.median(r['cp']):.3f} | "
                     f"{r['bytes'] / 1e6:,.2f} | {max(r['rss']) / MIB:,.0f} | "
                     f"{largest(spec, element_size(op, name)) / MIB:,.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=1.0, help="bf16 weights of the model (default 1)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="a tiny model, one round, no warm-up (CI smoke run)")
    ap.add_argument("--only", default="", help="comma-separated inputs to measure (default all)")
    ap.add_argument("--ops", default="", help="comma-separated parts of the operations' names to measure (default all)")
    ap.add_argument("--procs", type=int, default=1, help="also run each chosen cell by a team of N processes")
    ap.add_argument("--inputs-by", choices=("megatron-core", "ckpt"), default="megatron-core",
                    help="who writes the Megatron-LM inputs (ckpt: one input on disk at a time, for large sizes)")
    ap.add_argument("--cold", action="store_true", help="no untimed warm-up run: the first run counts")
    ap.add_argument("--drop-caches", action="store_true",
                    help="drop the page cache before every command and every cp (root): both read from the disk")
    ap.add_argument("--markdown", type=Path, help="the table, rewritten after each input's cells")
    ap.add_argument("--json", type=Path, help="the run's settings and every run's wall, cp and RSS figures per cell, "
                    "rewritten after each cell")
    args = ap.parse_args()
    spec = make_spec(args.size_gb, args.quick)
    repeats = 1 if args.quick else args.repeats
    chosen = [n.strip() for n in args.only.split(",") if n.strip()] or list(INPUTS)
    if set(chosen) - set(INPUTS):
        sys.exit(f"--only: {', '.join(sorted(set(chosen) - set(INPUTS)))} is no input; the inputs: {', '.join(INPUTS)}")
    if args.drop_caches and not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        sys.exit("--drop-caches needs root (it writes /proc/sys/vm/drop_caches); run as root or without it")
    parts = [o.strip() for o in args.ops.split(",") if o.strip()]
    ops = [op for op in OPERATIONS if not parts or any(x in op for x in parts)]
    ops = [v for op in ops for v in ([op, team(op, args.procs)] if args.procs > 1 else [op])]
    work = Path(tempfile.mkdtemp(prefix="ckpt-matrix-"))
    env = child_env(work)
    load_before = os.getloadavg()[0]
    run_info = {"size_gb": args.size_gb, "layers": spec.num_layers, "repeats": repeats, "inputs_by": args.inputs_by,
                "cold": args.cold or args.quick, "drop_caches": args.drop_caches, "cpus": os.cpu_count(),
                "load_before": load_before, "python": sys.version.split()[0], "torch": torch.__version__}
    sizes, results = {}, {}

    def done(measured: dict) -> None:  # every run's figures so far (this input's cells measured), after each cell
        if args.json:
            args.json.write_text(json.dumps({"run": run_info, "cells": [
                {"op": op, "input": n, **r} for (op, n), r in {**results, **measured}.items()]}))
    try:
        start = time.perf_counter()
        for name, src in make_inputs(work, spec, env, chosen, args.inputs_by):
            sizes[name] = tree_bytes(src)
            print(f"{name}: {sizes[name] / 1e9:.2f} GB, ready at {time.perf_counter() - start:.0f} s", file=sys.stderr)
            cells = {(op, name): argv for op in ops if (argv := command(op, name, src, OUT, spec)) is not None}
            results.update(measure(cells, work, repeats, not (args.quick or args.cold), env, args.drop_caches, done))
            if args.markdown:
                args.markdown.write_text(render(spec, sizes, ops, results, markdown=True) + "\n" + details(results, spec))
        boot = startup(work, env, repeats)
        note = (f"llama, {spec.num_layers} layers, hidden {spec.hidden_size}, {spec.num_attention_heads} heads in "
                f"{spec.num_query_groups} query groups, ffn {spec.ffn_hidden_size}, vocab {spec.vocab_size}; inputs "
                f"TP{TP} x PP{PP}{' (Megatron-LM forms written by ckpt)' if args.inputs_by == 'ckpt' else ''}. Cell: "
                f"median wall / median cp -r of the command's own output (alternating), and peak RSS ('!': over 1.25x "
                f"or over 2 x largest tensor + 512 MiB). {repeats} run(s) each, "
                f"{'cold: no warm-up run' if args.cold or args.quick else 'warm cache'}"
                f"{', the page cache dropped before each command and each cp' if args.drop_caches else ''}, sync after "
                f"each command; "
                f"{os.cpu_count()} CPUs, load {load_before:.1f} before, {os.getloadavg()[0]:.1f} after; "
                f"{time.perf_counter() - start:.0f} s in all. Start-up: ckpt --help {boot['help_s']:.2f} s; merge's "
                f"imports load torch: {'yes' if boot['merge_imports_torch'] else 'no'}.")
        print(render(spec, sizes, ops, results, markdown=False))
        print(note)
        if args.markdown:
            args.markdown.write_text(note + "\n\n" + render(spec, sizes, ops, results, markdown=True) + "\n"
                                     + details(results, spec))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
