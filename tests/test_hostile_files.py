"""Hostile files: a malicious pickle placed as a shard is refused by every verb and never runs; a
damaged checkpoint is refused by the trainer's resume (under torchrun, as `ckpt train` runs it)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from bad_inputs import (
    CONFIGS,
    ITERATION,
    OUT,
    ROOT,
    M,
    O,
    OpenFile,
    SystemCall,
    assert_no_out,
    copy_save,
    error_line,
    invoke,
    llama,
    make_ckpt,
    plant_malicious,
    read_meta,
    resave,
    truncate,
)

from ckpt_tools.forms import checkpoint as fmt


# ---------------------------------------------------------------- malicious pickles
@pytest.fixture(params=["os.system", "builtins.open"])
def malicious(request, bases, tmp_path):
    """A copy of the base checkpoint whose pytorch_model_tp_1_pp_0.bin would create MARKER when unpickled."""
    marker = tmp_path / "MARKER"
    ck = copy_save(bases.base, tmp_path / "src")
    payload = SystemCall(f"touch {marker}") if request.param == "os.system" else OpenFile(str(marker))
    plant_malicious(ck, M(1, 0), payload)
    assert fmt.check_files(fmt.Meta.read(ck)) == []  # sizes and hashes agree: only the allow-list is left
    return ck, marker, request.param


def _refused(line: str, ck: Path, global_name: str) -> None:
    assert f"{ck / M(1, 0)}: refused to load" in line and "allow-list" in line and "--trust-pickle" in line, line
    assert global_name.split(".")[-1] in line, line


@pytest.mark.parametrize("args,table", [
    (["merge", "{ck}", "{out}"], False),
    (["merge", "{ck}", "{out}", "--format", "safetensors", "--check-hashes"], False),
    (["reshard", "{ck}", "{out}", "--tp", "1", "--pp", "1"], False),
    (["verify", "{ck}", "--device", "cpu"], True),
    (["inspect", "{ck}", "--tensors"], False),
], ids=["merge", "merge-safetensors", "reshard", "verify", "inspect-tensors"])
def test_malicious_pickle_is_refused(args, table, malicious, tmp_path):
    ck, marker, global_name = malicious
    out = tmp_path / OUT
    line = error_line(invoke(*[a.format(ck=ck, out=out) for a in args]), table=table)
    _refused(line, ck, global_name)
    assert not marker.exists(), "the pickle ran code"
    assert_no_out(out)


def test_malicious_optimizer_shard_is_refused_by_reshard(bases, tmp_path):
    marker = tmp_path / "MARKER"
    ck = copy_save(bases.base, tmp_path / "src")
    plant_malicious(ck, O(1, 1), OpenFile(str(marker)))
    line = error_line(invoke("reshard", ck, tmp_path / OUT, "--tp", "1", "--pp", "1"))
    assert f"{ck / O(1, 1)}: refused to load" in line and "--trust-pickle" in line
    assert not marker.exists()
    assert_no_out(tmp_path / OUT)


# ---------------------------------------------------------------- trainer resume (torchrun, as `ckpt train` runs it)
TRAINER_SPEC = llama(vocab_size=1000, norm_epsilon=1e-5, rotary_base=10000.0)  # = fixtures/configs/tiny_llama.yaml


@pytest.fixture(scope="session")
def trainer_base(tmp_path_factory) -> Path:
    """tiny_llama's model at TP1 x PP1 (the trainer's tokenizer has 1000 tokens): a save dir to resume from."""
    save = tmp_path_factory.mktemp("bad-input-trainer") / "base"
    make_ckpt(save, TRAINER_SPEC, tp=1, pp=1)
    return save


def resume(load: Path, tmp: Path) -> subprocess.CompletedProcess:
    """The command `ckpt train --config tiny_llama.yaml --tp 1 --pp 1 --set load=...` launches (torchrun,
    one rank), with train_iters = the checkpoint's iteration: it resumes and stops."""
    from trainer.launch import launch_command
    sets = [f"load={load}", f"save_dir={tmp / 'save'}", f"data_cache_dir={tmp.parent / 'data-cache'}",
            "tp_degree=1", "pp_degree=1", "num_micro_batches=1", f"train_iters={ITERATION}"]
    cmd = launch_command(str(CONFIGS / "tiny_llama.yaml"), sets, dp=1)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT, check=False)


def trainer_error(proc: subprocess.CompletedProcess) -> str:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("error (rank")]
    assert errors, output
    return errors[0]


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["malicious", "truncated", "wrong shape"])
def test_trainer_resume_refuses(damage, trainer_base, tmp_path):
    ck = copy_save(trainer_base, tmp_path / "src")
    marker = tmp_path / "MARKER"
    if damage == "malicious":
        plant_malicious(ck, M(0, 0), SystemCall(f"touch {marker}"))
        expected = [f"{ck / M(0, 0)}: refused to load", "allow-list", "--trust-pickle"]
    elif damage == "truncated":
        truncate(ck / M(0, 0))
        recorded = read_meta(ck)["files"][M(0, 0)]["size"]
        expected = [f"{ck / M(0, 0)}: {recorded // 2} bytes, meta.json records {recorded}"]
    else:
        resave(ck, O(0, 0), lambda o: o["optimizer"]["decoder.layers.1.mlp.linear_fc2.weight"].update(
            master=torch.zeros(64, 95)))
        expected = [(f"{ck / O(0, 0)}: decoder.layers.1.mlp.linear_fc2.weight state has shape (64, 95), "
                     f"expected (64, 96)")]
    line = trainer_error(resume(ck.parent, tmp_path))
    for text in expected:
        assert text in line, line
    assert not marker.exists()
    assert not (tmp_path / "save" / "latest").exists()
