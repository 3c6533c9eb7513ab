#!/usr/bin/env bash
# On a GPU machine (1 or 2 GPUs): the gpu-marked tests, then short bf16 training runs with NCCL at
# TP2 and PP2, and a sharded-vs-TP1 forward check. Logs go to ${OUT:-runs/gpu}.
set -uo pipefail
out="${OUT:-runs/gpu}"; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpus.txt"
python3 -c "import torch, megatron.core; print('torch', torch.__version__, 'megatron-core', megatron.core.__version__)" | tee -a "$out/gpus.txt"
python3 -m pytest -q -m gpu tests/test_gpu.py -s 2>&1 | tee "$out/pytest_gpu.log" | grep -vE "^\s*$" | tail -25
n=$(nvidia-smi -L | wc -l)
for layout in "tp_degree=2 pp_degree=1" "tp_degree=1 pp_degree=2"; do
  [ "$n" -ge 2 ] || break
  name=$(echo $layout | tr -d ' =_' )
  sets=""; for kv in $layout dtype=bf16 train_iters=30 save_dir=/tmp/gpu_$name data_cache_dir=/tmp/gpu_cache; do sets="$sets --set $kv"; done
  echo "== train $layout bf16 on $n GPUs"
  python3 -m torch.distributed.run --nproc-per-node 2 -m trainer --config fixtures/configs/tiny_llama.yaml $sets 2>&1 \
    | tee "$out/train_$name.log" | grep -E "^(iter|saved|training|error)"
done
