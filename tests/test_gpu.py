"""GPU-only: megatron-core's real GPTModel forward (CUDA) on the trainer's weights equals the
trainer's forward. Skipped without CUDA; run on a GPU machine (see docs/gpu.md)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import torchrun

pytestmark = pytest.mark.gpu
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_megatron_core_forward_equals_trainer(tp, arch, dtype, tmp_path):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    out = tmp_path / "report.json"
    torchrun(tp, [str(Path(__file__).with_name("gpu_mcore_forward.py")), str(out), arch, dtype])
    for r in json.loads(out.read_text()):
        print(r)
        assert r["rel_l2"] < TOLERANCE[dtype], r
        assert r["top1_agreement_local_shard"] > (0.999 if dtype == "fp32" else 0.97), r
