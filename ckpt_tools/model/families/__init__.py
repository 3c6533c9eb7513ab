"""Model families: one declarative record per HuggingFace model type (DESIGN.md: "adding a family").

A `Family` says everything the tools need to know about one kind of model beyond the sizes:
  features  the ModelSpec features (ckpt_tools.model.features) it allows other values of than the feature's own, each
            with the values it allows, the first being the default;
  names     megatron-core key <-> HF name(s) and the conversion kind of each tensor (`Name` rows);
            rows whose megatron-core key the model does not hold (a bias of an unbiased model) are unused;
  config    config.json <-> ModelSpec, each key written once (`Field`, `Const`, `Rope`): reading a
            config.json and writing one are both derived from this list.
How a tensor is split across ranks is not here (that is `layout`). Each family lives in a module of
this package; `FAMILIES` lists them, first match wins where two read the same Megatron-LM arguments.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckpt_tools.model.features import BY_NAME as FEATURES, NAMES as FEATURE_NAMES
from ckpt_tools.errors import ConfigError

# Conversion kinds (full megatron-core tensor <-> HF tensors; see ckpt_tools/model/hf.py):
SAME, VOCAB, QKV, GATED, CONV1D, C_ATTN, QKV_FUSED = "same", "vocab", "qkv", "gated", "conv1d", "c_attn", "qkv_fused"
GATE_UP_T = "gate_up_t"
# Qwen3-Next: q_proj's heads each [q; gate] (megatron-core's gated linear_qkv: per group [q heads; gate heads; k; v]);
# a gated DeltaNet's in_proj_qkvz + in_proj_ba per key head (megatron-core's in_proj: [q; k; v; z; b; a] head-major);
# a norm transformers scales by w where megatron-core's zero-centred one scales by 1 + w (megatron-core's = HF's - 1)
QKV_GATED, GDN_IN, NORM_OFFSET = "qkv_gated", "gdn_in", "norm_offset"

@dataclass(frozen=True)
class Name:
    key: str  # megatron-core key, `{i}` = global layer index, `{e}` = global expert index
    kind: str
    hf: tuple[str, ...]  # HF name(s), `{i}` = layer index, `{e}` = expert index


REQUIRED = object()
OMIT = object()


@dataclass(frozen=True)
class Field:
    """config.json key `theirs` <-> ModelSpec field `ours`. `default`: the value transformers assumes when
    the key is absent (a callable of the config dict for derived defaults); `values`: ours -> theirs
    where the spellings differ (gelu_tanh <-> gelu_new)."""
    theirs: str
    ours: str
    default: Any = REQUIRED
    values: Mapping[Any, Any] | None = None

    def read(self, c: dict, out: dict, refuse: Callable[[str], None]) -> None:
        v = c.get(self.theirs)
        if v is None:
            if self.default is REQUIRED:
                raise KeyError(self.theirs)
            v = self.default(c) if callable(self.default) else self.default
        if self.values is not None:
            back = {t: o for o, t in self.values.items()}
            if v not in back:
                refuse(f"{self.theirs} {v!r} is not one of {', '.join(map(repr, back))}")
            v = back[v]
        out[self.ours] = v

    def write(self, spec, out: dict) -> None:
        v = getattr(spec, self.ours)
        out[self.theirs] = self.values[v] if self.values is not None else v


@dataclass(frozen=True)
class Const:
    """A config.json key whose value the family fixes: written as `value` (unless OMIT); on reading, a
    value outside `accept` (default: just `value`; an absent key or null is always accepted) is refused,
    `why` saying what it would have meant."""
    theirs: str
    value: Any
    why: str = ""
    accept: Callable[[Any], bool] | None = None

    def read(self, c: dict, out: dict, refuse: Callable[[str], None]) -> None:
        v = c.get(self.theirs)
        ok = self.accept(v) if self.accept is not None else v == self.value
        if v is not None and not ok:
            shown = f"{self.theirs}={json.dumps(v)}" if isinstance(v, bool) else f"{self.theirs} {v!r:.60}"
            refuse(f"{shown} is not supported" + (f" ({self.why})" if self.why else ""))

    def write(self, spec, out: dict) -> None:
        if self.value is not OMIT:
            out[self.theirs] = self.value


@dataclass(frozen=True)
class Derived:
    """A config.json key computed both ways by functions: `read(c, out, refuse)` sets ModelSpec fields from the
    config dict, `write(spec)` gives the key's value (OMIT: not written)."""
    theirs: str
    reader: Callable[[dict, dict, Callable[[str], None]], None]
    writer: Callable[[Any], Any]

    def read(self, c: dict, out: dict, refuse: Callable[[str], None]) -> None:
        self.reader(c, out, refuse)

    def write(self, spec, out: dict) -> None:
        v = self.writer(spec)
        if v is not OMIT:
            out[self.theirs] = v


