#!/usr/bin/env bash
# The Megatron-FSDP (`--ckpt-format fsdp_dtensor`) fixtures, saved on a GPU machine by megatron-core's own modules
# (tests/mcore_fsdp_dtensor.py): each case NAME VERSION NPROC OPTIMIZER MODEL-JSON under OUT/NAME, its log under
# OUT/logs. VERSION is the megatron-core wheel's dir under .whl/ (016 or 019: ../shared/gpu-wheels.sh's wheels).
# Case `load` loads every save dir under .whl/fsdp_in/ (what `ckpt` wrote, carried along) into Megatron-FSDP at DP 2
# as Megatron-LM's load_checkpoint does: OUT/loaded.pt.
#   CASES="llama_dp1 load" bash tests/gpu_fsdp_dtensor.sh OUT
set -u
out=${1:?OUT}
mkdir -p "$out/logs"
llama='{"architecture": "llama", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2, "ffn_hidden_size": 96, "vocab_size": 120, "max_position_embeddings": 64, "norm_epsilon": 1e-6}'
gpt2='{"architecture": "gpt2", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 256, "vocab_size": 120, "max_position_embeddings": 64, "norm_epsilon": 1e-5}'
run() {  # NAME VERSION NPROC OPTIMIZER MODEL
  local site=/tmp/site_$2
  [ -d "$site" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/$2/*.whl
  echo "{\"model\": $5, \"iteration\": 3, \"optimizer\": $4, \"watchdog\": ${WATCHDOG:-150}}" > "$out/logs/$1.json"
  PYTHONPATH=$site:$PWD:$PWD/tests timeout ${LIMIT:-240} python3 -m torch.distributed.run --nproc-per-node "$3" \
    tests/mcore_fsdp_dtensor.py "$out/logs/$1.json" "$out/$1" > "$out/logs/$1.log" 2>&1
  echo "$1: rc $?"; tail -3 "$out/logs/$1.log"
}
cases=${CASES:-"gpt2_dp2 llama_dp1 llama_dp2_model llama019_dp2"}
for c in $cases; do
  case $c in
    gpt2_dp2) run gpt2_dp2 016 2 true "$gpt2" ;;
    llama_dp1) run llama_dp1 016 1 true "$llama" ;;
    llama_dp2_model) run llama_dp2_model 016 2 false "$llama" ;;
    llama019_dp2) run llama019_dp2 019 2 true "$llama" ;;
    load)
      echo "{\"model\": $llama, \"watchdog\": ${WATCHDOG:-150}}" > "$out/logs/load.json"
      PYTHONPATH=/tmp/site_016:$PWD:$PWD/tests timeout ${LIMIT:-240} python3 -m torch.distributed.run \
        --nproc-per-node 2 tests/mcore_fsdp_dtensor.py load "$out/logs/load.json" "$out/loaded.pt" .whl/fsdp_in/* \
        > "$out/logs/load.log" 2>&1
      echo "load: rc $?"; tail -5 "$out/logs/load.log" ;;
  esac
done
