"""The weight gradients accumulated inside their GEMM (trainer/wgrad.py, megatron-core's gradient_accumulation_fusion)
fill the optimizer's buffer as the unfused path does, for every kind of weight (tests/wgrad_check.py runs megatron-core's
fused backward on this CPU). On a GPU: tests/test_gpu_graphs.py."""
from __future__ import annotations

import json

from conftest import torchrun


def test_fused_accumulation_fills_the_buffer_the_unfused_path_fills(tmp_path):
    out = tmp_path / "wgrad.json"
    torchrun(1, ["tests/wgrad_check.py", str(out)])
    report = json.loads(out.read_text())
    assert set(report) == {"llama", "gpt2-tied", "mixtral-loop", "mixtral-grouped"}
    for name, r in report.items():
        print(name, r)
        unfused, fused = r["accumulations"]
        assert unfused == 0 and fused > 0 and r["covered"] > 0, (name, r)  # the fused GEMM ran, and only when on
        assert r["worst"] < 1e-6, (name, r)  # the tied embedding's lookup gradient and the grouped experts' kept
        assert r["zero_fraction_fused"] == r["zero_fraction_plain"], (name, r)
    # the grouped experts read their weights without their linear layers: fewer fused GEMMs, real gradients added
    assert report["mixtral-grouped"]["accumulations"][1] < report["mixtral-loop"]["accumulations"][1]
