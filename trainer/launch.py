"""Build the torchrun command for `ckpt train`, after checking the config so errors come early."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from ckpt_tools.errors import ConfigError
from ckpt_tools.model import layout
from ckpt_tools.ports import free_port
from ckpt_tools.team import torchrun
from trainer import accelerate, data
from trainer.config import TrainConfig, accelerate_keys_of, load_config, read_yaml


@dataclass
class Launch:
    cfg: TrainConfig
    overrides: list[str]  # what the ranks get as --set items (an Accelerate file's settings first)
    dp: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int | None
    unknown: list[str]  # Accelerate keys that map to nothing here


def resolve(config_path: str, overrides: list[str], dp: int | None = None, nnodes: int | None = None,
            node_rank: int | None = None, master_addr: str | None = None, master_port: int | None = None,
            accelerate_config: str | None = None) -> Launch:
    """The run's config and launch: the run config, an Accelerate config (a file of its own, or the Accelerate
    keys of the run config), then the command line, each over the one before."""
    acc = accelerate.parse(read_yaml(accelerate_config), accelerate_config) if accelerate_config else \
        accelerate_keys_of(config_path)
    sets = (acc.overrides() if acc and accelerate_config else []) + list(overrides)
    cfg = load_config(config_path, sets)
    derived = acc.data_parallel(cfg.tp_degree, cfg.pp_degree) if acc else None
    return Launch(cfg, sets, dp if dp is not None else derived or 1,
                  nnodes if nnodes is not None else (acc.machines if acc else 1),
                  node_rank if node_rank is not None else (acc.machine_rank if acc else 0),
                  master_addr or (acc.main_ip if acc and acc.main_ip else "127.0.0.1"),
                  master_port if master_port is not None else (acc.main_port if acc else None),
                  acc.unknown if acc else [])


def launch_command(config_path: str, overrides: list[str], dp: int | None = None, nnodes: int | None = None,
                   node_rank: int | None = None, master_addr: str | None = None, master_port: int | None = None,
                   accelerate_config: str | None = None) -> list[str]:
    run = resolve(config_path, overrides, dp, nnodes, node_rank, master_addr, master_port, accelerate_config)
    cfg, dp, nnodes, node_rank, master_addr, master_port = (run.cfg, run.dp, run.nnodes, run.node_rank,
                                                            run.master_addr, run.master_port)
    overrides = run.overrides
    if run.unknown:
        print(f"warning: Accelerate config keys not used by the trainer: {', '.join(run.unknown)}", file=sys.stderr)
    world = cfg.tp_degree * cfg.pp_degree * dp
    cfg.data_parallel_size(world)
    cfg.check_data_paths()
    spec = cfg.model_spec(data.vocab_size(data.load_tokenizer(cfg.tokenizer)))
    layout.layers_per_stage(spec.num_layers, cfg.pp_degree, cfg.layers_per_stage)
    if dp < 1 or nnodes < 1 or world % nnodes:
        raise ConfigError(f"world size TP x PP x DP = {world} does not spread over {nnodes} node(s): "
                          f"choose DP so that the world is a multiple of --nnodes")
    cmd = [sys.executable, "-m", "trainer.launch", f"--nnodes={nnodes}", f"--node-rank={node_rank}",
           f"--nproc-per-node={world // nnodes}", f"--master-addr={master_addr}",
           f"--master-port={master_port or free_port()}", "-m", "trainer", "--config", str(Path(config_path))]
    for item in overrides:
        cmd += ["--set", item]
    return cmd


if __name__ == "__main__":  # `python -m trainer.launch ARGS` = `torchrun ARGS` without the traceback
    sys.exit(torchrun(sys.argv[1:]))
