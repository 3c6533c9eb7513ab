"""One YAML file per run, flat. Parallel keys use Accelerate's MegatronLMPlugin names.

Relative paths in the file are resolved against the file's own directory; overrides given on the
command line (`--set key=value`) are resolved against the current directory.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ckpt_tools.errors import ConfigError
from ckpt_tools.model.spec import ModelSpec, build_dataclass

# The model keys of a config file are ModelSpec's fields (vocab_size comes from the tokenizer), flat in the
# file and kept together in `TrainConfig.model`; these are the trainer's defaults for a tiny model.
MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelSpec) if f.name != "vocab_size")
MODEL_DEFAULTS = {"architecture": "llama", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
                  "ffn_hidden_size": 172, "max_position_embeddings": 128, "norm_epsilon": 1e-5}
PATH_FIELDS = ("corpus", "tokenizer", "data_cache_dir", "save_dir", "load")
DTYPES = ("fp32", "bf16")


@dataclass
class TrainConfig:
    model: dict = field(default_factory=lambda: dict(MODEL_DEFAULTS))  # ModelSpec fields, flat in the file
    seq_length: int = 64
    # parallelism (MegatronLMPlugin names); DP = world / (TP x PP)
    tp_degree: int = 1
    pp_degree: int = 1
    ep_degree: int = 1  # MoE models: experts split over this many data-parallel ranks (megatron-core's EP)
    num_micro_batches: int = 1
    layers_per_stage: list[int] | None = None
    gradient_clipping: float = 1.0
    sequence_parallelism: bool = False
    moe_aux_loss_coeff: float = 0.0  # MoE models: megatron-core's load-balancing loss weight (its default 0)
    mtp_loss_scale: float = 0.1  # multi-token prediction layers: their loss's weight (megatron-core's
    # mtp_loss_scaling_factor, its default)
    moe_layer: str = "ours"  # MoE models' MLPs: trainer/moe.py's ("ours") or megatron-core's MoELayer ("megatron_core")
    recompute_activations: bool = False  # Megatron-LM's meaning: selective recompute
    recompute_granularity: str | None = None  # "selective" | "full"; None: selective if recompute_activations
    use_distributed_optimizer: bool = False  # masters and Adam moments sharded over DP (ZeRO-1)
    compile: bool = False  # torch.compile each transformer layer and the loss (GPUs)
    cuda_graphs: bool = True  # GPUs: the layers' forward and backward captured as CUDA graphs (trainer/graphs.py says
    # where they are not)
    gradient_accumulation_fusion: bool = True  # GPUs: weight gradients added into the fp32 buffer by their GEMM
    # optimization
    micro_batch_size: int = 2
    global_batch_size: int | None = None  # checked: = micro_batch_size x num_micro_batches x DP
    train_iters: int = 20
    lr: float = 3e-3
    min_lr: float = 3e-4
    lr_warmup_iters: int = 2
    lr_decay_iters: int | None = None  # None: train_iters
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    seed: int = 1234
    dtype: str = "fp32"  # bf16 keeps fp32 master weights in the optimizer
    accumulate_allreduce_grads_in_fp32: bool = True  # bf16: micro-batch gradients summed and DP-reduced in fp32
    overlap_grad_reduce: bool = True  # DP-reduce each bucket of gradients as soon as backward has produced it
    overlap_param_gather: bool = True  # distributed optimizer: the new weights' all-gathers run into the next forward
    ddp_bucket_size: int | None = None  # elements per reduction bucket; None: Megatron-LM's max(40M, 1M x DP)
    # data
    corpus: str = "corpus.txt"
    tokenizer: str = "tokenizer"
    data_cache_dir: str = "cache"
    # checkpoints and logs
    save_dir: str = "runs/run"
    save_interval: int = 0  # 0: only at the end
    load: str | None = None  # None: resume from save_dir if it has a checkpoint
    log_interval: int = 1
    extra: dict = field(default_factory=dict)

    def _multi_latent_attention(self) -> bool:
        """Whether the model's attention is multi-latent (given, or the family's default)."""
        from ckpt_tools.model import families
        given = self.model.get("multi_latent_attention")
        if given is not None:
            return bool(given)
        try:
            return bool(families.get(self.model.get("architecture", "llama")).default("multi_latent_attention"))
        except ConfigError:  # an unknown family: ModelSpec refuses it in its words
            return False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not supported: use one of {', '.join(DTYPES)}")
        if self.sequence_parallelism and self.tp_degree == 1:
            raise ConfigError("sequence_parallelism needs tp_degree > 1: set it to false or raise tp_degree")
        if self.sequence_parallelism and self.seq_length % self.tp_degree:
            raise ConfigError(f"sequence_parallelism splits the sequence over TP: seq_length {self.seq_length} is not "
                              f"divisible by tp_degree {self.tp_degree}; change one of them")
        if self.moe_layer not in ("ours", "megatron_core"):
            raise ConfigError(f"moe_layer {self.moe_layer!r} is not supported: use ours or megatron_core")
        moe = bool(self.model.get("num_moe_experts"))
        if self.sequence_parallelism and self._multi_latent_attention():
            raise ConfigError("sequence_parallelism with multi-latent attention is not supported by this trainer: set "
                              "it to false")
        if self.model.get("mtp_num_layers") and (self.pp_degree > 1 or self.sequence_parallelism):
            raise ConfigError("multi-token prediction layers train here at pp_degree 1 without sequence_parallelism "
                              "(their embedding lives on the first stage): set pp_degree 1 and sequence_parallelism "
                              "false")
        if self.sequence_parallelism and moe and self.moe_layer == "ours":
            raise ConfigError("sequence_parallelism with the trainer's own MoE layer is not supported: set it to false, "
                              "or set moe_layer: megatron_core")
        if moe and self.moe_layer == "megatron_core" and (self.model.get("activation") == "quick_geglu"
                                                        or self.model.get("architecture") == "gpt_oss"):
            raise ConfigError("moe_layer: megatron_core with GPT-OSS's biased, clamped quick-GeGLU experts is not "
                              "supported by this trainer: use moe_layer: ours")
        if moe and self.moe_layer == "megatron_core" and self.tp_degree > 1 and not self.sequence_parallelism:
            raise ConfigError("megatron-core's MoE layer trains under tensor parallelism only with sequence "
                              "parallelism: set sequence_parallelism: true (or tp_degree: 1)")
        if self.recompute_granularity not in (None, "selective", "full"):
            raise ConfigError(f"recompute_granularity {self.recompute_granularity!r} is not supported: use "
                              f"selective or full (or leave it unset)")
        for name in ("tp_degree", "pp_degree", "ep_degree", "num_micro_batches", "micro_batch_size", "train_iters", "seq_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, found {getattr(self, name)}")
        if self.layers_per_stage is not None and not (
                isinstance(self.layers_per_stage, list) and all(isinstance(n, int) for n in self.layers_per_stage)):
            raise ConfigError(f"layers_per_stage {self.layers_per_stage!r} must be a list of integers, e.g. [1, 3]")
        positions = self.model.get("max_position_embeddings", 2048)
        if self.seq_length > positions:
            raise ConfigError(f"seq_length {self.seq_length} exceeds max_position_embeddings "
                              f"{positions}: raise max_position_embeddings")

    @property
    def recompute(self) -> str | None:
        """None, "selective" or "full" (Megatron-LM: --recompute-activations means selective)."""
        return self.recompute_granularity or ("selective" if self.recompute_activations else None)

    def check_data_paths(self) -> None:
        if not Path(self.corpus).is_file():
            raise ConfigError(f"corpus {self.corpus} not found: set `corpus` to a text file (documents separated "
                              f"by blank lines)")
        if not (Path(self.tokenizer) / "tokenizer.json").is_file():
            raise ConfigError(f"tokenizer {self.tokenizer} has no tokenizer.json: set `tokenizer` to a HuggingFace "
                              f"tokenizer dir")

    def model_spec(self, vocab_size: int) -> ModelSpec:
        spec = ModelSpec.from_dict({**self.model, "vocab_size": vocab_size})
        spec.check_tp(self.tp_degree)
        return spec

    def data_parallel_size(self, world_size: int) -> int:
        model_parallel = self.tp_degree * self.pp_degree
        if world_size % model_parallel:
            raise ConfigError(f"world size {world_size} is not divisible by tp_degree x pp_degree = "
                              f"{self.tp_degree} x {self.pp_degree}: launch a multiple of {model_parallel} processes")
        dp = world_size // model_parallel
        if self.ep_degree > 1:
            experts = self.model.get("num_moe_experts")
            if not experts or experts % self.ep_degree:
                raise ConfigError(f"ep_degree {self.ep_degree} needs an MoE model whose num_moe_experts it divides "
                                  f"(found {experts}): set ep_degree to 1 or a divisor of the experts")
            if dp % self.ep_degree:
                raise ConfigError(f"ep_degree {self.ep_degree} splits the experts over data-parallel ranks, but DP is "
                                  f"{dp}: launch a multiple of tp_degree x pp_degree x ep_degree processes")
            if self.use_distributed_optimizer:
                raise ConfigError("use_distributed_optimizer with ep_degree > 1 is not supported by this trainer: "
                                  "set one of them off")
        expected = self.micro_batch_size * self.num_micro_batches * dp
        if self.global_batch_size is not None and self.global_batch_size != expected:
            raise ConfigError(f"global_batch_size {self.global_batch_size} != micro_batch_size x num_micro_batches x DP "
                              f"= {self.micro_batch_size} x {self.num_micro_batches} x {dp} = {expected}: "
                              f"fix one of them")
        return dp

    def to_dict(self) -> dict:
        """Flat, as in the file."""
        d = dataclasses.asdict(self)
        return {**d.pop("model"), **d}

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        """From the flat keys of a config file: ModelSpec's fields go to `model`, over the defaults."""
        model = {**MODEL_DEFAULTS, **{k: v for k, v in d.items() if k in MODEL_FIELDS}}
        rest = {k: v for k, v in d.items() if k not in MODEL_FIELDS and k != "model"}
        return build_dataclass(cls, {**rest, "model": model}, "config key(s)",
                               "see docs/config.md for the known keys")


