#!/usr/bin/env bash
# The demo on embedded defaults: train a tiny Llama-style model at TP2 x PP2 on CPU (4 processes,
# gloo), inspect the sharded checkpoint, then check by forward passes that the sharded model and
# its in-memory TP1 x PP1 merge give the same logits.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
source "$root/scripts/setup_env.sh"
cd "$root"
out="${1:-runs/demo}"
rm -rf "$out"
mkdir -p "$out"
export PYTHONWARNINGS=ignore OMP_NUM_THREADS=1

echo "== 1. train: tiny llama, TP2 x PP2 x DP1 on CPU"
ckpt train --config fixtures/configs/tiny_llama.yaml --set save_dir="$out/train" 2>&1 | grep -v -E '^W[0-9]|\*{5}|OMP_NUM_THREADS'

echo; echo "== 2. inspect the checkpoint"
ckpt inspect "$out/train"

echo; echo "== 3. forward: sharded TP2 x PP2 vs the same weights joined to TP1 x PP1"
python - "$out" <<'PY'
import sys, torch
torch.manual_seed(0)
torch.save(torch.randint(0, 1000, (4, 64)), f"{sys.argv[1]}/tokens.pt")
PY
torchrun --nproc-per-node 4 -m trainer.forward "$out/train" --tokens "$out/tokens.pt" --out "$out/logits_tp2pp2.pt" 2>&1 | grep -v -E '^W[0-9]|\*{5}|OMP_NUM_THREADS' || true
python -m trainer.forward "$out/train" --tp 1 --pp 1 --tokens "$out/tokens.pt" --out "$out/logits_tp1pp1.pt"
python - "$out" <<'PY'
import sys, torch
a = torch.load(f"{sys.argv[1]}/logits_tp2pp2.pt"); b = torch.load(f"{sys.argv[1]}/logits_tp1pp1.pt")
rel = ((a - b).norm() / b.norm()).item()
top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
print(f"logits {tuple(a.shape)}: relative L2 error {rel:.2e}, max abs diff {(a - b).abs().max().item():.2e}, top-1 agreement {top1:.2%}")
sys.exit(0 if rel < 1e-5 else 1)
PY
echo; echo "demo finished: outputs in $out"
