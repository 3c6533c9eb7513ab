"""Other names of the layout table's keys, as data: what a Megatron-LM checkpoint may call a tensor.

megatron-core's local spec names a layer's norms `input_layernorm` / `pre_mlp_layernorm`; Transformer Engine
fuses them into the following linear (`self_attention.linear_qkv.layer_norm_weight`, `mlp.linear_fc1.
layer_norm_weight`). torch_dist checkpoints always use the Transformer Engine names: megatron-core's local spec
declares this very map (`sharded_state_dict_keys_map`) so that both specs save one form. A legacy `torch`
checkpoint has the names of the spec it was trained with.

Megatron-LM's legacy models (`--use-legacy-models`, megatron/legacy/model, removed after core_v0.16.1) save a
nested state dict, `model['language_model']['encoder']['layers.<i>.self_attention.query_key_value.weight']`; flattened
with dots, LEGACY maps its parts to the table's. Older names (`transformer`, `attention`, `*_layernorm`) are
listed too: Megatron-LM's own loader still accepts them. The tied head's copy on the last pipeline stage is
`word_embeddings_for_head`. Tensors keep their layout: QKV is megatron-core's grouped [ng, np/ng + 2, hn] per rank
(checkpoint_version 2 and 3), SwiGLU's fc1 [gate_r; up_r] per rank.
"""
from __future__ import annotations

import re

TE_NAMES = {  # local spec name (within a layer) -> Transformer Engine name
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}