def anything(v) -> bool:
    return True


LLAMA3_DEFAULTS = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
ROPE_FIELDS = {"factor": "rope_scaling_factor", "low_freq_factor": "rope_low_freq_factor",
               "high_freq_factor": "rope_high_freq_factor",
               "original_max_position_embeddings": "rope_original_max_position_embeddings"}
# YaRN's parameters (transformers' defaults where absent; DeepSeek-V3's config gives them all)
YARN_DEFAULTS = {"factor": 1.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                 "mscale": 1.0, "mscale_all_dim": 0.0}
YARN_FIELDS = {"factor": "rope_scaling_factor",
               "original_max_position_embeddings": "rope_original_max_position_embeddings",
               "beta_fast": "rope_beta_fast", "beta_slow": "rope_beta_slow", "mscale": "rope_mscale",
               "mscale_all_dim": "rope_mscale_all_dim"}


@dataclass(frozen=True)
class Rope:
    """RoPE base and scaling: transformers 5's `rope_parameters` {rope_type, rope_theta, ...}, or the older
    top-level `rope_theta` + `rope_scaling`. Types other than default, llama3 and yarn (a family's features say
    which it allows) are refused, and a partial
    rotary factor unless `partial` (megatron-core's rotary_percent: the first dims of each head)."""
    default_theta: float = 10000.0
    partial: bool = False
    partial_default: float = 1.0  # transformers' partial_rotary_factor where config.json gives none (GLM-4.5: 0.5)
    truncate: bool = False  # YaRN's `truncate` may be false (ModelSpec.rope_truncate; written where it may)
    default_params: Mapping[str, Any] | None = None  # transformers' rope_parameters where config.json gives none

    def read(self, c: dict, out: dict, refuse: Callable[[str], None]) -> None:
        params = c.get("rope_parameters") or {}
        scaling = c.get("rope_scaling") or {}
        if not params and not scaling and self.default_params is not None:
            params = dict(self.default_params)
        if not isinstance(params, dict) or not isinstance(scaling, dict):
            raise TypeError("rope_parameters / rope_scaling is not an object")
        merged = {**scaling, **params}
        kind = merged.get("rope_type", merged.get("type", "default"))
        if kind not in ("default", "llama3", "yarn"):
            refuse(f"rope scaling {kind} is not supported (only default, llama3 and yarn)")
        truncate = merged.get("truncate", True)
        if kind == "yarn" and (truncate not in (True, False) or (not truncate and not self.truncate)
                               or merged.get("attention_factor") is not None):
            refuse(f"yarn with truncate {json.dumps(truncate)} or an explicit attention_factor is not supported for "
                   f"this family (its megatron-core YaRN rounds the correction range and derives the factor from "
                   f"mscale and mscale_all_dim)")
        if kind == "yarn" and self.truncate:
            out["rope_truncate"] = truncate
        partial = merged.get("partial_rotary_factor", c.get("partial_rotary_factor", self.partial_default))
        if partial not in (None, 1, 1.0) and not self.partial:
            refuse(f"partial_rotary_factor {partial!r} is not supported (rotary embeddings on the whole head only)")
        if self.partial:
            out["rotary_percent"] = float(partial if partial is not None else 1.0)
        theta = merged.get("rope_theta", c.get("rope_theta", self.default_theta))
        out["rotary_base"] = float(theta)
        if kind == "llama3":
            out["rope_scaling"] = "llama3"
            for theirs, ours in ROPE_FIELDS.items():
                out[ours] = type(LLAMA3_DEFAULTS[theirs])(merged.get(theirs, LLAMA3_DEFAULTS[theirs]))
        if kind == "yarn":
            self._read_yarn(c, merged, out, refuse)

    @staticmethod
    def _read_yarn(c: dict, merged: dict, out: dict, refuse: Callable[[str], None]) -> None:
        """YaRN as transformers reads it: the original context from rope_parameters, else the top level, else
        max_position_embeddings; cos / sin scaled by mscale(factor, mscale) / mscale(factor, mscale_all_dim) only
        where both are given (else mscale(factor): megatron-core's ratio with mscale 1, mscale_all_dim 0)."""
        if merged.get("factor") is None:
            refuse("yarn without a factor")
        out["rope_scaling"] = "yarn"
        context = c.get("original_max_position_embeddings", c.get("max_position_embeddings"))
        given = {"original_max_position_embeddings": merged.get("original_max_position_embeddings", context)}
        for theirs, ours in YARN_FIELDS.items():
            value = merged.get(theirs) if theirs not in given else given[theirs]
            out[ours] = type(YARN_DEFAULTS[theirs])(YARN_DEFAULTS[theirs] if value is None else value)
        if not out["rope_mscale_all_dim"]:
            out["rope_mscale"], out["rope_mscale_all_dim"] = 1.0, 0.0
        elif not out["rope_mscale"]:
            refuse(f"yarn with mscale {merged.get('mscale')!r} and mscale_all_dim {out['rope_mscale_all_dim']} "
                   f"(transformers then scales by mscale(factor) alone, megatron-core by their ratio)")

    def write(self, spec, out: dict) -> None:
        params = {"rope_type": spec.rope_scaling or "default", "rope_theta": float(spec.rotary_base)}
        if spec.rope_scaling == "llama3":
            params.update({theirs: getattr(spec, ours) for theirs, ours in ROPE_FIELDS.items()})
        if spec.rope_scaling == "yarn":
            params.update({theirs: getattr(spec, ours) for theirs, ours in YARN_FIELDS.items()})
            if self.truncate:
                params["truncate"] = spec.rope_truncate
        if self.partial:
            params["partial_rotary_factor"] = spec.rotary_percent
        out["rope_parameters"] = params
        out["rope_theta"] = float(spec.rotary_base)


