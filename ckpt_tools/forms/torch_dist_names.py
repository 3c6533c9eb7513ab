"""How megatron-core's sharded state dict names a layout-table key in Megatron-LM's torch_dist and torch_dcp forms:
GPTModel's layers stacked on a leading layer axis (or per layer in a non-uniform stack), an MoE layer's experts on a
global expert axis, HybridModel's one key per layer index, Transformer Engine's fused norm names, MLA's local names,
and the tensors megatron-core saves in parts (Mamba's and gated DeltaNet's in_proj and convolution). The reader
(forms/torch_dist.py) and the writer (forms/megatron_write.py) both ask here; torch_dist re-exports these names."""
from __future__ import annotations

import re

from ckpt_tools.errors import FormatError
from ckpt_tools.model import hybrid, layout, names

_LAYERS = "decoder.layers."


Lead = tuple[int, ...]  # a tensor's indices on the stacked leading axes: (layer,) or (layer, expert)
_EXPERTS = "mlp.experts.local_experts."


def _gdn(spec, i: int | None) -> bool:
    """Whether global layer i's attention is a gated DeltaNet (its input norm named as Transformer Engine fuses it)."""
    return spec is not None and i is not None and spec.linear_num_key_heads is not None and \
        spec.layer_symbols(i)[0] == "G"


def stacked_key(key: str, spec=None) -> tuple[str, Lead | None]:
    """A global layout-table key -> (its key in megatron-core's sharded state dict, its indices on the stacked
    leading axes, or None when not a layer's). The one place that knows the naming; the writer uses it too."""
    i = layout.layer_index(key)
    if i is None:
        return key, None
    name = key[len(f"{_LAYERS}{i}."):]
    e = layout.expert_index(key)
    if e is not None:  # SequentialMLP: local_experts.<e>.<rest> -> experts.<rest> on a second (global expert) axis
        return _LAYERS + _experts(name, e), (i, e)
    return _LAYERS + names.to_te(name, _gdn(spec, i)), (i,)


def _experts(name: str, e: int) -> str:
    """A layer's expert tensor name (`mlp.experts.local_experts.<e>.<rest>`) as megatron-core's sharded state dict
    names it, the expert on a leading global axis: `mlp.experts.experts.<rest>`."""
    return "mlp.experts.experts." + name[len(f"{_EXPERTS}{e}."):]


def lead_shape(spec, lead: Lead | None) -> tuple[int, ...]:
    """The sizes of the stacked leading axes of a tensor with indices `lead`."""
    return () if lead is None else (spec.num_layers, spec.num_moe_experts)[:len(lead)]


Placed = tuple[tuple[int, int], ...]  # a stored tensor's (index, size) on each stacked leading axis; () for none


def dcp_candidates(key: str, spec, prefix: str = "model.") -> list[tuple[str, Placed]]:
    """The names a global layout-table key may have in Megatron-LM's torch_dcp form: the model's own state dict under
    `model.` (TP = PP = 1: every layer and expert by its global index), the local spec's names or Transformer
    Engine's (TEGroupedMLP's experts: `mlp.experts.linear_fc1.weight<e>`); in fsdp_dtensor the same under
    `model.module.` (`prefix`)."""
    i = layout.layer_index(key)
    where = f"{_LAYERS}{i}." if i is not None else _MTP_LAYER.match(key).group(1) if _MTP_LAYER.match(key) else None
    if where is None:
        return [(prefix + key, ())]
    name = key[len(where):]
    if layout.expert_index(key) is not None:
        return [(prefix + key, ()), (prefix + names.to_te_grouped(key), ())]
    return [(prefix + where + n, ()) for n in dict.fromkeys((name, names.to_te(name)))]


DCP_MODEL = "model."  # torch_dcp: the model's state dict under this key
DCP_COMMON = ("args", "iteration", "checkpoint_version")  # torch_dcp: its common state, each a bytes entry


