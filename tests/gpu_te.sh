#!/usr/bin/env bash
# Transformer Engine on the GPU machine, and the checkpoints megatron-core 0.19 saves with it (tests/mcore_te.py).
#   bash tests/gpu_te.sh install OUT   Transformer Engine 2.20.2 into /tmp/te_site: its core wheel (carried in pieces,
#                                      .te/part_*), its PyTorch extension built from the sdist there (nvcc, torch 2.11)
#   bash tests/gpu_te.sh save OUT      every case of mcore_te.CASES saved under OUT/te/<case>, then `ckpt` rewrites each
#                                      (torch_dist at TP 1 and 2, the legacy form, merge -> HF -> import into torch_dist)
#                                      and megatron-core loads every rewrite back into its Transformer Engine model
#                                      (OUT/loads.txt: each load's largest logit difference from the saved model's)
set -u
mode=${1:?install|save}; out=${2:?OUT}
mkdir -p "$out/logs"
site=/tmp/te_site
export PYTHONPATH=$site:$PWD:$PWD/tests PYTHONWARNINGS=ignore
if [ "$mode" = install ]; then
  whl=/tmp/transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl
  mkdir -p /tmp/tp && cp .te/part_* /tmp/tp/ 2>/dev/null; cat /tmp/tp/part_* > $whl && ls -la $whl | tee "$out/logs/install.log"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" $whl .te/w/*.whl \
    .whl/019/*.whl >> "$out/logs/install.log" 2>&1 || { echo "pip failed"; tail -20 "$out/logs/install.log"; exit 1; }
  rm -rf /tmp/te_src && mkdir /tmp/te_src && tar xzf .te/w/transformer_engine_torch-2.20.2.tar.gz -C /tmp/te_src
  start=$(date +%s)
  (cd /tmp/te_src/transformer_engine_torch-2.20.2 && NVTE_PYTORCH_FORCE_BUILD=TRUE MAX_JOBS=${JOBS:-16} \
    NVTE_CUDA_ARCHS=90 timeout ${LIMIT:-520} python3 -m pip wheel -v --no-build-isolation --no-deps --no-index \
    --no-cache-dir -w /tmp/te_whl . > "$out/logs/build.log" 2>&1 \
    && python3 -m zipfile -e /tmp/te_whl/transformer_engine_torch-*.whl "$site")  # into the core's package dir
  echo "build rc $? in $(( $(date +%s) - start )) s"; tail -5 "$out/logs/build.log"
  python3 -c "import transformer_engine.pytorch as te, transformer_engine; print('transformer_engine', transformer_engine.__version__)" 2>&1 | tail -3
  exit 0
fi
te=/tmp/te_out; rm -rf $te /tmp/te_work; mkdir -p $te
ckpt() { python3 -c "from ckpt_tools.cli import main; main()" "$@"; }
one=${CASES:-"gpt_llama_tp1 gpt_llama_fp8_tp1 gpt_gpt2_tp1 gpt_mixtral_grouped_tp1 hybrid_llama_tp1"}  # at TP 1
timeout 300 python3 -m torch.distributed.run --nproc-per-node 1 tests/mcore_te.py save $te $one > "$out/logs/save_tp1.log" 2>&1
echo "save tp1: rc $?"
[ -n "${CASES:-}" ] || { timeout 200 python3 -m torch.distributed.run --nproc-per-node 2 tests/mcore_te.py save $te \
  gpt_llama_tp2 > "$out/logs/save_tp2.log" 2>&1; echo "save tp2: rc $?"; }
loads1=""; loads2=""
for c in $one $([ -n "${CASES:-}" ] || echo gpt_llama_tp2); do
  [ -f "$te/$c/torch_dist/latest_checkpointed_iteration.txt" ] || { echo "$c: not saved"; continue; }
  w=/tmp/te_work/$c; mkdir -p $w
  model=""; case $c in hybrid*) model="--model hybrid" ;; esac
  {
    ckpt reshard "$te/$c/torch_dist" $w/dist1 --tp 1 --pp 1 --format torch_dist --vocab-size 127 --quiet
    ckpt reshard "$te/$c/torch_dist" $w/dist2 --tp 2 --pp 1 --format torch_dist --vocab-size 127 --quiet
    ckpt reshard "$te/$c/torch" $w/legacy_dist --tp 1 --pp 1 --format torch_dist --vocab-size 127 --quiet
    ckpt merge "$te/$c/torch_dist" $w/hf --vocab-size 127 --quiet
    ckpt import $w/hf $w/hf_dist --format torch_dist $model --quiet
  } > "$out/logs/ckpt_$c.log" 2>&1
  echo "ckpt $c: rc $?"
  # the saves themselves (controls; the legacy files at their own TP), then each rewrite
  loads1="$loads1 $c $te/$c/torch_dist $w/saved.pt"
  case $c in *_tp2) loads2="$loads2 $c $te/$c/torch $w/saved_torch.pt" ;; *) loads1="$loads1 $c $te/$c/torch $w/saved_torch.pt" ;; esac
  for o in dist1 legacy_dist hf_dist; do loads1="$loads1 $c $w/$o $w/$o.pt"; done
  loads2="$loads2 $c $w/dist2 $w/dist2.pt"
done
# the FP8 save's own extra state is Transformer Engine's pickle (made in this run): allowed for its control load
export NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1
timeout 300 python3 -m torch.distributed.run --nproc-per-node 1 tests/mcore_te.py load $loads1 > "$out/logs/load_tp1.log" 2>&1
echo "load tp1: rc $?"
timeout 200 python3 -m torch.distributed.run --nproc-per-node 2 tests/mcore_te.py load $loads2 > "$out/logs/load_tp2.log" 2>&1
echo "load tp2: rc $?"
grep -h "FAILED" "$out"/logs/load_*.log | cut -c1-400
python3 - $te /tmp/te_work <<'EOF' > "$out/loads.txt"
import sys, torch
from pathlib import Path
te, work = Path(sys.argv[1]), Path(sys.argv[2])
for case in sorted(p.name for p in te.iterdir()):
    ref = torch.load(te / case / "reference.pt", weights_only=True)["logits"][..., :127]  # the true vocab's columns
    for got in sorted((work / case).glob("*.pt")):
        diff = (ref - torch.load(got, weights_only=True)["logits"][..., :127]).abs().max().item()
        print(f"{case} {got.stem}: max |logits - saved model's| = {diff:.3g}")
EOF
cat "$out/loads.txt"
(cd "$te" && tar czf "$out/te_fixtures.tgz" --exclude='local_*' .) && ls -la "$out/te_fixtures.tgz"
(cd "$out" && tar czf logs.tgz logs)
