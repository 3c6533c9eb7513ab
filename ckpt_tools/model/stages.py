"""The pipeline stages of the layout table (ckpt_tools.model.layout): how many layers each stage holds, which keys a
stage (and an expert-parallel rank) holds in megatron-core's state-dict order, stage-local and global, and the copies of
aliased rows (a tied embedding) a stage keeps. The rows themselves, their splits and shapes, are layout's;
ckpt_tools.model.layout re-exports these names."""
from __future__ import annotations

import math
from collections.abc import Container, Sequence

from ckpt_tools.errors import ConfigError, LayoutError
from ckpt_tools.model.layout import (ALIASES, MTP_LAYER, aliases, holds_weights, layer_blocks, mtp_blocks, rules_for,
                                     shard_shape)
from ckpt_tools.model.rules import FIRST, LAST, LAYER, MOE, MTP_STAGE, SHARED, Rule, in_blocks
from ckpt_tools.model.spec import ModelSpec

def layers_per_stage(num_layers: int, pp_size: int, explicit: Sequence[int] | None = None) -> list[int]:
    """Layers on each PP stage: an explicit (possibly uneven) split, or Megatron's even split."""
    if explicit is not None:
        counts = [int(n) for n in explicit]
        if len(counts) != pp_size or sum(counts) != num_layers or min(counts) < 1:
            raise ConfigError(
                f"layers per stage {','.join(map(str, counts))} do not fit {num_layers} layers on {pp_size} "
                f"stages: give {pp_size} positive numbers that sum to {num_layers}")
        return counts
    if pp_size < 1 or pp_size > num_layers:
        raise ConfigError(f"PP {pp_size} needs at least one layer per stage but the model has {num_layers} "
                          f"layers: choose PP <= {num_layers}")
    if num_layers % pp_size:
        raise ConfigError(f"num_layers {num_layers} is not divisible by PP {pp_size}: choose a PP that divides "
                          f"it or give an explicit layers-per-stage split")
    return [num_layers // pp_size] * pp_size


def tied_copies(spec: ModelSpec, pp_size: int, pp_rank: int) -> set[str]:
    """The aliased rows and their originals a stage holds when PP > 1 (a tied embedding: the first stage's
    embedding, the last stage's output layer): megatron-core keeps each in a grad-buffer bucket of its own. Empty
    where the model has no alias (untied) or PP = 1."""
    pairs = aliases(spec)
    if pp_size == 1 or not pairs:
        return set()
    stage = {r.name: r.stage for r in rules_for(spec, pp_size)}
    held = {FIRST: pp_rank == 0, LAST: pp_rank == pp_size - 1}
    return {k for k in set(pairs) | set(pairs.values()) if held.get(stage[k], False)}


def source_key(key: str, present: Container[str]) -> str:
    """The tensor that holds `key` in a checkpoint holding the keys `present`: itself, or, for an aliased row's copy
    that a PP > 1 layout keeps but a PP = 1 checkpoint lacks (the tied output layer), the tensor it copies."""
    if key in ALIASES and key not in present:
        return ALIASES[key]
    return key


def local_experts(spec: ModelSpec, ep_rank: int | None, ep_size: int = 1) -> list[int]:
    """The global indices of the experts an EP rank holds, in local order (megatron-core deals them out in
    contiguous runs: EP rank r holds experts r*E/EP ... (r+1)*E/EP - 1); every expert where there is no EP axis."""
    if not spec.is_moe:
        return []
    n = spec.num_moe_experts
    if ep_rank is None:
        return list(range(n))
    if n % ep_size:
        raise LayoutError(f"num_moe_experts {n} is not divisible by EP {ep_size}: choose an EP that divides it")
    per = n // ep_size
    return list(range(ep_rank * per, (ep_rank + 1) * per))


def check_ep(spec: ModelSpec, ep: int) -> int:
    """An expert-parallel size the model can take (1 for a dense model), refused before anything is written."""
    if not isinstance(ep, int) or ep < 1:
        raise ConfigError(f"EP {ep!r} is not a positive number: choose an EP size >= 1")
    if ep > 1 and not spec.is_moe:
        raise ConfigError(f"EP {ep} needs experts, but this {spec.architecture} model is dense: drop --ep")
    if spec.is_moe and spec.num_moe_experts % ep:
        raise ConfigError(f"num_moe_experts {spec.num_moe_experts} is not divisible by EP {ep}: choose an EP that "
                          f"divides it")
    return ep


def stage_keys(spec: ModelSpec, counts: Sequence[int], pp_rank: int, ep_rank: int | None = None,
               ep_size: int = 1) -> list[tuple[str, str]]:
    """(stage-local key, global key) pairs held by one PP stage (and EP rank), in megatron-core state-dict order.
    Local keys number layers from the stage's first and experts from the EP rank's first."""
    pp_size = len(counts)
    offset = sum(counts[:pp_rank])
    experts = list(enumerate(local_experts(spec, ep_rank, ep_size)))
    out: list[tuple[str, str]] = []
    rules = rules_for(spec, pp_size)
    if pp_rank == 0:
        out += [(r.name, r.name) for r in rules if r.stage == FIRST]
    layer = [r for r in rules if r.stage == LAYER and not r.expert and r.block != SHARED]  # the attention's, MLP's
    expert = [r for r in rules if r.stage == LAYER and r.expert]  # the MLP's rows, expert by expert
    shared = [r for r in rules if r.stage == LAYER and r.block == SHARED]  # then a shared expert's
    for i in range(counts[pp_rank]):
        g = offset + i
        out += _layer_keys(layer, expert, shared, layer_blocks(spec, g), experts, dict(i=i), dict(i=g))
    if pp_rank == pp_size - 1:
        last = [r for r in rules if r.stage == LAST]
        out += [(r.name, r.name) for r in last if r.name.startswith("decoder.")]
        out += _mtp_keys(spec, rules, experts)
        out += [(r.name, r.name) for r in last if not r.name.startswith("decoder.")]
    return out


def _layer_keys(layer: list[Rule], expert: list[Rule], shared: list[Rule], blocks: Container[str],
                experts: list[tuple[int, int]], local: dict, glob: dict) -> list[tuple[str, str]]:
    """One layer's (local, global) keys: its rows of its blocks, then an MoE layer's experts and shared expert."""
    out = [(r.name.format(**local), r.name.format(**glob)) for r in layer if in_blocks(r.block, blocks)]
    if MOE in blocks:
        out += [(r.name.format(**local, e=j), r.name.format(**glob, e=e)) for j, e in experts for r in expert]
        out += [(r.name.format(**local), r.name.format(**glob)) for r in shared]
    return out


def _mtp_keys(spec: ModelSpec, rules: list[Rule], experts: list[tuple[int, int]]) -> list[tuple[str, str]]:
    """The multi-token prediction layers' keys (the same locally and globally), in megatron-core's order: enorm,
    hnorm, eh_proj, the transformer layer, final_layernorm."""
    mtp = [r for r in rules if r.stage == MTP_STAGE]
    top = [r for r in mtp if not r.name.startswith(MTP_LAYER)]
    inner = [r for r in mtp if r.name.startswith(MTP_LAYER)]
    layer = [r for r in inner if not r.expert and r.block != SHARED]
    expert = [r for r in inner if r.expert]
    shared = [r for r in inner if r.block == SHARED]
    out: list[tuple[str, str]] = []
    for m in range(spec.mtp_num_layers or 0):
        out += [(r.name.format(m=m),) * 2 for r in top if ".final_layernorm." not in r.name]
        out += _layer_keys(layer, expert, shared, mtp_blocks(spec), experts, dict(m=m), dict(m=m))
        out += [(r.name.format(m=m),) * 2 for r in top if ".final_layernorm." in r.name]
    return out

def rank_numel(spec: ModelSpec, counts: Sequence[int], padded_vocab: int, tp_size: int, pp_rank: int,
               ep_rank: int | None = None, ep_size: int = 1) -> int:
    """Elements of the weights one rank's file holds (what a team of writing processes balances)."""
    pp = len(counts)
    return sum(math.prod(shard_shape(key, spec, padded_vocab, tp_size, pp))
               for _, key in stage_keys(spec, counts, pp_rank, ep_rank, ep_size) if holds_weights(key, spec, pp))

def target_layout(spec: ModelSpec, tp: int, pp: int, layers: list[int] | None,
                  padded_now: int | None, vpp: int = 1) -> tuple[list[int], int]:
    """(layer counts, padded vocab) of a target layout; refused before anything is written. With `vpp` > 1 (an
    interleaved pipeline) the counts are the PP x VPP virtual stages' in layer order, an even split (megatron-core's
    get_transformer_layer_offset: virtual stage v * PP + p is model chunk v of PP rank p)."""
    spec.check_tp(tp)
    if vpp > 1:
        check_virtual(spec.num_layers, pp, vpp, layers)
        pp *= vpp
    counts = layers_per_stage(spec.num_layers, pp, layers)
    padded = spec.padded_vocab_keeping(tp, padded_now)
    for p in range(pp):
        for _, key in stage_keys(spec, counts, p):
            shard_shape(key, spec, padded, tp, pp)
    return counts, padded


def check_virtual(num_layers: int, pp: int, vpp: int, layers: Sequence[int] | None) -> None:
    """An interleaved pipeline Megatron-LM can express from its arguments alone (--num-layers-per-virtual-pipeline-
    stage): PP >= 2 and the layers split evenly over PP x VPP chunks (refused before anything is written)."""
    if layers is not None:
        raise ConfigError(f"--layers-per-stage with --vpp {vpp}: an interleaved pipeline's chunks are an even split "
                          f"(--num-layers-per-virtual-pipeline-stage); drop one of them")
    if pp < 2:
        raise ConfigError(f"--vpp {vpp} at PP {pp}: an interleaved pipeline needs PP >= 2; raise --pp or drop --vpp")
    if num_layers % (pp * vpp):
        raise ConfigError(f"num_layers {num_layers} does not split evenly into PP {pp} x VPP {vpp} = {pp * vpp} model "
                          f"chunks: choose a PP and VPP whose product divides it")
