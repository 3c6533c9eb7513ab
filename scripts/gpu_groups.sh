#!/usr/bin/env bash
# The gpu-marked tests in groups, each one command on a 2-GPU machine (the device's 10-minute limit per command):
#
#   bash scripts/gpu_groups.sh                # every group, one after another, a log and a time per group
#   bash scripts/gpu_groups.sh train graphs   # the groups named
#   bash scripts/gpu_groups.sh --collect      # each group's test ids, no run (any machine: "<group> <id>" lines)
#
# Groups (docs/gpu.md lists their times as measured):
#   forward  megatron-core's GPTModel and the trainer's forward against each other and the HF merge (tests/test_gpu.py)
#   verify   `ckpt verify` on GPUs against the HF merge (tests/test_gpu.py)
#   train    the trainer's parallel features and kernels: SP, DP buckets, the Triton AdamW, MoE and EP (tests/test_gpu.py)
#   graphs   CUDA graphs and the GEMM-fused gradient accumulation on one GPU (tests/test_gpu_graphs.py)
#   graphs2  CUDA graphs under DP2, TP2 (with and without SP) and PP2; the trainer on megatron-core 0.19
#            (tests/test_gpu_graphs.py, tests/test_trainer_newest.py; 0.19 where MCORE_NEWEST names its install)
#   resume   megatron-core and Megatron-FSDP resume from what `ckpt` writes (tests/test_gpu.py, test_megatron_fsdp_dtensor.py)
#   te       Transformer Engine models load what `ckpt` writes (tests/test_megatron_lm_saves.py; skipped without TE_SITE)
# Set-up first (docs/gpu.md): megatron-core on PYTHONPATH, e.g. pip install --target /tmp/site .whl/*.whl.
# Logs go to ${OUT:-runs/gpu}/<group>.log; a group's exit status is its pytest's.
set -uo pipefail
out="${OUT:-runs/gpu}"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
declare -A SETS=(
  [forward]="tests/test_gpu.py -k forward_equals_trainer_or_agrees_with_trainer"
  [verify]="tests/test_gpu.py -k verify_on_gpus"
  [train]="tests/test_gpu.py -k sequence_parallel_or_gradient_buckets_or_triton_or_moe_or_grouped_expert"
  [graphs]="tests/test_gpu_graphs.py -k gemm_or_the_eager_run_to_the_last_bit_or_bf16_or_compiled"
  [graphs2]="tests/test_gpu_graphs.py tests/test_trainer_newest.py -k two_gpus_or_megatron_core_019"
  [resume]="tests/test_gpu.py tests/test_megatron_fsdp_dtensor.py -k resumes_or_loads_what_ckpt_writes"
  [te]="tests/test_megatron_lm_saves.py -k transformer_engine"
)
ORDER=(forward verify train graphs graphs2 resume te)
collect=0; [ "${1:-}" = "--collect" ] && { collect=1; shift; out=$(mktemp -d); }
mkdir -p "$out"
names=("$@"); [ ${#names[@]} -gt 0 ] || names=("${ORDER[@]}")
status=0
for g in "${names[@]}"; do
  [ -n "${SETS[$g]:-}" ] || { echo "unknown group $g: one of ${ORDER[*]}" >&2; exit 2; }
  read -r -a args <<< "${SETS[$g]}"
  for i in "${!args[@]}"; do [ "${args[$i]}" = "-k" ] && args[$((i + 1))]="${args[$((i + 1))]//_or_/ or }"; done
  if [ $collect -eq 1 ]; then  # all groups at once, printed in order
    python3 -m pytest -q --collect-only -m gpu -p no:cacheprovider "${args[@]}" 2>/dev/null | grep "::" \
      | sed "s/^/$g /" > "$out/collect.$g" &
    continue
  fi
  start=$(date +%s)
  python3 -m pytest -q -m gpu "${args[@]}" -s --durations=10 > "$out/$g.log" 2>&1; rc=$?
  echo "$g: $(tail -n 1 "$out/$g.log") ($(( $(date +%s) - start )) s)" | tee -a "$out/groups.txt"
  [ $rc -eq 0 ] || [ $rc -eq 5 ] || status=1
done
if [ $collect -eq 1 ]; then
  wait
  for g in "${names[@]}"; do cat "$out/collect.$g"; done
  rm -rf "$out"
fi
exit $status
