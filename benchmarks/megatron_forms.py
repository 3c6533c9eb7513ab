"""Benchmark `ckpt merge` on real Megatron-LM checkpoints, in both of Megatron-LM's forms, against `cp -r`.

1. megatron-core itself builds a Llama-style GPTModel (bf16 weights, TP2 x PP2, gloo on CPU) and saves it as
   Megatron-LM's `save_checkpoint` does, in the default `torch_dist` form and the legacy `torch` form
   (tests/mcore_checkpoints.py, under torchrun);
2. times, as subprocesses, `cp -r` of each form's iteration dir (the bytes merge reads), `ckpt merge SRC OUT
   --format hf` of it (bf16, vocab trimmed) and `ckpt reshard` of the torch_dist save into each form at TP1 x PP2
   (writing Megatron-LM checkpoints; weights only), and `ckpt import` of the HF model the torch_dist save merges
   to into each form at TP2 x PP2 against `cp -r` of that HF dir; warm page cache, interleaved rounds, median wall time, each
   command followed by `sync`; peak RSS of the command itself (GNU time);
3. prints one table of ratios measured in one run (and writes it as markdown with --markdown PATH).

Usage: python benchmarks/megatron_forms.py [--size-gb 1.0] [--repeats 3] [--quick] [--markdown FILE]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from merge_reshard import CKPT, MIB, child_env, remove, render, run, tree_bytes

from ckpt_tools.model import layout
from ckpt_tools.model.spec import ModelSpec

ROOT = Path(__file__).resolve().parent.parent
TP, PP, ITERATION = 2, 2, 1000
FORMS = ("torch_dist", "torch")


def make_spec(size_gb: float, quick: bool) -> ModelSpec:
    """Llama-style (RMSNorm, SwiGLU, RoPE, GQA, untied) with as many layers as make `size_gb` of bf16."""
    if quick:
        return ModelSpec("llama", num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=4,
                         ffn_hidden_size=176, vocab_size=1000)
    one = ModelSpec("llama", num_layers=1, hidden_size=1024, num_attention_heads=16, num_query_groups=4,
                    ffn_hidden_size=2816, vocab_size=32000, max_position_embeddings=4096)
    return ModelSpec(**{**one.to_dict(), "num_layers": layers_for(one, size_gb, PP)})


def layers_for(one: ModelSpec, size_gb: float, multiple: int) -> int:
    """How many layers (a multiple of MULTIPLE, at least one such) give the model of ONE's widths SIZE_GB of bf16."""
    padded = one.padded_vocab_size(TP)
    per_layer = sum(math.prod(layout.full_shape(k, one, padded)) for _, k in layout.stage_keys(one, [1], 0)
                    if layout.layer_index(k) is not None and layout.full_shape(k, one, padded))
    rest = 2 * padded * one.hidden_size + one.hidden_size
    return max(multiple, round((size_gb * 1e9 / 2 - rest) / per_layer / multiple) * multiple)


def generate(work: Path, spec: ModelSpec) -> Path:
    """Both forms, written by megatron-core (a torchrun of tests/mcore_checkpoints.py)."""
    import subprocess
    out = work / "mcore"
    out.mkdir()
    config = work / "config.json"
    config.write_text(json.dumps({"model": spec.to_dict(), "tp": TP, "pp": PP, "iteration": ITERATION,
                                  "dtype": "bfloat16", "forward": False}))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={TP * PP}",
           str(ROOT / "tests" / "mcore_checkpoints.py"), str(config), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:
        sys.exit(f"generating the checkpoints failed:\n{proc.stderr[-3000:]}")
    return out


