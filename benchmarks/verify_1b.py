"""Wall time of import, merge and `ckpt verify` for a ~1B Llama (TinyLlama-1.1B shape) on GPUs.

    python benchmarks/verify_1b.py --tp 2 --workdir /tmp/v1b [--markdown table.md]

transformers builds the model (seeded random init, bf16) and saves it; `ckpt import` shards it at
TP x PP1 (model only); `ckpt merge` joins it back; `ckpt verify SHARDS HF` then runs every tier on
the GPUs in bf16 and fp32 against the ORIGINAL transformers files (tier 1 also checks the import
bit for bit). Prints one table of wall times and the verify figures.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

CKPT = [sys.executable, "-m", "ckpt_tools.cli"]


def timed(argv: list[str], log: Path) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True)
    wall = time.perf_counter() - start
    log.write_text(proc.stdout + proc.stderr)
    return wall, proc.stdout + (f"\n[exit {proc.returncode}] {proc.stderr.strip()[-300:]}" if proc.returncode else "")


def make_hf(path: Path, layers: int, seed: int) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers, num_attention_heads=32,
                         num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--markdown", type=Path, default=None)
    args = ap.parse_args()
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    hf, shards, merged = work / "hf", work / "shards", work / "merged"
    start = time.perf_counter()
    params = make_hf(hf, args.layers, seed=0)
    rows = [("transformers: build + save_pretrained (bf16)", time.perf_counter() - start, f"{params / 1e9:.3f}B parameters")]
    wall, out = timed([*CKPT, "import", str(hf), str(shards), "--tp", str(args.tp), "--pp", "1", "--no-optimizer",
                       "-q", "--force"], work / "import.log")
    rows.append((f"ckpt import -> TP{args.tp}", wall, out.strip().splitlines()[-1]))
    wall, out = timed([*CKPT, "merge", str(shards), str(merged), "-q", "--force"], work / "merge.log")
    rows.append(("ckpt merge -> HF", wall, out.strip().splitlines()[-1]))
    for dtype in ("bf16", "fp32"):
        wall, out = timed([*CKPT, "verify", str(shards), str(hf), "--device", "cuda", "--dtype", dtype,
                           "--batch", str(args.batch), "--seq-len", str(args.seq_len),
                           "--report", str(work / f"verify_{dtype}.h5")], work / f"verify_{dtype}.log")
        lines = out.strip().splitlines()
        detail = " | ".join(line.strip() for line in lines if line.strip().startswith(("rel L2", "top-1", "tier", "error", "[exit")))
        rows.append((f"ckpt verify vs the transformers files ({dtype}, {args.batch}x{args.seq_len} tokens)", wall, detail))
    import torch
    head = f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'} x {torch.cuda.device_count()}"
    table = [head, "", "| step | wall s | result |", "|---|---|---|"]
    table += [f"| {name} | {wall:.1f} | {detail} |" for name, wall, detail in rows]
    print("\n".join(table))
    if args.markdown:
        args.markdown.write_text("\n".join(table) + "\n")


if __name__ == "__main__":
    main()
