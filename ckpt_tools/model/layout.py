"""THE layout table: how every tensor of a megatron-core GPTModel or HybridModel (local layer spec) is sharded.

One row per state-dict key, in megatron-core's own state-dict order. A row says how the full
(TP=1) tensor is split across tensor-parallel ranks, which pipeline stage holds it, its full
shape, and when it exists (its block: which layers hold it; its features). ckpt_tools.model.shard_ops applies the rows
to tensors (`split()` and `join()`, bit-exact inverses for every row). Nothing else in the project may know which dim a
tensor is split on: ask this module. The split kinds and the `Rule` a row is are ckpt_tools.model.rules'; the pipeline
stages' keys ckpt_tools.model.stages' (both re-exported here).

The table, keys and shapes are plain Python, no torch, so merge's torch-free byte source
(ckpt_tools.forms.byte_ranges) reads the same table.
"""
from __future__ import annotations

import functools
import re
from collections.abc import Container

from ckpt_tools.errors import LayoutError
from ckpt_tools.model.rules import (  # noqa: F401 (the table's vocabulary, re-exported)
    ATTENTION, ATTENTIONS, BLOCKED, COLUMN, DENSE, EXTRA, FIRST, GATED, GDN, LAST, LAYER, MAMBA, MAMBA_CONV, MLA, MLPS,
    MOE, MTP, MTP_STAGE, QKV, REPLICATED, ROW, SHARED, SYMBOLS, VOCAB, Alias, Rule, always,
    gdn_conv_parts, gdn_in_parts, gdn_v, head_vector, hidden_vector, in_blocks, mamba_conv_parts, mamba_in_parts,
    mamba_inner, q_head_dim, q_lora, q_plain, qk_norm_across, qk_norm_per_head, qkv_rows, with_bias, with_expert_bias,
    with_layernorm, with_shared_gate)
from ckpt_tools.model.spec import ModelSpec


def layer_blocks(spec: ModelSpec, i: int) -> frozenset[str]:
    """The blocks global layer i holds: its attention's kind and its MLP's (a dense MLP, or an MoE layer and, where
    the family has one, its shared expert)."""
    return _blocks_of(spec, spec.layer_symbols(i))


def _blocks_of(spec: ModelSpec, symbols: str) -> frozenset[str]:
    blocks = {SYMBOLS[c] for c in symbols}
    if MOE in blocks and spec.moe_shared_expert_intermediate_size is not None:
        blocks.add(SHARED)
    return frozenset(blocks)


@functools.lru_cache(maxsize=256)
def model_blocks(spec: ModelSpec) -> frozenset[str]:
    """The blocks any layer of the model holds (asked for every key: kept per spec)."""
    kinds = {spec.layer_symbols(i) for i in range(spec.num_layers)}
    mtp = frozenset((MTP,)) if spec.mtp_num_layers is not None else frozenset()
    return mtp.union(*(_blocks_of(spec, k) for k in kinds))


def mtp_blocks(spec: ModelSpec) -> frozenset[str]:
    """The blocks of each multi-token prediction layer's transformer layer: the last decoder layer's (megatron-core
    builds it from the decoder's last layer spec; DeepSeek-V3's HF layer after the decoder is an MoE layer too)."""
    return layer_blocks(spec, spec.num_layers - 1)


def _present(rule: Rule, spec: ModelSpec, pp: int, blocks: Container[str]) -> bool:
    """A row of this model at PP `pp`: in its blocks, its features present, and not an alias at PP = 1 (where the
    aliased tensor is the one tensor)."""
    aliased = rule.alias is not None and rule.alias.when(spec)
    return in_blocks(rule.block, blocks) and rule.when(spec, pp) and not (aliased and pp == 1)


