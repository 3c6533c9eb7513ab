"""The bundled trainer under torchrun on CPU: it trains, saves Contract 2, resumes exactly."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import sharded_logits, torchrun, train, CONFIGS
from ckpt_tools import hashing, io
from ckpt_tools.forms import checkpoint as fmt
from ckpt_tools.model.ranks import Rank

pytestmark = pytest.mark.slow


def test_tp2_pp2_trains_and_saves_every_shard(llama_run):
    save, metrics = llama_run
    assert [m["iteration"] for m in metrics] == list(range(1, 9))
    losses = [m["loss"] for m in metrics]
    assert losses[-1] < losses[0] - 0.2, f"loss did not fall: {losses}"
    assert (save / "latest").read_text().strip() == "checkpoint-8"
    ckpt = save / "checkpoint-8"
    names = {p.name for p in ckpt.iterdir()}
    for t in (0, 1):
        for p in (0, 1):
            assert {f"pytorch_model_tp_{t}_pp_{p}.bin", f"optimizer_tp_{t}_pp_{p}.bin"} <= names
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["parallel"] == {"tp_size": 2, "pp_size": 2, "dp_size": 1, "layers_per_stage": [2, 2]}
    assert meta["vocab"]["true"] == 1000 and meta["vocab"]["padded"] == 1024
    assert meta["iteration"] == 8 and meta["consumed_samples"] == 8 * 8
    for name, rec in meta["files"].items():
        assert (ckpt / name).stat().st_size == rec["size"]
        assert hashing.hash_file(ckpt / name) == rec[hashing.HASH]
    assert not list(save.glob(".checkpoint-*"))


def test_optimizer_shard_is_per_parameter_and_matches_model(llama_run):
    save, _ = llama_run
    ckpt = save / "checkpoint-8"
    model = io.load_file(ckpt / fmt.model_file(Rank(1, 1)))["model"]
    opt = io.load_file(ckpt / fmt.optimizer_file(Rank(1, 1)))
    params = {k for k, v in model.items() if torch.is_tensor(v)}
    assert set(opt["optimizer"]) == params
    for key, state in opt["optimizer"].items():
        assert set(state) == {"master", "exp_avg", "exp_avg_sq", "step"}
        assert state["master"].dtype == torch.float32
        assert state["master"].shape == model[key].shape == state["exp_avg"].shape
        assert torch.equal(state["master"], model[key].float())  # fp32 run: master == weight
        assert float(state["step"]) == 8


def test_resume_is_bit_exact(llama_run, tmp_path):
    save, metrics = llama_run
    resumed = train("tiny_llama.yaml", tmp_path / "resumed", 4, train_iters=8,
                    load=str(save / "checkpoint-4"))
    assert [m["iteration"] for m in resumed] == [5, 6, 7, 8]
    assert [m["loss"] for m in resumed] == [m["loss"] for m in metrics[4:]]
    assert [m["grad_norm"] for m in resumed] == [m["grad_norm"] for m in metrics[4:]]
    a = io.load_file(save / "checkpoint-8" / fmt.model_file(Rank(0, 1)))["model"]
    b = io.load_file(tmp_path / "resumed" / "checkpoint-8" / fmt.model_file(Rank(0, 1)))["model"]
    for k, v in a.items():
        if torch.is_tensor(v):
            assert torch.equal(v, b[k]), k


def test_resume_with_a_different_dp_size(tmp_path):
    """DP2 x PP2 -> DP1 x PP2 with twice the micro-batches: same global batches, same curve."""
    first = train("tiny_gpt2.yaml", tmp_path / "dp2", 4, tp_degree=1, num_micro_batches=2,
                  train_iters=6, save_interval=3)
    resumed = train("tiny_gpt2.yaml", tmp_path / "dp1", 2, tp_degree=1, num_micro_batches=4,
                    train_iters=6, load=str(tmp_path / "dp2" / "checkpoint-3"))
    assert [m["iteration"] for m in resumed] == [4, 5, 6]
    for a, b in zip(first[3:], resumed):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
    meta = json.loads((tmp_path / "dp1" / "checkpoint-6" / "meta.json").read_text())
    assert meta["parallel"]["dp_size"] == 1 and meta["consumed_samples"] == 6 * 8


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_sharded_logits_equal_tp1_pp1(arch, llama_run, gpt2_run, tmp_path):
    save, _ = llama_run if arch == "llama" else gpt2_run
    tokens = torch.randint(0, 1000, (3, 48), generator=torch.Generator().manual_seed(7))
    native = sharded_logits(save, tokens, tmp_path, 2, 2)
    single = sharded_logits(save, tokens, tmp_path, 1, 1)
    assert native.shape == single.shape == (3, 48, 1000)
    rel = ((native - single).norm() / single.norm()).item()
    assert rel < 1e-5, rel
    # and the other layouts in between (llama's: gpt2 shares every split kind but its own, checked above)
    for tp, pp in ((2, 1), (1, 2)) if arch == "llama" else ():
        other = sharded_logits(save, tokens, tmp_path, tp, pp)
        assert ((other - single).norm() / single.norm()).item() < 1e-5


def test_world_not_divisible_by_tp_x_pp_is_one_line_error(tmp_path):
    args = ["-m", "trainer", "--config", str(CONFIGS / "tiny_llama.yaml"), "--set", f"save_dir={tmp_path}/r"]
    proc = torchrun(3, args, check=False)
    assert proc.returncode != 0
    lines = [l for l in proc.stderr.splitlines() if l.startswith("error (rank")]
    assert lines and "world size 3 is not divisible by tp_degree x pp_degree = 2 x 2" in lines[0]
    assert "Traceback" not in "\n".join(l for l in proc.stderr.splitlines() if l.startswith("error"))
    assert not (tmp_path / "r").exists()