def largest(spec: ModelSpec) -> int:
    padded = spec.padded_vocab_size(TP)
    return max(math.prod(layout.full_shape(k, spec, padded, PP) or (0,))
               for p in range(PP) for _, k in layout.stage_keys(spec, layout.layers_per_stage(spec.num_layers, PP), p)) * 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a tiny model, one round (CI smoke run)")
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    spec = make_spec(args.size_gb, args.quick)
    repeats = 1 if args.quick else args.repeats
    with tempfile.TemporaryDirectory(prefix="bench-forms-", dir=ROOT / ".bench" if (ROOT / ".bench").is_dir()
                                     else None) as work:
        work = Path(work)
        start = time.perf_counter()
        mcore = generate(work, spec)
        print(f"generated {spec.num_layers} layers with megatron-core in {time.perf_counter() - start:.0f}s",
              file=sys.stderr)
        out, log, env = work / "out", work / "last.log", child_env(work)
        ops = {}
        for form in FORMS:
            iter_dir = mcore / form / f"iter_{ITERATION:07d}"
            ops[f"cp -r {form} iter dir"] = ["cp", "-r", str(iter_dir), str(out)]
            ops[f"ckpt merge {form}"] = CKPT + ["merge", str(mcore / form), str(out), "--format", "hf", "--quiet",
                                                "--vocab-size", str(spec.vocab_size)]
        for form in FORMS:  # writing Megatron-LM's forms: torch_dist TP2 x PP2 -> TP1 x PP2, weights only
            ops[f"ckpt reshard -> {form} TP1xPP2"] = CKPT + [
                "reshard", str(mcore / "torch_dist"), str(out), "--tp", "1", "--pp", str(PP), "--format", form,
                "--no-optimizer", "--quiet", "--vocab-size", str(spec.vocab_size)]
        hf_dir = work / "hf"  # the HF model the torch_dist save merges to: the input of the import rows
        subprocess.run(CKPT + ["merge", str(mcore / "torch_dist"), str(hf_dir), "--format", "hf", "--quiet",
                               "--vocab-size", str(spec.vocab_size)], env=env, check=True, stdout=subprocess.DEVNULL)
        ops["cp -r HF dir"] = ["cp", "-r", str(hf_dir), str(out)]
        for form in FORMS:  # HF -> Megatron-LM's forms at TP2 x PP2, weights only (release)
            ops[f"ckpt import HF -> {form} TP{TP}xPP{PP}"] = CKPT + [
                "import", str(hf_dir), str(out), "--tp", str(TP), "--pp", str(PP), "--format", form, "--quiet"]
        for argv in ops.values():  # warm the page cache and the bytecode cache
            run(argv, out, log, env)
        results: dict[str, list] = {name: [] for name in ops}
        for r in range(repeats):
            for name, argv in ops.items():
                results[name].append(run(argv, out, log, env))
            print(f"  round {r + 1}/{repeats}: " + ", ".join(f"{n} {v[-1][0]:.2f}s" for n, v in results.items()),
                  file=sys.stderr)
        rows = []
        for form in FORMS:
            read = tree_bytes(mcore / form / f"iter_{ITERATION:07d}")
            cp, merge = f"cp -r {form} iter dir", f"ckpt merge {form}"
            base = statistics.median(w for w, _, _ in results[cp])
            names = (cp, merge) if form == "torch" else (cp, merge) + tuple(f"ckpt reshard -> {f} TP1xPP2" for f in FORMS)
            for name in names:
                walls = [w for w, _, _ in results[name]]
                rows.append({"layers": spec.num_layers, "op": name, "read": read, "written": results[name][0][2],
                             "wall": statistics.median(walls), "ratio": statistics.median(walls) / base,
                             "rss": max(m for _, m, _ in results[name]),
                             "largest": largest(spec) if name == merge else None, "walls": walls})
        base = statistics.median(w for w, _, _ in results["cp -r HF dir"])
        for name in ["cp -r HF dir", *(f"ckpt import HF -> {f} TP{TP}xPP{PP}" for f in FORMS)]:
            walls = [w for w, _, _ in results[name]]
            rows.append({"layers": spec.num_layers, "op": name, "read": tree_bytes(hf_dir),
                         "written": results[name][0][2], "wall": statistics.median(walls),
                         "ratio": statistics.median(walls) / base, "rss": max(m for _, m, _ in results[name]),
                         "largest": None, "walls": walls})
        remove(mcore)
    table = render(rows, markdown=False)
    print(table)
    print(f"model: {spec.num_layers} layers, hidden {spec.hidden_size}, bf16, TP{TP} x PP{PP}, written by megatron-core; "
          f"largest tensor {largest(spec) / MIB:,.0f} MiB")
    if args.markdown:
        args.markdown.write_text(render(rows, markdown=True))


if __name__ == "__main__":
    main()
