"""Accelerate's Megatron-LM configs (`accelerate config` -> default_config.yaml) as trainer settings.

An Accelerate config with `distributed_type: MEGATRON_LM` holds a `megatron_lm_config` block of parallel
settings and the launch (processes, machines, rendezvous). `ckpt train --accelerate-config FILE` reads such a
file, and a run config may hold the same keys itself. Each key maps onto a trainer key (below); DP is the
processes over TP x PP, as Accelerate implies; keys that change nothing here (compute_environment, ...) are
accepted, and keys this mapping does not know are listed in a warning, never dropped in silence.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ckpt_tools.errors import ConfigError

BLOCK = "megatron_lm_config"
MEGATRON_KEYS = {  # megatron_lm_config key -> trainer key
    "megatron_lm_tp_degree": "tp_degree",
    "megatron_lm_pp_degree": "pp_degree",
    "megatron_lm_num_micro_batches": "num_micro_batches",
    "megatron_lm_gradient_clipping": "gradient_clipping",
    "megatron_lm_sequence_parallelism": "sequence_parallelism",
    "megatron_lm_recompute_activations": "recompute_activations",
    "megatron_lm_use_distributed_optimizer": "use_distributed_optimizer",
    "megatron_lm_learning_rate_decay_iters": "lr_decay_iters",
}
MIXED_PRECISION = {"no": "fp32", "bf16": "bf16"}
LAUNCH_KEYS = ("num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port")
# Accelerate keys that say nothing the trainer needs (machine setup, other backends' empty blocks)
INERT_KEYS = ("compute_environment", "distributed_type", "downcast_bf16", "main_training_function", "rdzv_backend",
              "same_network", "use_cpu", "deepspeed_config", "fsdp_config", "debug", "enable_cpu_affinity",
              "gpu_ids", "tpu_env", "tpu_use_cluster", "tpu_use_sudo", "dynamo_config", "ipex_config",
              "mpirun_config")
ACCELERATE_KEYS = (BLOCK, "mixed_precision", *LAUNCH_KEYS, *INERT_KEYS)


@dataclass
class Accelerate:
    settings: dict = field(default_factory=dict)  # trainer config keys
    processes: int | None = None
    machines: int = 1
    machine_rank: int = 0
    main_ip: str | None = None
    main_port: int | None = None
    unknown: list[str] = field(default_factory=list)

    def data_parallel(self, tp: int, pp: int) -> int | None:
        """DP = processes / (TP x PP); None when the config names no process count."""
        if self.processes is None:
            return None
        if self.processes % (tp * pp):
            raise ConfigError(f"Accelerate config: num_processes {self.processes} is not divisible by "
                              f"megatron_lm_tp_degree x megatron_lm_pp_degree = {tp} x {pp}: fix one of them")
        return self.processes // (tp * pp)

    def overrides(self) -> list[str]:
        """The settings as `--set key=value` items."""
        return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.settings.items()]


def parse(raw: dict, where: str) -> Accelerate:
    """An Accelerate config (or the Accelerate keys of a run config) -> trainer settings and launch."""
    if raw.get("distributed_type", "MEGATRON_LM") != "MEGATRON_LM":
        raise ConfigError(f"{where}: distributed_type {raw['distributed_type']!r}: only Accelerate's MEGATRON_LM "
                          f"configs describe a Megatron run; run `accelerate config` and choose Megatron-LM")
    out = Accelerate()
    block = raw.get(BLOCK) or {}
    if not isinstance(block, dict):
        raise ConfigError(f"{where}: {BLOCK} is a {type(block).__name__}, expected a mapping of megatron_lm_* keys")
    for key, value in block.items():
        if key in MEGATRON_KEYS:
            out.settings[MEGATRON_KEYS[key]] = value
        else:
            out.unknown.append(f"{BLOCK}.{key}")
    precision = raw.get("mixed_precision")
    if precision is not None:
        if precision not in MIXED_PRECISION:
            raise ConfigError(f"{where}: mixed_precision {precision!r} is not supported: use bf16 or no")
        out.settings["dtype"] = MIXED_PRECISION[precision]
    sp, tp = out.settings.get("sequence_parallelism"), out.settings.get("tp_degree", 1)
    if sp and tp == 1:
        raise ConfigError(f"{where}: megatron_lm_sequence_parallelism needs megatron_lm_tp_degree > 1: set it to "
                          f"false or raise the TP degree")
    out.processes = _int(raw, "num_processes", None, where)
    out.machines = _int(raw, "num_machines", 1, where)
    out.machine_rank = _int(raw, "machine_rank", 0, where)
    out.main_ip, out.main_port = raw.get("main_process_ip"), _int(raw, "main_process_port", None, where)
    if out.processes is not None and out.processes % out.machines:
        raise ConfigError(f"{where}: num_processes {out.processes} does not spread evenly over num_machines "
                          f"{out.machines}: fix one of them")
    out.unknown += [k for k in raw if k not in ACCELERATE_KEYS]
    return out


def _int(raw: dict, key: str, default, where: str):
    value = raw.get(key, default)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"{where}: {key} is {value!r}, expected a non-negative integer")
    return value