@dataclass(frozen=True)
class Family:
    name: str  # ModelSpec.architecture
    model_type: str  # config.json's model_type
    hf_class: str  # config.json's architectures[0]
    names: tuple[Name, ...]
    # ModelSpec feature -> the values the family allows, its default first; a feature not named: the feature's own
    features: Mapping[str, tuple] = field(default_factory=dict)
    config: tuple = ()
    check: Callable | None = None  # extra constraints on a ModelSpec (raises ConfigError)
    extras: Mapping[str, Any] = field(default_factory=dict)  # written into config.json as is
    moe: bool = False  # a mixture-of-experts family: every layer's MLP is megatron-core's MoE layer
    shared_experts: bool = False  # its MoE layers also have a shared expert (megatron-core's SharedExpertMLP)
    grouped_routing: bool = False  # its router may limit the choice to the best groups and scale the chosen weights
    partial_rotary: bool = False  # its rotary embedding may turn only the first part of each head (rotary_percent)
    dense_first: bool = False  # an MoE family whose first layers may be dense (first_k_dense_replace)
    fp8_blocks: bool = False  # its HF weights may be block-scaled FP8 (DeepSeek-V3's layout; fp8.fp8_quantized)
    mxfp4: tuple[str, ...] = ()  # the endings of the HF names its checkpoints may hold in MXFP4
    # (ckpt_tools.model.mxfp4)
    mxfp4_unconverted: tuple[str, ...] = ()  # its MXFP4 quantization_config's modules_to_not_convert
    windows: bool = False  # its layers may attend by a sliding window (ModelSpec.sliding_window)
    linear_attention: bool = False  # its layers' attention may be a gated DeltaNet ('G' in the layer pattern)
    hybrid: bool = False  # a layer is one block by its layer pattern (megatron-core's HybridModel): Mamba-2, attention
    # or an MLP ('M', '*', '-'), its norm the block's own
    mtp_layers: bool = False  # its HF weights may hold multi-token prediction layers after the decoder layers
    # (megatron-core key, HF name with `{i}` the MTP layer's number) of each tensor an HF MTP layer holds a copy of
    mtp_copies: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        unknown = set(self.features) - set(FEATURE_NAMES)
        if unknown:
            raise ValueError(f"family {self.name}: {sorted(unknown)} are no features (ckpt_tools.model.features.NAMES)")

    def allowed(self, feature: str) -> tuple:
        """The values of `feature` the family allows, its default first."""
        return self.features[feature] if feature in self.features else FEATURES[feature].allowed

    def default(self, feature: str):
        return self.allowed(feature)[0]

    def computed_keys(self) -> set[str]:
        """The config.json keys that follow from the weights (a merge writes ours, never a carried original's)."""
        keys = {"architectures", "model_type", "dtype"}
        for f in self.config:
            if isinstance(f, (Field, Derived)):
                keys.add(f.theirs)
            elif isinstance(f, Rope):
                keys |= {"rope_parameters", "rope_theta"}
        return keys

    def hf_config(self, spec, dtype: str, bos: int | None, eos: int | None) -> dict:
        out = {"architectures": [self.hf_class], "model_type": self.model_type}
        for f in self.config:
            f.write(spec, out)
        out.update({"bos_token_id": bos, "eos_token_id": eos, "dtype": dtype, "use_cache": True, **self.extras})
        return out

    def spec_fields(self, c: dict, refuse: Callable[[str], None]) -> dict:
        """config.json -> ModelSpec keyword arguments (architecture included)."""
        out: dict = {"architecture": self.name}
        for f in self.config:
            f.read(c, out, refuse)
        return out


