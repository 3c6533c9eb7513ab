#!/usr/bin/env bash
# The demo on embedded defaults: train a tiny Llama-style model at TP2 x PP2 on CPU (4 processes,
# gloo), inspect the sharded checkpoint, merge it into a HuggingFace model, reshard it (optimizer
# included) to TP1 x PP2, and verify both by weights and forward passes.
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

echo; echo "== 3. merge: shards -> one HuggingFace model (transformers loads it as is)"
ckpt merge "$out/train" "$out/hf" -q

echo; echo "== 4. reshard: TP2 x PP2 -> TP1 x PP2, model + optimizer state"
ckpt reshard "$out/train" "$out/tp1pp2" --tp 1 --pp 2 -q

echo; echo "== 5. verify: the sharded checkpoint vs its HF merge (weights, hidden states, logits)"
ckpt verify "$out/train" "$out/hf" --report "$out/verify_hf.h5"

echo; echo "== 6. verify: the resharded checkpoint vs the original"
ckpt verify "$out/tp1pp2" "$out/train"

echo; echo "demo finished: outputs in $out (HF model in $out/hf, report in $out/verify_hf.h5)"
