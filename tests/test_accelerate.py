"""Accelerate users' configs: `ckpt train --accelerate-config FILE`, or a run config holding Accelerate's keys,
resolve to the same trainer configuration as the equivalent `ckpt train` flags."""
from __future__ import annotations

import pytest
import yaml
from conftest import CONFIGS

from ckpt_tools.errors import ConfigError
from trainer.launch import resolve

# Accelerate's documented Megatron-LM config ("Megatron-LM" usage guide): TP2, PP2, DP2, bf16, 8 processes
DOCS_CONFIG = """\
compute_environment: LOCAL_MACHINE
deepspeed_config: {}
distributed_type: MEGATRON_LM
downcast_bf16: 'no'
fsdp_config: {}
machine_rank: 0
main_process_ip: null
main_process_port: null
main_training_function: main
megatron_lm_config:
  megatron_lm_gradient_clipping: 1.0
  megatron_lm_num_micro_batches: 2
  megatron_lm_pp_degree: 2
  megatron_lm_recompute_activations: true
  megatron_lm_sequence_parallelism: true
  megatron_lm_tp_degree: 2
  megatron_lm_use_distributed_optimizer: true
mixed_precision: bf16
num_machines: 1
num_processes: 8
rdzv_backend: static
same_network: true
use_cpu: false
"""
RUN = str(CONFIGS / "tiny_llama.yaml")


def write(tmp_path, text: str, name: str = "accelerate.yaml") -> str:
    (tmp_path / name).write_text(text)
    return str(tmp_path / name)


def test_the_documented_config_equals_the_equivalent_flags(tmp_path):
    acc = resolve(RUN, [], accelerate_config=write(tmp_path, DOCS_CONFIG))
    flags = resolve(RUN, ["tp_degree=2", "pp_degree=2", "num_micro_batches=2", "gradient_clipping=1.0",
                          "sequence_parallelism=true", "recompute_activations=true",
                          "use_distributed_optimizer=true", "dtype=bf16"], dp=2)
    assert acc.cfg == flags.cfg
    assert (acc.dp, acc.nnodes, acc.node_rank, acc.master_addr) == (flags.dp, 1, 0, "127.0.0.1") == (2, 1, 0, "127.0.0.1")
    assert acc.unknown == []


def test_a_run_config_may_hold_the_accelerate_keys(tmp_path):
    run = yaml.safe_load((CONFIGS / "tiny_llama.yaml").read_text())
    for key in ("tp_degree", "pp_degree", "num_micro_batches", "gradient_clipping", "sequence_parallelism",
                "recompute_activations", "use_distributed_optimizer", "dtype"):
        run.pop(key, None)
    run.update({k: v for k, v in yaml.safe_load(DOCS_CONFIG).items()})
    for k in ("corpus", "tokenizer", "data_cache_dir", "save_dir"):  # paths relative to the fixture dir
        run[k] = str((CONFIGS / run[k]).resolve())
    both = resolve(write(tmp_path, yaml.safe_dump(run), "run.yaml"), [])
    separate = resolve(RUN, [], accelerate_config=write(tmp_path, DOCS_CONFIG))
    assert both.cfg == separate.cfg and both.dp == separate.dp == 2


@pytest.mark.parametrize("change,expected", [
    ({"num_processes": 6}, "num_processes 6 is not divisible by megatron_lm_tp_degree x megatron_lm_pp_degree = 2 x 2"),
    ({"megatron_lm_config": {"megatron_lm_sequence_parallelism": True}}, "needs megatron_lm_tp_degree > 1"),
    ({"mixed_precision": "fp8"}, "mixed_precision 'fp8' is not supported"),
    ({"distributed_type": "DEEPSPEED"}, "only Accelerate's MEGATRON_LM configs"),
])
def test_an_inconsistent_config_is_a_clear_error(change, expected, tmp_path):
    config = {**yaml.safe_load(DOCS_CONFIG), **change}
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        resolve(RUN, [], accelerate_config=write(tmp_path, yaml.safe_dump(config)))


def test_unknown_keys_are_listed(tmp_path):
    config = yaml.safe_load(DOCS_CONFIG)
    config["megatron_lm_config"]["megatron_lm_pp_partition_method"] = "uniform"
    config["my_setting"] = 3
    run = resolve(RUN, [], accelerate_config=write(tmp_path, yaml.safe_dump(config)))
    assert run.unknown == ["megatron_lm_config.megatron_lm_pp_partition_method", "my_setting"]


@pytest.mark.slow
def test_a_cpu_run_with_an_accelerate_config_trains_and_saves_shards(tmp_path):
    """`ckpt train --config RUN --accelerate-config FILE` with a CPU-sized variant of the documented config."""
    import json
    import subprocess
    import sys
    config = yaml.safe_load(DOCS_CONFIG)
    config.update(num_processes=2, mixed_precision="no")
    config["megatron_lm_config"].update(megatron_lm_pp_degree=1, megatron_lm_sequence_parallelism=False,
                                        megatron_lm_use_distributed_optimizer=False)
    save = tmp_path / "save"
    cmd = [sys.executable, "-c", "from ckpt_tools.cli import main; main()", "train", "--config", RUN,
           "--accelerate-config", write(tmp_path, yaml.safe_dump(config)), "--set", f"save_dir={save}",
           "--set", f"data_cache_dir={tmp_path / 'cache'}", "--set", "train_iters=3", "--set", "log_interval=1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=CONFIGS.parent.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--nproc-per-node=2" in proc.stderr  # DP = 2 processes / (TP2 x PP1) = 1
    metrics = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [1, 2, 3]
    assert sorted(p.name for p in (save / "checkpoint-3").glob("pytorch_model_*")) == [
        "pytorch_model_tp_0_pp_0.bin", "pytorch_model_tp_1_pp_0.bin"]