_L = "decoder.layers.{i}."
_A = _L + "self_attention."
_X = _L + "mixer."  # megatron-core's MambaLayer: its mixer (MambaMixer) and its own norm
_E = _L + "mlp.experts.local_experts.{e}."  # megatron-core's SequentialMLP; `{e}` the expert (local in a file)
_S = _L + "mlp.shared_experts."
_M = "mtp.layers.{m}."  # `{m}` the multi-token prediction depth (0 first)
MTP_LAYER = _M + "transformer_layer."
TABLE: tuple[Rule, ...] = (
    Rule("embedding.word_embeddings.weight", VOCAB, FIRST, lambda s, v: (v, s.hidden_size), always),
    Rule("embedding.position_embeddings.weight", REPLICATED, FIRST,
         lambda s, v: (s.max_position_embeddings, s.hidden_size),
         lambda s, pp: s.position_embedding_type == "learned_absolute"),
    Rule(_L + "input_layernorm.weight", REPLICATED, LAYER, hidden_vector, always, ATTENTIONS),
    Rule(_L + "input_layernorm.bias", REPLICATED, LAYER, hidden_vector, with_layernorm, ATTENTIONS),
    # grouped-query attention (megatron-core's SelfAttention); GPT-OSS's learned softmax offset (a sink logit per head)
    # first: megatron-core builds the core attention before the projections
    Rule(_A + "core_attention.softmax_offset", COLUMN, LAYER, lambda s, v: (s.num_attention_heads,),
         lambda s, pp: s.softmax_type == "learnable", ATTENTION),
    Rule(_A + "linear_proj.weight", ROW, LAYER,
         lambda s, v: (s.hidden_size, s.num_attention_heads * s.kv_channels), always, ATTENTION),
    Rule(_A + "linear_proj.bias", REPLICATED, LAYER, hidden_vector, with_bias, ATTENTION),
    Rule(_A + "linear_proj._extra_state", EXTRA, LAYER, None, always, ATTENTION),
    Rule(_A + "linear_qkv.weight", QKV, LAYER, lambda s, v: (qkv_rows(s), s.hidden_size), always, ATTENTION),
    Rule(_A + "linear_qkv.bias", QKV, LAYER, lambda s, v: (qkv_rows(s),), lambda s, pp: s.qkv_bias, ATTENTION),
    Rule(_A + "linear_qkv._extra_state", EXTRA, LAYER, None, always, ATTENTION),
    Rule(_A + "q_layernorm.weight", REPLICATED, LAYER, head_vector, qk_norm_per_head, ATTENTION),
    Rule(_A + "k_layernorm.weight", REPLICATED, LAYER, head_vector, qk_norm_per_head, ATTENTION),
    # OLMoE's norms over all heads: each TP rank holds its own heads' (query groups') slice
    Rule(_A + "q_layernorm.weight", COLUMN, LAYER,
         lambda s, v: (s.num_attention_heads * s.kv_channels,), qk_norm_across, ATTENTION),
    Rule(_A + "k_layernorm.weight", COLUMN, LAYER,
         lambda s, v: (s.num_query_groups * s.kv_channels,), qk_norm_across, ATTENTION),
    # multi-latent attention (megatron-core's MLASelfAttention, local spec, in its state-dict order)
    # multi-latent attention (megatron-core's MLASelfAttention, local spec, in its state-dict order): each head's
    # query [no-position part; rotary part], the latent's rows [kv_lora_rank; the keys' shared rotary part], each
    # head's kv_up rows [key's no-position part; value]. The local spec splits the down projections over TP as column
    # layers (and gathers their output); Transformer Engine's spec keeps them whole on every rank.
    Rule(_A + "linear_proj.weight", ROW, LAYER,
         lambda s, v: (s.hidden_size, s.num_attention_heads * s.v_head_dim), always, MLA),
    Rule(_A + "linear_proj._extra_state", EXTRA, LAYER, None, always, MLA),
    Rule(_A + "linear_q_proj.weight", COLUMN, LAYER,
         lambda s, v: (s.num_attention_heads * q_head_dim(s), s.hidden_size), q_plain, MLA),
    Rule(_A + "linear_q_proj._extra_state", EXTRA, LAYER, None, q_plain, MLA),
    Rule(_A + "linear_q_down_proj.weight", COLUMN, LAYER, lambda s, v: (s.q_lora_rank, s.hidden_size), q_lora, MLA),
    Rule(_A + "linear_q_down_proj._extra_state", EXTRA, LAYER, None, q_lora, MLA),
    Rule(_A + "linear_q_up_proj.weight", COLUMN, LAYER,
         lambda s, v: (s.num_attention_heads * q_head_dim(s), s.q_lora_rank), q_lora, MLA),
    Rule(_A + "linear_q_up_proj._extra_state", EXTRA, LAYER, None, q_lora, MLA),
    Rule(_A + "linear_kv_down_proj.weight", COLUMN, LAYER,
         lambda s, v: (s.kv_lora_rank + s.qk_pos_emb_head_dim, s.hidden_size), always, MLA),
    Rule(_A + "linear_kv_down_proj._extra_state", EXTRA, LAYER, None, always, MLA),
    Rule(_A + "linear_kv_up_proj.weight", COLUMN, LAYER,
         lambda s, v: (s.num_attention_heads * (s.qk_head_dim + s.v_head_dim), s.kv_lora_rank), always, MLA),
    Rule(_A + "linear_kv_up_proj._extra_state", EXTRA, LAYER, None, always, MLA),
    Rule(_A + "q_layernorm.weight", REPLICATED, LAYER, lambda s, v: (s.q_lora_rank,), q_lora, MLA),
    Rule(_A + "kv_layernorm.weight", REPLICATED, LAYER, lambda s, v: (s.kv_lora_rank,), always, MLA),
    # a gated DeltaNet (megatron-core's GatedDeltaNet, in its state-dict order): a step bias and A per value head, in_proj
    # [q; k; v; z; b; a] and the convolution [q; k; v] split part by part over TP (by key and value heads), the gated
    # norm over each value head (replicated), out_proj row-parallel
    Rule(_A + "dt_bias", COLUMN, LAYER, lambda s, v: (s.linear_num_value_heads,), always, GDN),
    Rule(_A + "A_log", COLUMN, LAYER, lambda s, v: (s.linear_num_value_heads,), always, GDN),
    Rule(_A + "in_proj.weight", BLOCKED, LAYER, lambda s, v: (sum(gdn_in_parts(s)), s.hidden_size), always, GDN,
         parts=gdn_in_parts, part_names=("query", "key", "value", "z", "beta", "alpha")),
    Rule(_A + "in_proj._extra_state", EXTRA, LAYER, None, always, GDN),
    Rule(_A + "conv1d.weight", BLOCKED, LAYER, lambda s, v: (sum(gdn_conv_parts(s)), 1, s.linear_conv_kernel_dim),
         always, GDN, parts=gdn_conv_parts, part_names=("query", "key", "value")),
    Rule(_A + "out_norm.weight", REPLICATED, LAYER, lambda s, v: (s.linear_value_head_dim,), always, GDN),
    Rule(_A + "out_proj.weight", ROW, LAYER, lambda s, v: (s.hidden_size, gdn_v(s)), always, GDN),
    Rule(_A + "out_proj._extra_state", EXTRA, LAYER, None, always, GDN),
    Rule(_L + "pre_mlp_layernorm.weight", REPLICATED, LAYER, hidden_vector, always, MLPS),
    Rule(_L + "pre_mlp_layernorm.bias", REPLICATED, LAYER, hidden_vector, with_layernorm, MLPS),
    # a dense MLP
    Rule(_L + "mlp.linear_fc1.weight", GATED, LAYER,
         lambda s, v: (2 * s.ffn_hidden_size, s.hidden_size), lambda s, pp: s.gated_linear_unit, DENSE),
    Rule(_L + "mlp.linear_fc1.weight", COLUMN, LAYER,
         lambda s, v: (s.ffn_hidden_size, s.hidden_size), lambda s, pp: not s.gated_linear_unit, DENSE),
    Rule(_L + "mlp.linear_fc1.bias", GATED, LAYER, lambda s, v: (2 * s.ffn_hidden_size,),
         lambda s, pp: s.add_bias_linear and s.gated_linear_unit, DENSE),
    Rule(_L + "mlp.linear_fc1.bias", COLUMN, LAYER, lambda s, v: (s.ffn_hidden_size,),
         lambda s, pp: s.add_bias_linear and not s.gated_linear_unit, DENSE),
    Rule(_L + "mlp.linear_fc1._extra_state", EXTRA, LAYER, None, always, DENSE),
    Rule(_L + "mlp.linear_fc2.weight", ROW, LAYER, lambda s, v: (s.hidden_size, s.ffn_hidden_size), always, DENSE),
    Rule(_L + "mlp.linear_fc2.bias", REPLICATED, LAYER, hidden_vector, with_bias, DENSE),
    Rule(_L + "mlp.linear_fc2._extra_state", EXTRA, LAYER, None, always, DENSE),
    # MoE: a router (replicated) and experts, each a gated MLP split over TP as the dense one is (expert TP = TP)
    Rule(_L + "mlp.router.weight", REPLICATED, LAYER, lambda s, v: (s.num_moe_experts, s.hidden_size), always, MOE),
    Rule(_L + "mlp.router.bias", REPLICATED, LAYER, lambda s, v: (s.num_moe_experts,), with_bias, MOE),
    # DeepSeek's expert bias: a persistent fp32 buffer megatron-core moves by the experts' load, not by gradients
    Rule(_L + "mlp.router.expert_bias", REPLICATED, LAYER, lambda s, v: (s.num_moe_experts,), with_expert_bias, MOE,
         buffer=True, dtype="float32"),
    Rule(_E + "linear_fc1.weight", GATED, LAYER, lambda s, v: (2 * s.moe_ffn_hidden_size, s.hidden_size), always,
         MOE),
    Rule(_E + "linear_fc1.bias", GATED, LAYER, lambda s, v: (2 * s.moe_ffn_hidden_size,), with_bias, MOE),
    Rule(_E + "linear_fc1._extra_state", EXTRA, LAYER, None, always, MOE),
    Rule(_E + "linear_fc2.weight", ROW, LAYER, lambda s, v: (s.hidden_size, s.moe_ffn_hidden_size), always, MOE),
    Rule(_E + "linear_fc2.bias", REPLICATED, LAYER, hidden_vector, with_bias, MOE),
    Rule(_E + "linear_fc2._extra_state", EXTRA, LAYER, None, always, MOE),
    # a shared expert (megatron-core's SharedExpertMLP, after the experts): a dense gated MLP and its sigmoid gate
    Rule(_S + "gate_weight", REPLICATED, LAYER, lambda s, v: (1, s.hidden_size), with_shared_gate, SHARED),
    Rule(_S + "linear_fc1.weight", GATED, LAYER,
         lambda s, v: (2 * s.moe_shared_expert_intermediate_size, s.hidden_size), always, SHARED),
    Rule(_S + "linear_fc1._extra_state", EXTRA, LAYER, None, always, SHARED),
    Rule(_S + "linear_fc2.weight", ROW, LAYER,
         lambda s, v: (s.hidden_size, s.moe_shared_expert_intermediate_size), always, SHARED),
    Rule(_S + "linear_fc2._extra_state", EXTRA, LAYER, None, always, SHARED),
    # a Mamba-2 layer (megatron-core's MambaLayer, in its state-dict order): the layer's norm (Transformer Engine fuses
    # it into in_proj), the mixer's own parameters (a value per head: split over TP by heads), in_proj, the depthwise
    # convolution [channels, 1, kernel], the gated norm over d_inner (its groups whole on a rank), out_proj
    Rule(_L + "norm.weight", REPLICATED, LAYER, hidden_vector, always, MAMBA),
    Rule(_X + "dt_bias", COLUMN, LAYER, lambda s, v: (s.mamba_num_heads,), always, MAMBA),
    Rule(_X + "A_log", COLUMN, LAYER, lambda s, v: (s.mamba_num_heads,), always, MAMBA),
    Rule(_X + "D", COLUMN, LAYER, lambda s, v: (s.mamba_num_heads,), always, MAMBA),
    Rule(_X + "in_proj.weight", BLOCKED, LAYER, lambda s, v: (sum(mamba_in_parts(s)), s.hidden_size), always,
         MAMBA, parts=mamba_in_parts, part_names=("z", "x", "B", "C", "dt")),
    Rule(_X + "in_proj._extra_state", EXTRA, LAYER, None, always, MAMBA),
    Rule(_X + "conv1d.weight", BLOCKED, LAYER, lambda s, v: (sum(mamba_conv_parts(s)), 1, MAMBA_CONV), always, MAMBA,
         parts=mamba_conv_parts, part_names=("x", "B", "C")),
    Rule(_X + "conv1d.bias", BLOCKED, LAYER, lambda s, v: (sum(mamba_conv_parts(s)),), always, MAMBA,
         parts=mamba_conv_parts, part_names=("x", "B", "C")),
    Rule(_X + "norm.weight", COLUMN, LAYER, lambda s, v: (mamba_inner(s),), always, MAMBA),
    Rule(_X + "out_proj.weight", ROW, LAYER, lambda s, v: (s.hidden_size, mamba_inner(s)), always, MAMBA),
    Rule(_X + "out_proj._extra_state", EXTRA, LAYER, None, always, MAMBA),
    Rule("decoder.final_layernorm.weight", REPLICATED, LAST, hidden_vector, always),
    Rule("decoder.final_layernorm.bias", REPLICATED, LAST, hidden_vector, with_layernorm),
    # multi-token prediction layers (megatron-core's MultiTokenPredictionBlock, on the last stage; DeepSeek-V3's MTP):
    # the shifted tokens' embedding and the previous depth's hidden states, each normed, concatenated [embedding;
    # hidden] and projected back to hidden size (a column layer), a transformer layer like the decoder's last (its
    # rows: MTP_LAYER_ROWS, below), a final norm; the embedding and output layer are the model's own
    Rule(_M + "enorm.weight", REPLICATED, MTP_STAGE, hidden_vector, always, MTP),
    Rule(_M + "enorm.bias", REPLICATED, MTP_STAGE, hidden_vector, with_layernorm, MTP),
    Rule(_M + "hnorm.weight", REPLICATED, MTP_STAGE, hidden_vector, always, MTP),
    Rule(_M + "hnorm.bias", REPLICATED, MTP_STAGE, hidden_vector, with_layernorm, MTP),
    Rule(_M + "eh_proj.weight", COLUMN, MTP_STAGE, lambda s, v: (s.hidden_size, 2 * s.hidden_size), always, MTP),
    Rule(_M + "eh_proj._extra_state", EXTRA, MTP_STAGE, None, always, MTP),
    Rule(_M + "final_layernorm.weight", REPLICATED, MTP_STAGE, hidden_vector, always, MTP),
    Rule(_M + "final_layernorm.bias", REPLICATED, MTP_STAGE, hidden_vector, with_layernorm, MTP),
    # Tied embeddings: at PP=1 the output layer reuses the embedding; at PP>1 the last stage keeps a copy.
    Rule("output_layer.weight", VOCAB, LAST, lambda s, v: (v, s.hidden_size), always,
         alias=Alias("embedding.word_embeddings.weight", lambda s: bool(s.tie_word_embeddings))),
    Rule("output_layer._extra_state", EXTRA, LAST, None, always),
)