_LAYER, _MTP = "decoder.layers.{i}.", "mtp.layers.{m}."


def with_mtp(names: tuple[Name, ...], hf_layer: str, norms: tuple[str, str, str]) -> tuple[Name, ...]:
    """A family's rows and its multi-token prediction layers' (megatron-core's `mtp.layers.<m>.`): the enorm, hnorm
    and final norm (HF names `norms`, after `hf_layer`, a layer's HF prefix with `{i}`), eh_proj, and a transformer
    layer whose rows are the decoder layer's; HF numbers an MTP layer after the decoder's
    (ckpt_tools.model.hf.hf_layer)."""
    inner = tuple(Name(_MTP + "transformer_layer." + n.key[len(_LAYER):], n.kind, n.hf)
                  for n in names if n.key.startswith(_LAYER))
    enorm, hnorm, final = norms
    return names + (Name(_MTP + "enorm.weight", SAME, (hf_layer + enorm,)),
                    Name(_MTP + "hnorm.weight", SAME, (hf_layer + hnorm,)),
                    Name(_MTP + "eh_proj.weight", SAME, (hf_layer + "eh_proj.weight",)),
                    Name(_MTP + "final_layernorm.weight", SAME, (hf_layer + final,))) + inner


def heads_dim(c: dict) -> int:
    return c["hidden_size"] // c["num_attention_heads"]


def kv_heads(c: dict) -> int:
    return c["num_attention_heads"]


def head_dim_unless_null(absent: int) -> Callable[[dict], int]:
    """head_dim's default in configs that assume `absent` where the key is missing and hidden / heads where it is null
    (transformers' SeedOssConfig, Ernie4_5Config; GlmConfig keeps a null as null, which its model cannot be built
    from: read as hidden / heads here too)."""
    return lambda c: heads_dim(c) if "head_dim" in c else absent


def kv_heads_unless_null(absent: int) -> Callable[[dict], int]:
    """num_key_value_heads' default in configs that assume `absent` where the key is missing and every head its own
    where it is null (GlmConfig keeps a null as null: read as every head its own here too)."""
    return lambda c: kv_heads(c) if "num_key_value_heads" in c else absent


def _families() -> tuple[Family, ...]:
    from ckpt_tools.model.families import (deepseek_v3, ernie4_5, gemma, glm, glm4_moe, gpt2, gpt_oss, llama,
                                           mistral, mixtral, nemotron_h, olmoe, phi3, qwen2, qwen2_moe, qwen3,
                                           qwen3_moe, qwen3_next, seed_oss)
    return (llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, phi3.FAMILY, gemma.FAMILY, gpt2.FAMILY,
            mixtral.FAMILY, qwen3_moe.FAMILY, olmoe.FAMILY, qwen2_moe.FAMILY, glm4_moe.FAMILY,
            deepseek_v3.FAMILY, gpt_oss.FAMILY, nemotron_h.FAMILY, qwen3_next.FAMILY, seed_oss.FAMILY, ernie4_5.FAMILY,
            glm.FAMILY)


_REGISTRY: dict[str, Family] = {}


def all_families() -> tuple[Family, ...]:
    if not _REGISTRY:
        _REGISTRY.update({f.name: f for f in _families()})
    return tuple(_REGISTRY.values())


def get(name: str) -> Family:
    all_families()
    if name not in _REGISTRY:
        raise ConfigError(f"unknown architecture {name!r}: expected one of {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def names() -> tuple[str, ...]:
    return tuple(f.name for f in all_families())


def by_model_type(model_type) -> Family | None:
    return next((f for f in all_families() if f.model_type == model_type), None)


def for_features(found: Mapping[str, Any], moe: bool = False, hybrid: bool = False,
                 linear: bool = False) -> tuple[Family | None, dict[str, dict[str, tuple]]]:
    """The first family (dense, or with experts when `moe`; a hybrid one when `hybrid`; one with gated DeltaNet layers
    when `linear`) whose features allow every value in `found` (Megatron-LM arguments read as features) and, when none
    does, for each family what does not fit: {feature: (found, allowed)}."""
    misfits = {}
    for fam in (f for f in all_families() if f.moe == moe and f.hybrid == hybrid and f.linear_attention == linear):
        bad = {k: (v, fam.allowed(k)) for k, v in found.items() if v not in fam.allowed(k)}
        if not bad:
            return fam, {}
        misfits[fam.name] = bad
    return None, misfits
