"""`ckpt train` / `ckpt inspect` through click: exit codes, one-line errors, the summary's figures."""
from __future__ import annotations

import math
import re

import pytest
from click.testing import CliRunner

from conftest import CONFIGS
from ckpt_tools.model import layout
from ckpt_tools.cli import main
from ckpt_tools.errors import ConfigError
from ckpt_tools.forms.shards import open_checkpoint
from ckpt_tools.model.families import names as family_names
from trainer.config import load_config

FAMILY_NAMES = ", ".join(family_names())


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def one_line_error(result) -> str:
    assert result.exit_code == 1, result.output
    lines = [l for l in result.output.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    return lines[0]


@pytest.mark.parametrize("sets,expected", [
    (["tp_degree=3"], "num_attention_heads 4 is not divisible by TP 3"),
    (["num_query_groups=1", "tp_degree=2"], "num_query_groups 1 is not divisible by TP 2"),
    (["architecture=bert"], f"unknown architecture 'bert': expected one of {FAMILY_NAMES}"),
    (["pp_degree=8"], "PP 8 needs at least one layer per stage but the model has 4 layers"),
    (["pp_degree=3"], "num_layers 4 is not divisible by PP 3"),
    (["global_batch_size=7"], "global_batch_size 7 != micro_batch_size x num_micro_batches x DP"),
    (["no_such_key=1"], "unknown config key(s) no_such_key"),
    (["dtype=fp8"], "dtype 'fp8' is not supported"),
    (["sequence_parallelism=true", "seq_length=63"], "seq_length 63 is not divisible by tp_degree 2"),
    (["sequence_parallelism=true", "tp_degree=1", "pp_degree=4"], "sequence_parallelism needs tp_degree > 1"),
    (["recompute_granularity=some"], "recompute_granularity 'some' is not supported"),
])
def test_bad_config_is_one_line_error(sets, expected, tmp_path):
    args = ["train", "--config", str(CONFIGS / "tiny_llama.yaml"), "--set", f"save_dir={tmp_path}/run"]
    for s in sets:
        args += ["--set", s]
    line = one_line_error(run(*args))
    assert expected in line
    assert not (tmp_path / "run").exists()


def test_missing_config_file(tmp_path):
    line = one_line_error(run("train", "--config", str(tmp_path / "nope.yaml")))
    assert "nope.yaml not found" in line


def test_world_not_divisible():
    cfg = load_config(CONFIGS / "tiny_llama.yaml")
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by tp_degree x pp_degree = 2 x 2"):
        cfg.data_parallel_size(6)
    assert cfg.data_parallel_size(8) == 2


def test_config_paths_resolve_against_the_file():
    cfg = load_config(CONFIGS / "tiny_llama.yaml")
    assert cfg.corpus == str((CONFIGS.parent / "corpus.txt").resolve())
    assert cfg.tokenizer == str((CONFIGS.parent / "tokenizer").resolve())


@pytest.mark.slow
def test_inspect_summary(llama_run):
    save, _ = llama_run
    result = run("inspect", str(save))
    assert result.exit_code == 0, result.output
    out = result.output
    assert "checkpoint-8" in out and "iteration   8" in out
    assert "TP 2 x PP 2 (saved with DP 1); layers per stage 2,2" in out
    assert "1,000 true, 1,024 padded (24 padding rows)" in out
    assert "params float32, optimizer master float32" in out
    # parameter count, independently: numel of every full tensor joined from the shards
    shards = open_checkpoint(save)
    total = sum(math.prod(shards.full(k).shape) for k in shards.keys()
                if layout.find_rule(k, shards.meta.spec, 2).shape is not None)
    assert re.search(rf"parameters  {total:,} ", out), (total, out)
    for t in (0, 1):
        for p in (0, 1):
            assert f"pytorch_model_tp_{t}_pp_{p}.bin" in out


def test_inspect_not_a_checkpoint(tmp_path):
    (tmp_path / "x.txt").write_text("hi")
    line = one_line_error(run("inspect", str(tmp_path)))
    assert "neither a checkpoint dir (no meta.json) nor a save dir (no latest)" in line and "x.txt" in line


@pytest.mark.parametrize("sets,expected", [
    (["tokenizer=/nonexistent/tok"], "tokenizer /nonexistent/tok has no tokenizer.json"),
    (["corpus=/nonexistent/c.txt"], "corpus /nonexistent/c.txt not found"),
    (["layers_per_stage=2,2", "pp_degree=2"], "layers_per_stage '2,2' must be a list of integers"),
    (["layers_per_stage=[1,2]", "pp_degree=2"], "layers per stage 1,2 do not fit 4 layers on 2 stages"),
])
def test_bad_data_or_split_is_one_line_error(sets, expected, tmp_path):
    args = ["train", "--config", str(CONFIGS / "tiny_llama.yaml"), "--set", f"save_dir={tmp_path}/run"]
    for s in sets:
        args += ["--set", s]
    assert expected in one_line_error(run(*args))


def test_inspect_a_file_or_bad_meta(tmp_path):
    f = tmp_path / "file.bin"
    f.write_bytes(b"x")
    assert "is a file" in one_line_error(run("inspect", str(f)))
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "meta.json").write_text("[1, 2]")
    assert "malformed meta.json" in one_line_error(run("inspect", str(tmp_path / "ck")))
    (tmp_path / "ck" / "meta.json").write_text('{"format": "ckpt-tools/1"}')
    assert "meta.json lacks model, parallel" in one_line_error(run("inspect", str(tmp_path / "ck")))


def test_numpy_rng_state_from_a_megatron_file_loads_but_code_does_not(tmp_path):
    """Megatron-LM files hold numpy RNG state (allow-listed); a pickle that runs code is refused."""
    import argparse
    import os

    import numpy as np
    import torch

    from ckpt_tools import io
    from ckpt_tools.errors import FormatError

    good = tmp_path / "model_optim_rng.pt"
    torch.save({"args": argparse.Namespace(num_layers=2), "rng_state": [{"np": np.random.get_state()}]}, good)
    loaded = io.load_file(good)
    assert loaded["args"].num_layers == 2

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    bad = tmp_path / "evil.bin"
    torch.save({"x": Evil()}, bad)
    with pytest.raises(FormatError, match="refused to load"):
        io.load_file(bad)
    assert not (tmp_path / "pwned").exists()


def test_numbers_written_without_a_dot_are_numbers(tmp_path):
    """`lr: 1e-2` (in the file) and `--set min_lr=1e-3` are floats, as people mean them, not YAML 1.1's strings."""
    from trainer.config import load_config
    config = tmp_path / "c.yaml"
    config.write_text("architecture: llama\nlr: 1e-2\nnorm_epsilon: 1e-6\n")
    cfg = load_config(config, ["min_lr=1e-3", "adam_eps=1E-8"])
    assert (cfg.lr, cfg.min_lr, cfg.adam_eps, cfg.model["norm_epsilon"]) == (1e-2, 1e-3, 1e-8, 1e-6)
    assert all(isinstance(x, float) for x in (cfg.lr, cfg.min_lr, cfg.adam_eps, cfg.model["norm_epsilon"]))