def _in_mtp(rule: Rule) -> Rule:
    """A decoder layer's row as the multi-token prediction layer's transformer layer holds it (present only in a model
    with MTP layers: the MTP rows above are gated by their block, MTP, which model_blocks gives only such a model)."""
    return Rule(MTP_LAYER + rule.name[len(_L):], rule.split, MTP_STAGE, rule.shape,
                lambda s, pp, when=rule.when: s.mtp_num_layers is not None and when(s, pp), rule.block, rule.buffer,
                rule.dtype, rule.parts, rule.part_names)


MTP_LAYER_ROWS = tuple(_in_mtp(r) for r in TABLE if r.stage == LAYER and r.block != MAMBA)
TABLE += MTP_LAYER_ROWS
_BUFFERS = frozenset(r.name for r in TABLE if r.buffer)
_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MTP_KEY = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


def layer_index(key: str) -> int | None:
    m = _LAYER_KEY.match(key)
    return int(m.group(1)) if m else None


def with_layer_index(key: str, index: int) -> str:
    """The same key with its layer number replaced (global <-> stage-local renumbering)."""
    m = _LAYER_KEY.match(key)
    if not m:
        return key
    return f"decoder.layers.{index}.{m.group(2)}"


def expert_index(key: str) -> int | None:
    m = _EXPERT.search(key)
    return int(m.group(1)) if m else None


