"""The digest of every output of a fixed list of `ckpt` commands: what a refactor must leave byte-identical.

    python scripts/output_digests.py WORKDIR [--only NAME ...] > digests.txt

Runs each command of COMMANDS (import, reshard and merge into every form: our format, torch_dist, the legacy torch
form, fsdp_dtensor, safetensors; interleaved pipelines, expert parallelism, a HybridModel, a team of 2 processes)
from the committed fixtures and a short training run, in WORKDIR (the same path both times: meta.json records its
source's path), and prints one line per output: its name, the sha256 over every file's relative path and bytes, and
the file count. Two trees give the same lines exactly when every output file is byte-identical (diff them).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
F = Path(os.environ.get("DIGEST_FIXTURES", ROOT / "fixtures"))  # the same path for both trees
V = "127"  # the fixtures' true vocab
SAVE = F / "megatron_save"
N19 = F / "megatron_019"

# (name, ckpt arguments); {w} is WORKDIR; an output is the last argument that names a dir under {w}
COMMANDS = [
    ("train", ["train", "--config", "fixtures/configs/tiny_llama.yaml", "--set", "save_dir={w}/train",
               "--set", "train_iters=4", "--set", "log_interval=100"]),
    ("merge-ours", ["merge", "{w}/train", "{w}/merge-ours"]),
    ("reshard-ours", ["reshard", "{w}/train", "{w}/reshard-ours", "--tp", "1", "--pp", "4"]),
    ("reshard-ours-dist", ["reshard", "{w}/train", "{w}/reshard-ours-dist", "--tp", "1", "--pp", "1",
                           "--format", "torch_dist"]),
    ("reshard-ours-torch", ["reshard", "{w}/train", "{w}/reshard-ours-torch", "--tp", "1", "--pp", "2",
                            "--format", "torch", "--no-optimizer"]),
    ("reshard-ours-torch-vpp", ["reshard", "{w}/train", "{w}/reshard-ours-torch-vpp", "--tp", "2", "--pp", "2",
                                "--vpp", "2", "--format", "torch", "--no-optimizer"]),
    ("reshard-ours-fsdp", ["reshard", "{w}/train", "{w}/reshard-ours-fsdp", "--tp", "1", "--pp", "1",
                           "--format", "fsdp_dtensor", "--no-optimizer"]),
    ("reshard-ours-team", ["reshard", "{w}/train", "{w}/reshard-ours-team", "--tp", "1", "--pp", "2",
                           "--nproc-per-node", "2"]),
    ("merge-legacy", ["merge", str(SAVE / "torch"), "{w}/merge-legacy", "--vocab-size", V]),
    ("import-ours", ["import", "{w}/merge-legacy", "{w}/import-ours", "--tp", "2", "--pp", "2"]),
    ("import-ours-torchpath", ["import", "{w}/merge-legacy", "{w}/import-ours-torchpath", "--tp", "2", "--pp", "2",
                               "--dtype", "bf16"]),
    ("import-dist", ["import", "{w}/merge-legacy", "{w}/import-dist", "--tp", "2", "--pp", "1",
                     "--format", "torch_dist"]),
    ("import-dist-hybrid", ["import", "{w}/merge-legacy", "{w}/import-dist-hybrid", "--tp", "1", "--pp", "2",
                            "--format", "torch_dist", "--model", "hybrid"]),
    ("import-torch", ["import", "{w}/merge-legacy", "{w}/import-torch", "--tp", "2", "--pp", "2", "--format", "torch"]),
    ("merge-vpp", ["merge", str(F / "megatron_vpp" / "torch"), "{w}/merge-vpp", "--vocab-size", V]),
    ("import-torch-vpp", ["import", "{w}/merge-vpp", "{w}/import-torch-vpp", "--tp", "1", "--pp", "2", "--vpp", "2",
                          "--format", "torch"]),
    ("import-dist-vpp-torchpath", ["import", "{w}/merge-vpp", "{w}/import-dist-vpp-torchpath", "--tp", "1",
                                   "--pp", "2", "--vpp", "2", "--format", "torch_dist", "--dtype", "bf16"]),
    ("import-fsdp", ["import", "{w}/merge-legacy", "{w}/import-fsdp", "--format", "fsdp_dtensor"]),
    ("import-dist-team", ["import", "{w}/merge-legacy", "{w}/import-dist-team", "--tp", "2", "--pp", "2",
                          "--format", "torch_dist", "--nproc-per-node", "2"]),
    ("reshard-dist-torch", ["reshard", str(SAVE / "torch_dist"), "{w}/reshard-dist-torch", "--tp", "1", "--pp", "2",
                            "--format", "torch", "--vocab-size", V]),
    ("reshard-legacy-dist", ["reshard", str(SAVE / "torch"), "{w}/reshard-legacy-dist", "--tp", "2", "--pp", "1",
                             "--format", "torch_dist", "--vocab-size", V]),
    ("reshard-legacy-ours", ["reshard", str(SAVE / "torch"), "{w}/reshard-legacy-ours", "--tp", "1", "--pp", "1",
                             "--vocab-size", V]),
    ("reshard-vpp-torch", ["reshard", str(F / "megatron_vpp" / "torch_dist"), "{w}/reshard-vpp-torch", "--tp", "1",
                           "--pp", "2", "--vpp", "2", "--format", "torch", "--vocab-size", V]),
    ("reshard-optim-dist", ["reshard", str(F / "megatron_optimizer_dp" / "pp2_dp2" / "src"), "{w}/reshard-optim-dist",
                            "--tp", "2", "--pp", "1", "--format", "torch_dist", "--vocab-size", V]),
    ("reshard-optim-ours", ["reshard", str(F / "megatron_optimizer_dp" / "tp2_dp2" / "src"), "{w}/reshard-optim-ours",
                            "--tp", "1", "--pp", "2", "--vocab-size", V]),
    ("reshard-fsdp-ours", ["reshard", str(F / "megatron_fsdp_dtensor" / "llama_dp1" / "fsdp_dtensor"), "{w}/reshard-fsdp-ours",
                           "--tp", "2", "--pp", "1", "--vocab-size", V]),
    ("merge-mixtral", ["merge", str(N19 / "hybrid_mixtral_tp2" / "torch_dist"), "{w}/merge-mixtral",
                       "--vocab-size", V]),
    ("import-mixtral-torch-ep", ["import", "{w}/merge-mixtral", "{w}/import-mixtral-torch-ep", "--tp", "1",
                                 "--pp", "1", "--ep", "2", "--format", "torch"]),
    ("import-mixtral-ours-ep", ["import", "{w}/merge-mixtral", "{w}/import-mixtral-ours-ep", "--tp", "1",
                                "--pp", "2", "--ep", "2"]),
    ("reshard-mixtral-ours", ["reshard", "{w}/import-mixtral-ours-ep", "{w}/reshard-mixtral-ours", "--tp", "2",
                              "--pp", "1", "--ep", "1"]),
    ("reshard-mixtral-dist", ["reshard", str(N19 / "hybrid_mixtral_tp2" / "torch_dist"), "{w}/reshard-mixtral-dist",
                              "--vocab-size", V, "--tp", "1",
                              "--pp", "2", "--format", "torch_dist"]),
    ("reshard-nemotron-dist", ["reshard", str(N19 / "hybrid_nemotron_h_tp2" / "torch_dist"),
                               "{w}/reshard-nemotron-dist", "--vocab-size", V,
                               "--tp", "1", "--pp", "2", "--format", "torch_dist"]),
    ("merge-deepseek", ["merge", str(N19 / "gpt_deepseek_v3_tp2" / "torch_dist"), "{w}/merge-deepseek",
                        "--vocab-size", V]),
    ("import-deepseek-dist", ["import", "{w}/merge-deepseek", "{w}/import-deepseek-dist", "--tp", "2",
                              "--format", "torch_dist"]),
    ("merge-safetensors", ["merge", str(SAVE / "torch_dist"), "{w}/merge-safetensors.safetensors", "--format", "safetensors",
                           "--vocab-size", V]),
]


def digest(path: Path) -> tuple[str, int]:
    h, n = hashlib.sha256(), 0
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        h.update(str(f.relative_to(path.parent if path.is_file() else path)).encode() + b"\0")
        with open(f, "rb") as fh:
            while block := fh.read(1 << 20):
                h.update(block)
        n += 1
    return h.hexdigest()[:16], n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir")
    parser.add_argument("--only", nargs="*", default=None)
    a = parser.parse_args()
    work = Path(a.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for name, args in COMMANDS:
        if a.only and name not in a.only and name != "train":
            continue
        args = [x.replace("{w}", str(work)) for x in args]
        out = work / "train" if name == "train" else \
            Path(next(x for x in reversed(args) if x.startswith(str(work))))
        if not (name == "train" and out.exists()):
            shutil.rmtree(out, ignore_errors=True)
            if out.is_file():
                out.unlink()
            done = subprocess.run([sys.executable, "-m", "ckpt_tools.cli", *args, "-q"] if name != "train" else
                                  [sys.executable, "-m", "ckpt_tools.cli", *args], cwd=ROOT, env=env,
                                  capture_output=True, text=True)
            if done.returncode != 0:
                print(f"{name:<28} FAILED: {(done.stderr or done.stdout).strip().splitlines()[-1:]}", flush=True)
                continue
        if name == "train":
            continue  # its training run is not deterministic in bytes across machines; its outputs are
        d, n = digest(out)
        print(f"{name:<28} {d} {n:3d} files", flush=True)


if __name__ == "__main__":
    main()
