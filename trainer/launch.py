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
    cmd = [sys.executable, "-m", "trainer.launch", f"--nnodes={nnodes}", f"--node-rank={node_rank}",
           f"--nproc-per-node={world // nnodes}", f"--master-addr={master_addr}",
           f"--master-port={master_port or free_port()}", "-m", "trainer", "--config", str(Path(config_path))]
    for item in overrides:
        cmd += ["--set", item]
    return cmd


def torchrun(argv: list[str]) -> int:
    """torchrun, except that a failed rank ends it with exit code 1 and no traceback of torchrun's own: the
    ranks have printed their one-line `error (rank N): ...` messages, which say what went wrong."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main
    try:
        main(argv)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        print(f"torchrun: rank {rank} exited with code {failure.exitcode}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":  # `python -m trainer.launch ARGS` = `torchrun ARGS` without the traceback
    sys.exit(torchrun(sys.argv[1:]))