def mtp_index(key: str) -> int | None:
    """The multi-token prediction depth of an MTP layer's key (`mtp.layers.<m>.`), else None."""
    m = _MTP_KEY.match(key)
    return int(m.group(1)) if m else None


def pattern_of(key: str) -> str:
    m = _LAYER_KEY.match(key)
    if m:
        return _EXPERT.sub(".local_experts.{e}.", _L + m.group(2))
    m = _MTP_KEY.match(key)
    return _EXPERT.sub(".local_experts.{e}.", _M + m.group(2)) if m else key


def find_rule(key: str, spec: ModelSpec, pp_size: int | None = 1) -> Rule:
    """The table row for a (global or stage-local) key; unknown keys are an error, never skipped. pp_size None:
    the key's row in any pipeline layout (a tied output layer exists only at PP > 1)."""
    name = pattern_of(key)
    candidates = [r for r in TABLE if r.name == name]
    blocks = model_blocks(spec)
    for r in candidates:
        if _present(r, spec, pp_size, blocks) if pp_size is not None else (
                _present(r, spec, 1, blocks) or _present(r, spec, 2, blocks)):
            return r
    if candidates:
        raise LayoutError(
            f"tensor {key} is not expected for this model ({spec.architecture}, tie_word_embeddings="
            f"{spec.tie_word_embeddings}, pp={pp_size}): the checkpoint and its config disagree")
    raise LayoutError(f"unknown tensor key {key}: not in the megatron-core GPTModel (local spec) layout table")


