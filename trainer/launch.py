"""Build the torchrun command for `ckpt train`, after checking the config so errors come early."""
from __future__ import annotations

import socket
import sys
from pathlib import Path

from ckpt_tools import layout
from ckpt_tools.errors import ConfigError
from trainer import data
from trainer.config import load_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(config_path: str, overrides: list[str], dp: int, nnodes: int = 1, node_rank: int = 0,
                   master_addr: str = "127.0.0.1", master_port: int | None = None) -> list[str]:
    cfg = load_config(config_path, overrides)
    world = cfg.tp_degree * cfg.pp_degree * dp
    cfg.data_parallel_size(world)
    cfg.check_data_paths()
    spec = cfg.model_spec(data.vocab_size(data.load_tokenizer(cfg.tokenizer)))
    layout.layers_per_stage(spec.num_layers, cfg.pp_degree, cfg.layers_per_stage)
    if dp < 1 or nnodes < 1 or world % nnodes:
        raise ConfigError(f"world size TP x PP x DP = {world} does not spread over {nnodes} node(s): "
                          f"choose DP so that the world is a multiple of --nnodes")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node-rank={node_rank}",
           f"--nproc-per-node={world // nnodes}", f"--master-addr={master_addr}",
           f"--master-port={master_port or free_port()}", "-m", "trainer", "--config", str(Path(config_path))]
    for item in overrides:
        cmd += ["--set", item]
    return cmd
