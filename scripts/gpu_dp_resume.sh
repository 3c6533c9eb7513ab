#!/usr/bin/env bash
# On a GPU machine with 4 GPUs (python 3.12, megatron-core's wheel staged by ../shared/gpu-wheels.sh into .whl/):
# megatron-core's distributed optimizer trained at DP2 (2 GPUs) and TP2 x DP2 (4 GPUs), saved dp_reshardable and
# fully_reshardable, resharded by ckpt to another TP x PP and resumed by megatron-core (tests/mcore_resume.py).
# Writes ${OUT}/r<TP>.log, ${OUT}/f<TP>.tgz (src, ref_src, resume.json): unpacked, fixtures/megatron_optimizer_dp/.
set -u
out="${OUT:-runs/gpu_dp}"; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONWARNINGS=ignore
for tp in 1 2; do
  rm -rf "/tmp/r$tp"
  MCORE_RESUME_TP=$tp timeout 200 python3 -m torch.distributed.run --nproc-per-node $((2 * tp)) tests/mcore_resume.py \
    "/tmp/r$tp" > "$out/r$tp.log" 2>&1
  echo "TP$tp x DP2: rc=$?"
  tar czf "$out/f$tp.tgz" -C "/tmp/r$tp" src ref_src resume.json
done