def alias_of(key: str, spec: ModelSpec) -> str | None:
    """The key whose tensor `key` is in this model (a tied output layer: the word embedding), or None: a tensor of its
    own. Such a key is a tensor only at PP > 1, as a copy on another stage."""
    if key not in ALIASES:  # asked for every tensor read or written: most are no alias row
        return None
    rule = find_rule(key, spec, None)
    return rule.alias.of if rule.alias is not None and rule.alias.when(spec) else None


def aliases(spec: ModelSpec) -> dict[str, str]:
    """{copy: original} of the model's aliased rows (the keys `alias_of` answers for)."""
    return {r.name: r.alias.of for r in TABLE if r.alias is not None and r.alias.when(spec)}


# {copy: original} of every row that may be an alias: a layout that holds the copy reads it from the original where
# the source has no copy (stages.source_key)
ALIASES = {r.name: r.alias.of for r in TABLE if r.alias is not None}


def holds_weights(key: str, spec: ModelSpec, pp_size: int | None = 1) -> bool:
    """A tensor, not an `_extra_state` object (carried as it is, never split, no optimizer state)."""
    return find_rule(key, spec, pp_size).split != EXTRA


def has_optimizer_state(key: str, spec: ModelSpec, pp_size: int | None = 1) -> bool:
    """A trained tensor: the optimizer holds a master copy and moments of it (not of a buffer or `_extra_state`)."""
    rule = find_rule(key, spec, pp_size)
    return rule.split != EXTRA and not rule.buffer