# Multi-latent attention under Transformer Engine's spec: the latent norms fused into the up projections (its
# input_layernorm stays a module of its own); megatron-core's local MLA spec declares no map, so it saves local names.
MLA_TE_NAMES = {
    "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
    "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}


def _renamed(name: str, names: dict[str, str]) -> str:
    """`name` with the first of `names`' parts it holds (at its start or after a dot) replaced by its other name."""
    for old, new in names.items():
        if name.startswith(old) or f".{old}" in name:
            return name.replace(old, new, 1)
    return name


def to_mla_te(name: str) -> str:
    """A layer's key of an MLA model (or its part after `decoder.layers.<i>.`) in Transformer Engine's naming."""
    return _renamed(name, MLA_TE_NAMES)


def is_mla_te(name: str) -> bool:
    """A key only Transformer Engine's MLA spec has (a latent norm fused into an up projection)."""
    return any(te in name for local, te in MLA_TE_NAMES.items() if "_layernorm" in local and "pre_mlp" not in local)


# A Mamba layer's own norm (megatron-core's MambaLayer `norm`) as Transformer Engine fuses it into the mixer's in_proj;
# only at the layer's top (the mixer's gated `mixer.norm` keeps its name)
_MAMBA_NORM = re.compile(r"^((?:decoder\.layers\.\d+\.)?)norm\.")
_MAMBA_NORM_TE = re.compile(r"^((?:decoder\.layers\.\d+\.)?)mixer\.in_proj\.layer_norm_")


_MAMBA_CONV = re.compile(r"\.mixer\.conv1d_(weight|bias)$")


def from_mamba(name: str) -> str:
    """megatron-core 0.19's MambaMixer holds its convolution as parameters of its own (`mixer.conv1d_weight`), which its
    legacy state dict names so; the layout table's name (and torch_dist's, and 0.16's) is `mixer.conv1d.weight`."""
    return _MAMBA_CONV.sub(r".mixer.conv1d.\1", name)


# A gated DeltaNet layer's input norm, which Transformer Engine fuses into its in_proj
GDN_TE_NAMES = {"input_layernorm.": "self_attention.in_proj.layer_norm_"}


def to_te(name: str, gdn: bool = False) -> str:
    """A layer's key (or its part after `decoder.layers.<i>.`) in Transformer Engine's naming; `gdn`: of a gated
    DeltaNet layer (its input norm fused into in_proj, not linear_qkv)."""
    if _MAMBA_NORM.match(name):
        return _MAMBA_NORM.sub(r"\1mixer.in_proj.layer_norm_", name, count=1)
    return _renamed(name, {**TE_NAMES, **GDN_TE_NAMES} if gdn else TE_NAMES)


def from_te(name: str) -> str:
    """The inverse of to_te: a Transformer Engine name -> the layout table's (local spec) name."""
    if _MAMBA_NORM_TE.match(name):
        return _MAMBA_NORM_TE.sub(r"\1norm.", name, count=1)
    return _renamed(name, {te: local for names in (TE_NAMES, GDN_TE_NAMES) for local, te in names.items()})


# Transformer Engine's GroupedLinear (TEGroupedMLP, --moe-grouped-gemm) holds a layer's local experts as the
# weights of one module: `mlp.experts.linear_fc1.weight<e>`, SequentialMLP's `mlp.experts.local_experts.<e>.
# linear_fc1.weight`, each expert's tensor the same; one `_extra_state` (Transformer Engine's FP8 metadata) for all.
_TE_GROUPED = re.compile(r"^(.*\.mlp\.experts\.)(linear_fc[12])\.(weight|bias)(\d+)$")
_TE_GROUPED_EXTRA = re.compile(r"^.*\.mlp\.experts\.linear_fc[12]\._extra_state$")


_LOCAL_EXPERT = re.compile(r"^(.*\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")


def to_te_grouped(name: str) -> str:
    """The table's (SequentialMLP's) expert key -> TEGroupedMLP's (`mlp.experts.linear_fc1.weight<e>`); any other key
    unchanged (the inverse of from_te_grouped)."""
    m = _LOCAL_EXPERT.match(name)
    return f"{m.group(1)}{m.group(3)}.{m.group(4)}{m.group(2)}" if m else name


# Transformer Engine's modules that hold no weights of the table's own yet save an `_extra_state` (FP8 metadata): its
# core attention (DotProductAttention) and its norms of their own (TENorm: the final norm, q/k norms, an MoE layer's
# pre-MLP norm). A legacy file of a Transformer Engine run holds them; they are not carried (megatron-core's local spec
# has none, and a Transformer Engine model loads None as no metadata).
_TE_MODULE_EXTRA = re.compile(r"(?:\.core_attention|norm)\._extra_state$")


def te_module_extra(name: str) -> bool:
    """Whether `name` is the extra state of a Transformer Engine module with no weights in the table."""
    return _TE_MODULE_EXTRA.search(name) is not None


def from_te_grouped(name: str) -> str | None:
    """A TEGroupedMLP expert's key -> the table's (SequentialMLP's), any other key unchanged; None for the grouped
    linears' shared extra state, which holds no weights."""
    if _TE_GROUPED_EXTRA.match(name):
        return None
    m = _TE_GROUPED.match(name)
    return f"{m.group(1)}local_experts.{m.group(4)}.{m.group(2)}.{m.group(3)}" if m else name


LEGACY_PREFIXES = {  # flattened legacy key prefix -> the table's (first match wins)
    "language_model.embedding.": "embedding.",
    "language_model.encoder.final_norm.": "decoder.final_layernorm.",
    "language_model.encoder.final_layernorm.": "decoder.final_layernorm.",
    "language_model.transformer.final_layernorm.": "decoder.final_layernorm.",
    "language_model.output_layer.": "output_layer.",
    "word_embeddings_for_head.": "output_layer.",
}
LEGACY_LAYER = {  # a layer's legacy name (after `layers.<i>.`) -> the table's
    "input_norm.": "input_layernorm.",
    "input_layernorm.": "input_layernorm.",
    "self_attention.query_key_value.": "self_attention.linear_qkv.",
    "attention.query_key_value.": "self_attention.linear_qkv.",
    "self_attention.dense.": "self_attention.linear_proj.",
    "attention.dense.": "self_attention.linear_proj.",
    "post_attention_norm.": "pre_mlp_layernorm.",
    "post_attention_layernorm.": "pre_mlp_layernorm.",
    "mlp.dense_h_to_4h.": "mlp.linear_fc1.",
    "mlp.dense_4h_to_h.": "mlp.linear_fc2.",
}
_LEGACY_LAYER = re.compile(r"^language_model\.(?:encoder|transformer)\.layers\.(\d+)\.(.*)$")


def is_legacy(model: dict) -> bool:
    """A legacy model's state dict (nested or already flattened)."""
    return "language_model" in model or any(str(k).startswith("language_model.") for k in model)


def flatten(tree: dict, prefix: str = "") -> dict:
    """Nested state dicts -> dotted keys (what PyTorch's own state_dict would have named them)."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def from_legacy(key: str) -> str:
    """A flattened legacy key -> the layout table's (unknown keys come back unchanged, to be reported)."""
    m = _LEGACY_LAYER.match(key)
    if m:
        for old, new in LEGACY_LAYER.items():
            if m.group(2).startswith(old):
                return f"decoder.layers.{m.group(1)}.{new}{m.group(2)[len(old):]}"
        return key
    for old, new in LEGACY_PREFIXES.items():
        if key.startswith(old):
            return new + key[len(old):]
    return key
