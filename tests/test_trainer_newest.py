"""The trainer runs on megatron-core 0.19 (the newest release) as on the installed 0.16.1: the same run on either
gives the same loss curve and the same checkpoint, to the last bit (CPU in the suite; CUDA with graphs and the fused
weight-gradient accumulation as a gpu test)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from conftest import assert_same_files, train

TESTS = Path(__file__).resolve().parent
LAUNCHER = str(TESTS / "trainer_newest.py")


def _newest_or_skip() -> None:
    sys.path.insert(0, str(TESTS))
    import mcore_newest
    if mcore_newest.location() is None:
        pytest.skip("megatron-core 0.19.2 is not staged (scripts/setup_env.sh; on a GPU machine set MCORE_NEWEST)")


def _curve(metrics: list[dict]) -> list[tuple]:
    return [(m["iteration"], m["loss"], m["grad_norm"]) for m in metrics]


def _same_checkpoints(a: Path, b: Path, tp: int, pp: int, step: int) -> None:
    for kind in ("model", "optimizer"):
        assert_same_files(a / f"checkpoint-{step}", b / f"checkpoint-{step}", kind, tp, pp, 0.0)


def test_the_trainer_on_megatron_core_019_trains_the_same_run_as_on_016(llama_run, tmp_path):
    """TP2 x PP2 on CPU (gloo): the session's 0.16.1 run, again on 0.19.2."""
    _newest_or_skip()
    save, curve = llama_run
    newest = train("tiny_llama.yaml", tmp_path / "run", 4, launcher=LAUNCHER, train_iters=8, save_interval=4)
    assert _curve(newest) == _curve(curve) and len(newest) == 8
    _same_checkpoints(save, tmp_path / "run", 2, 2, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_trainer_on_megatron_core_019_trains_the_same_run_on_a_gpu(tmp_path):
    """One GPU, bf16 with fp32 masters, CUDA graphs and the GEMM-fused gradient accumulation (the defaults)."""
    if "MCORE_NEWEST" not in os.environ:
        pytest.skip("set MCORE_NEWEST to megatron-core 0.19's install dir (docs/gpu.md)")
    _newest_or_skip()
    common = dict(tp_degree=1, pp_degree=1, dtype="bf16", train_iters=4, num_micro_batches=2)
    old = train("tiny_llama.yaml", tmp_path / "old", 1, **common)
    new = train("tiny_llama.yaml", tmp_path / "new", 1, launcher=LAUNCHER, **common)
    print(f"\n0.16.1 {[m['loss'] for m in old]}\n0.19.2 {[m['loss'] for m in new]}")
    assert _curve(new) == _curve(old) and len(new) == 4
    _same_checkpoints(tmp_path / "old", tmp_path / "new", 1, 1, 4)