def dtype_of(key: str, spec: ModelSpec, weights: str, pp_size: int | None = 1) -> str:
    """The dtype a tensor is kept in: its row's own (DeepSeek's expert bias: float32, as megatron-core and
    transformers keep it), else the weights' (`weights`, a dtype name)."""
    return find_rule(key, spec, pp_size).dtype or weights


def is_buffer(key: str) -> bool:
    """A buffer's key (any spec): megatron-core's model state holds it, its optimizer does not."""
    return pattern_of(key) in _BUFFERS


def has_padded_rows(key: str, spec: ModelSpec, pp_size: int | None = 1) -> bool:
    """Rows up to the padded vocab (the true vocab's rows first): padded on the way in, trimmed on the way out."""
    return find_rule(key, spec, pp_size).split == VOCAB


def is_replicated(key: str, spec: ModelSpec, pp_size: int | None = 1) -> bool:
    """The same whole tensor on every TP rank."""
    return find_rule(key, spec, pp_size).split == REPLICATED


def rules_for(spec: ModelSpec, pp_size: int = 1) -> list[Rule]:
    """The rows the model holds (in any of its layers)."""
    blocks = model_blocks(spec)
    return [r for r in TABLE if _present(r, spec, pp_size, blocks)]


# ---------------------------------------------------------------- shapes
def full_shape(key: str, spec: ModelSpec, padded_vocab: int, pp_size: int | None = 1) -> tuple[int, ...] | None:
    rule = find_rule(key, spec, pp_size)
    return None if rule.shape is None else rule.shape(spec, padded_vocab)


