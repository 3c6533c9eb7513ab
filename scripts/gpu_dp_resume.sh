#!/usr/bin/env bash
# On a GPU machine with 4 GPUs (python 3.12, megatron-core's wheel staged by ../shared/gpu-wheels.sh into .whl/):
# megatron-core's distributed optimizer trained at DP2 (2 GPUs), TP2 x DP2 and PP2 x DP2 (4 GPUs), saved dp_reshardable,
# fully_reshardable and in the legacy form (distrib_optim.pt), resharded by ckpt to another TP x PP and resumed by
# megatron-core (tests/mcore_resume.py). Writes ${OUT}/<run>.log and ${OUT}/<run>.tgz (src, ref_src, src_legacy,
# resume.json): unpacked, fixtures/megatron_optimizer_dp/<run>/. RUNS="pp2_vpp2_dp2 1 2 2": an interleaved pipeline,
# PP2 x VPP2 x DP2 on 4 GPUs (its legacy form: model<v> chunks, a grad buffer per chunk in distrib_optim.pt).
# WHEELS: the megatron-core wheel (default .whl/*.whl).
set -u
out="${OUT:-runs/gpu_dp}"; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site ${WHEELS:-.whl/*.whl}
export PYTHONPATH=/tmp/site:$PWD PYTHONWARNINGS=ignore
echo "${RUNS:-dp2 1 1 1;tp2_dp2 2 1 1;pp2_dp2 1 2 1}" | tr ';' '\n' | while read -r run; do  # name TP PP VPP (DP 2)
  set -- $run
  rm -rf "/tmp/$1"
  MCORE_RESUME_TP=$2 MCORE_RESUME_PP=$3 MCORE_RESUME_VPP=$4 timeout 200 python3 -m torch.distributed.run \
    --nproc-per-node $((2 * $2 * $3)) tests/mcore_resume.py "/tmp/$1" > "$out/$1.log" 2>&1
  echo "$1: rc=$?"
  tar czf "$out/$1.tgz" -C "/tmp/$1" $(cd "/tmp/$1" && ls -d src ref_src src_legacy resume.json 2>/dev/null)
done