class _Loader(yaml.SafeLoader):
    """YAML as people write numbers: `1e-5` is a float (YAML 1.1 reads it as a string without a dot)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+"
               r"|\.[0-9_]+(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."))


def _yaml(text: str):
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def _parse_value(text: str):
    try:
        return _yaml(text)
    except yaml.YAMLError:
        return text


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} not found: pass an existing YAML file")
    try:
        raw = _yaml(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]}): fix the file") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of config keys, found {type(raw).__name__}")
    return raw


def accelerate_keys_of(path: str | Path):
    """The Accelerate config a run config holds (its megatron_lm_config block and launch keys), or None."""
    from trainer import accelerate
    raw = read_yaml(path)
    if accelerate.BLOCK not in raw and "distributed_type" not in raw:
        return None
    return accelerate.parse({k: v for k, v in raw.items() if k in accelerate.ACCELERATE_KEYS}, str(path))


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Read the YAML file, resolve its relative paths, apply `key=value` overrides. Accelerate keys in the file
    (a megatron_lm_config block, mixed_precision, the launch) become the trainer keys they mean."""
    path = Path(path)
    raw = read_yaml(path)
    acc = accelerate_keys_of(path)
    if acc is not None:
        from trainer import accelerate
        raw = {**{k: v for k, v in raw.items() if k not in accelerate.ACCELERATE_KEYS}, **acc.settings}
    base = path.resolve().parent
    for k in PATH_FIELDS:
        if raw.get(k) is not None:
            raw[k] = str((base / raw[k]).resolve())
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value: write e.g. --set tp_degree=2")
        k, v = item.split("=", 1)
        value = _parse_value(v)
        raw[k] = str(Path(str(value)).resolve()) if k in PATH_FIELDS and value is not None else value
    return TrainConfig.from_dict(raw)