def shard_shape(key: str, spec: ModelSpec, padded_vocab: int, tp_size: int, pp_size: int = 1) -> tuple[int, ...] | None:
    rule = find_rule(key, spec, pp_size)
    if rule.shape is None:
        return None
    shape = list(rule.shape(spec, padded_vocab))
    if rule.dim is not None:
        check_divides(key, rule, spec, shape[rule.dim], tp_size)
        shape[rule.dim] //= tp_size
    return tuple(shape)



def check_divides(key: str, rule: Rule, spec: ModelSpec, size: int, tp_size: int) -> None:
    if rule.split == BLOCKED and rule.name.endswith("self_attention.in_proj.weight") and \
            spec.linear_num_key_heads % tp_size:
        raise LayoutError(f"{key}: linear_num_key_heads {spec.linear_num_key_heads} is not divisible by TP {tp_size}: "
                          f"choose a TP that divides the key heads")
    if rule.split == QKV and spec.num_query_groups % tp_size:
        raise LayoutError(f"{key}: num_query_groups {spec.num_query_groups} is not divisible by TP {tp_size}: "
                          f"choose a TP that divides the query groups")
    if rule.split == GATED and (size // 2) % tp_size:
        raise LayoutError(f"{key}: ffn_hidden_size {size // 2} is not divisible by TP {tp_size}: "
                          f"choose a TP that divides it")
    if rule.split == BLOCKED and any(p % tp_size for p in rule.part_sizes(spec, size)):
        raise LayoutError(f"{key}: its parts of {', '.join(map(str, rule.part_sizes(spec, size)))} rows are not all "
                          f"divisible by TP {tp_size}: choose a TP that divides the heads and groups")
    if size % tp_size:
        raise LayoutError(f"{key}: dim {rule.dim} of size {size} is not divisible by TP {tp_size}: "
                          f"choose a TP that divides it")


# the pipeline stages' keys (what each stage and EP rank holds, in megatron-core's order): ckpt_tools/model/stages.py,
# its names answered here when asked (imported then: stages imports this module)
_STAGES = ("check_ep", "layers_per_stage", "local_experts", "rank_numel", "source_key", "stage_keys", "target_layout",
           "tied_copies")


def __getattr__(name: str):
    if name in _STAGES:
        from ckpt_tools.model import stages
        return getattr(stages, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