def stored_candidates(key: str, spec, by_pattern: bool = False) -> list[tuple[str, Placed]]:
    """The names a global layout-table key may have in megatron-core's sharded state dict, each with its place on
    the stacked leading axes. GPTModel: stacked layers (`decoder.layers.<name>` [L, ...]), or per layer in a
    non-uniform stack; Transformer Engine's fused norm names, or an unfused norm's own. HybridModel (`by_pattern`):
    one key per layer index (hybrid.py), an MoE layer's experts on a leading global expert axis."""
    if by_pattern:
        key = hybrid.to_hybrid(key, spec.hybrid)
        j = layout.layer_index(key)
        if j is None:
            return [(key, ())]
        name = key[len(f"{_LAYERS}{j}."):]
        e = layout.expert_index(key)
        if e is not None:
            return [(f"{_LAYERS}{j}.{_experts(name, e)}", ((e, spec.num_moe_experts),))]
        fused = names.to_te(name, not spec.hybrid and j % 2 == 0 and _gdn(spec, j // 2))
        if spec.moe_layer(j if spec.hybrid else j // 2) and name.startswith("pre_mlp_layernorm."):  # an MoE layer's norm: its own module
            return [(f"{_LAYERS}{j}.{name}", ()), (f"{_LAYERS}{j}.{fused}", ())]
        return [(f"{_LAYERS}{j}.{fused}", ())] + ([(f"{_LAYERS}{j}.{name}", ())] if fused != name else [])
    i = layout.layer_index(key)
    if i is None:
        return _mtp_candidates(key, spec) if layout.mtp_index(key) is not None else [(key, ())]
    stacked, lead = stacked_key(key, spec)
    placed = tuple(zip(lead, lead_shape(spec, lead)))
    name, e = key[len(f"{_LAYERS}{i}."):], layout.expert_index(key)
    local = _experts(name, e) if e is not None else name
    fused = stacked[len(_LAYERS):]
    # megatron-core's own choice first (what the writer writes): the local MLA spec declares no Transformer Engine
    # map, so it saves local names; a non-uniform stack (moe_layer_freq a list) one key per layer, its experts on a
    # leading expert axis
    mine = local if spec.multi_latent_attention else fused
    candidates = [(f"{_LAYERS}{i}.{mine}", placed[1:])] if spec.layer_pattern is not None else []
    candidates.append((_LAYERS + mine, placed))
    others = (fused, local) + ((names.to_mla_te(local),) if spec.multi_latent_attention else ())
    for n in dict.fromkeys(others):  # the other spec's names, in either stacking
        for c in ((_LAYERS + n, placed), (f"{_LAYERS}{i}.{n}", placed[1:])):
            if c not in candidates:
                candidates.append(c)
    return candidates


_MTP_LAYER = re.compile(r"^(mtp\.layers\.\d+\.transformer_layer\.)(.+)$")
def part_names(key: str, spec) -> tuple[str, ...] | None:
    """The names of the stored parts of a key that megatron-core saves in parts (its `_split_tensor_factory`:
    `<key>.<part>`, each split over TP on dim 0; the layout table's row names them), None: saved whole."""
    return layout.find_rule(key, spec, None).part_names


def part_of(key: str, spec, full: tuple[int, ...], dim: int, start: int, stop: int) -> tuple[str, int, int]:
    """(the stored part's name, start, size in it) of rows [start, stop) on dim `dim` of a key's full tensor, which a
    piece never crosses ('' for a key saved whole)."""
    names = part_names(key, spec)
    if names is None:
        return "", start, full[dim]
    at = 0
    for name, size in zip(names, layout.find_rule(key, spec, None).part_sizes(spec, full[dim])):
        if at <= start and stop <= at + size:
            return name, start - at, size
        at += size
    raise FormatError(f"{key}: rows {start}-{stop} cross its parts {names}: not a piece megatron-core saves")


def _mtp_candidates(key: str, spec) -> list[tuple[str, Placed]]:
    """A multi-token prediction layer's key in megatron-core's sharded state dict: its own name, the transformer
    layer's not stacked on a layer axis (the layer's names as a decoder layer's: local under the MLA spec, Transformer
    Engine's fused norms otherwise, either read), an MoE layer's experts on a leading global expert axis."""
    m = _MTP_LAYER.match(key)
    if m is None:
        return [(key, ())]
    prefix, name = m.groups()
    e = layout.expert_index(key)
    if e is not None:
        return [(prefix + _experts(name, e), ((e, spec.num_moe_experts),))]
    fused = names.to_te(name)
    mine, other = (name, fused) if spec.multi_latent_attention else (fused, name)
    return [(prefix + n, ()) for n in dict.fromkeys((mine, other) + (
        (names.to_mla_te(name),) if spec.multi_latent_attention else ()))]


_MLA_NORM = re.compile(r"(?:decoder\.layers\.(?:(\d+)\.)?|^mtp\.layers\.\d+\.transformer_layer\.)"
                       r"(self_attention\.(?:q|kv)_layernorm\.|pre_mlp_layernorm\.)")


_MOE_NORM = re.compile(r"(?:decoder\.layers\.(?:(\d+)\.)?|^mtp\.layers\.\d+\.transformer_layer\.)"
                       r"(mlp\.linear_fc1\.layer_norm_)(weight|bias)$")


def te_alias(fqn: str, spec, by_pattern: bool = False) -> str | None:
    """The name megatron-core's Transformer Engine spec loads a norm by, where the writer stores it under the local
    spec's: under the MLA spec (which declares no map) the latent norms fused into the up projections, a dense layer's
    pre-MLP norm into its fc1; an MoE layer's pre-MLP norm, which the local GPT spec saves as fc1's fused norm and
    Transformer Engine's spec keeps as a module of its own (`pre_mlp_layernorm`). Written as a second index entry over
    the same bytes, so that either spec loads the checkpoint. None for any other tensor, and for a HybridModel's keys
    (`by_pattern`: its MoE layer's norm is written under its own name already)."""
    if by_pattern:
        return None
    if not spec.multi_latent_attention:
        m = _MOE_NORM.search(fqn) if spec.is_moe else None
        if m is None:
            return None
        i = m.group(1)
        moe = layout.MOE in layout.mtp_blocks(spec) if fqn.startswith("mtp.") or ".mtp.layers." in fqn else \
            spec.moe_layer(int(i)) if i is not None else all(spec.moe_layer(j) for j in range(spec.num_layers))
        return fqn[:m.start(2)] + "pre_mlp_layernorm." + m.group(3) if moe else None
    m = _MLA_NORM.search(fqn)
    if m is None:
        return None
    part, i = m.group(2), m.group(1)
    moe = layout.MOE in layout.mtp_blocks(spec) if fqn.startswith("mtp.") else \
        spec.moe_layer(int(i)) if i is not None else spec.is_moe
    if part == "pre_mlp_layernorm." and moe:
        return None
    return fqn[:m.start(2)] + names.MLA_TE_NAMES[part] + fqn[m.end(2):]


# The norms Transformer Engine's specs build as modules of their own (TENorm, which saves an `_extra_state`), by the
# name they are stored under: the final norm (GPTModel's, HybridModel's, an MTP depth's), an MoE layer's pre-MLP norm,
# multi-latent attention's input norm, grouped-query attention's q/k norms, MTP's embedding and hidden norms, a gated
# DeltaNet's output norm. A norm fused into the linear after it (`layer_norm_weight`), multi-latent attention's latent
# norms (fused into its up projections) and Mamba's gated norm have none.
_TE_NORM = re.compile(r"(?:final_layernorm|final_norm|pre_mlp_layernorm|input_layernorm|q_layernorm|k_layernorm|enorm|"
                      r"hnorm|out_norm)\.weight$")


def te_norm_extra(fqn: str, spec) -> str | None:
    """The `_extra_state` entry of the Transformer Engine norm stored as `fqn` (its weight), or None: megatron-core's
    load of a Transformer Engine model asks for it, and fails where it is missing."""
    if _TE_NORM.search(fqn) is None or (spec.multi_latent_attention and ".q_layernorm." in fqn):
        return None
    return fqn[:-len("weight")] + "_extra_state"

