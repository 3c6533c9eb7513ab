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

    python benchmarks/matrix.py [--size-gb 1] [--repeats 3] [--markdown FILE]
    python benchmarks/matrix.py --quick          # tiny model, one round: a CI smoke run
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
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import megatron_forms  # noqa: E402
import merge_reshard  # noqa: E402
from merge_reshard import CKPT, MIB, child_env, remove, run, tree_bytes  # noqa: E402

from ckpt_tools.spec import ModelSpec  # noqa: E402

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
def make_inputs(work: Path, spec: ModelSpec, env: dict) -> dict[str, Path]:
    sources = {}
    for name, dtype in (("ours bf16", torch.bfloat16), ("ours fp32", torch.float32)):
        sources[name] = work / name.replace(" ", "-")
        merge_reshard.generate(sources[name], spec, dtype)
    mcore = megatron_forms.generate(work, spec)
    sources["torch_dist"], sources["torch"] = mcore / "torch_dist", mcore / "torch"
    sources["HF"] = work / "hf"
    subprocess.run(CKPT + ["merge", str(sources["ours bf16"]), str(sources["HF"]), "--format", "hf", "--quiet"],
                   env=env, check=True, stdout=subprocess.DEVNULL)
    return sources


def command(op: str, name: str, src: Path, out: str, spec: ModelSpec) -> list[str] | None:
    """The ckpt command of one cell, or None where the operation does not apply to the input."""
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
    carried = name.startswith("ours") and op not in ("merge -> HF", "export -> torch")
    if name == "ours fp32" or carried or op.startswith("import -> ours"):
        return 4
    return 2


# ---------------------------------------------------------------- measuring
OUT = "{out}"  # the output path in a cell's command


def at(argv: list[str], out: Path) -> list[str]:
    return [str(out) if a == OUT else a for a in argv]


def measure(cells: dict, work: Path, repeats: int, warm: bool, env: dict) -> dict:
    """Per cell: the command's and cp -r of its output's wall times, the command's peak RSS and output bytes. A cell
    is measured in one go (its output kept for cp only while it is measured: the whole matrix's outputs would not fit
    on the disk), the command and cp alternating, so that a slow phase of the machine hits both alike."""
    out, copy, log = work / "out", work / "copy", work / "last.log"
    results = {}
    for i, (key, argv) in enumerate(cells.items()):
        ref = work / "ref"
        first = run(at(argv, ref), ref, log, env, keep=True)  # warm-up: fills the caches, keeps the output for cp
        r = results[key] = {"wall": [], "cp": [], "rss": [], "bytes": first[2]}
        for k in range(repeats):
            wall, rss, _ = first if not warm and k == 0 else run(at(argv, out), out, log, env)
            r["wall"].append(wall)
            r["rss"].append(rss)
            r["cp"].append(run(["cp", "-r", str(ref), str(copy)], copy, log, env)[0])
        remove(ref)
        print(f"  {i + 1}/{len(cells)} {key[0]} of {key[1]}: {statistics.median(r['wall']):.2f} s, cp "
              f"{statistics.median(r['cp']):.2f} s", file=sys.stderr)
    return results


def startup(work: Path, env: dict, repeats: int) -> dict:
    """`ckpt --help` wall time, and whether the CLI and merge's path import torch."""
    walls = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        subprocess.run(CKPT + ["--help"], env=env, check=True, stdout=subprocess.DEVNULL)
        walls.append(time.perf_counter() - start)
    probe = ("import sys, ckpt_tools.cli, ckpt_tools.merge, ckpt_tools.byte_ranges; "
             "print(json.dumps('torch' in sys.modules))")
    torch_loaded = subprocess.run([sys.executable, "-c", "import json; " + probe], env=env, check=True,
                                  capture_output=True, text=True).stdout.strip()
    return {"help_s": statistics.median(walls[1:]), "merge_imports_torch": json.loads(torch_loaded)}


# ---------------------------------------------------------------- report
def render(spec: ModelSpec, sources: dict, results: dict, markdown: bool) -> str:
    def cell(op, name):
        r = results.get((op, name))
        if r is None:
            return "-"
        ratio = statistics.median(r["wall"]) / statistics.median(r["cp"])
        rss = max(r["rss"])
        big = largest(spec, element_size(op, name))
        flag = "" if ratio <= 1.25 and rss <= 2 * big + 512 * MIB else " !"
        return f"{ratio:.2f}x, {rss / MIB:,.0f} MiB{flag}"

    sizes = {n: tree_bytes(sources[n]) for n in INPUTS}
    header = ["operation"] + [f"{n} ({sizes[n] / 1e9:.2f} GB)" for n in INPUTS]
    rows = [[op] + [cell(op, n) for n in INPUTS] for op in OPERATIONS]
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
    ap.add_argument("--markdown", type=Path)
    args = ap.parse_args()
    spec = make_spec(args.size_gb, args.quick)
    repeats = 1 if args.quick else args.repeats
    work = Path(tempfile.mkdtemp(prefix="ckpt-matrix-"))
    env = child_env(work)
    load_before = os.getloadavg()[0]
    try:
        start = time.perf_counter()
        sources = make_inputs(work, spec, env)
        print(f"inputs generated in {time.perf_counter() - start:.0f}s: " + ", ".join(
            f"{n} {tree_bytes(p) / 1e9:.2f} GB" for n, p in sources.items()), file=sys.stderr)
        chosen = [n.strip() for n in args.only.split(",") if n.strip()] or list(INPUTS)
        cells = {(op, n): argv for op in OPERATIONS for n in chosen
                 if (argv := command(op, n, sources[n], OUT, spec)) is not None}
        results = measure(cells, work, repeats, not args.quick, env)
        boot = startup(work, env, repeats)
        table = render(spec, sources, results, markdown=False)
        note = (f"llama, {spec.num_layers} layers, hidden {spec.hidden_size}, {spec.num_attention_heads} heads in "
                f"{spec.num_query_groups} query groups, ffn {spec.ffn_hidden_size}, vocab {spec.vocab_size}; inputs "
                f"TP{TP} x PP{PP}. Cell: median wall / median cp -r of the command's own output (alternating), and peak RSS "
                f"('!': over 1.25x or over 2 x largest tensor + 512 MiB). {repeats} run(s) each, warm cache, sync after "
                f"each command; {os.cpu_count()} CPUs, load {load_before:.1f} before, {os.getloadavg()[0]:.1f} after. "
                f"Start-up: ckpt --help {boot['help_s']:.2f} s; merge's imports load torch: "
                f"{'yes' if boot['merge_imports_torch'] else 'no'}.")
        print(table)
        print(note)
        if args.markdown:
            args.markdown.write_text(note + "\n\n" + render(spec, sources, results, markdown=True) + "\n"
                                     + details(results, spec))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
