"""THE layout table: how every tensor of a megatron-core GPTModel (local layer spec) is sharded.

One row per state-dict key, in megatron-core's own state-dict order. A row says how the full
(TP=1) tensor is split across tensor-parallel ranks, which pipeline stage holds it, its full
shape, and when it exists. ckpt_tools.shard_ops applies the rows to tensors (`split()` and `join()`,
bit-exact inverses for every row). Nothing else in the project may know which dim a tensor is split
on: ask this module.

Split kinds:
  replicated   every TP rank holds the whole tensor (norms, per-head q/k norms, row-parallel biases, positions)
  column       dim 0 in TP equal chunks
  row          dim 1 in TP equal chunks (its bias is replicated)
  qkv          dim 0; full rows are grouped per query group [q heads of the group; k; v] and the
               groups are dealt to ranks in order, so a rank's shard is a contiguous run of groups
  gated        dim 0 of a SwiGLU fc1 whose full tensor is [gate; up]; rank r holds [gate_r; up_r]
  blocked      dim 0 made of parts (the row's `parts`), each split in TP equal chunks; rank r holds [part0_r;
               part1_r; ...] (gated is blocked in two halves; Mamba's in_proj [z; x; B; C; dt], its conv1d [x; B; C])
  vocab        dim 0 over the padded vocab; rows beyond the true vocab are padding (zeros when made here)
  extra_state  `_extra_state` (None or bytes in megatron-core); carried as is, never split

The table, keys and shapes are plain Python, no torch, so merge's torch-free byte source
(ckpt_tools.byte_ranges) reads the same table.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass

from ckpt_tools.errors import ConfigError, LayoutError
from ckpt_tools.ranks import EP, PP, TP
from ckpt_tools.spec import ModelSpec

REPLICATED, COLUMN, ROW, QKV, GATED, BLOCKED, VOCAB, EXTRA = (
    "replicated", "column", "row", "qkv", "gated", "blocked", "vocab", "extra_state")
SPLIT_DIM = {COLUMN: 0, ROW: 1, QKV: 0, GATED: 0, BLOCKED: 0, VOCAB: 0}

FIRST, LAYER, LAST, MTP_STAGE = "first", "layer", "last", "mtp"  # MTP_STAGE: the last stage's MTP layers

Shape = Callable[[ModelSpec, int], tuple[int, ...]]  # (spec, padded_vocab) -> full shape
When = Callable[[ModelSpec, int], bool]  # (spec, pp_size) -> present


# Blocks: the parts a layer is made of (ModelSpec.pattern says which each layer has). A row of no block is in
# every layer (its norms).
ATTENTION, MLA, DENSE, MOE, SHARED, MTP, MAMBA, GDN = (
    "attention", "mla", "dense", "moe", "shared", "mtp", "mamba", "gdn")
_SYMBOLS = {"*": ATTENTION, "+": MLA, "-": DENSE, "E": MOE, "M": MAMBA, "G": GDN}  # the layer pattern's symbols'
# blocks


@dataclass(frozen=True)
class Rule:
    """One row of the table. `name` uses `{i}` for the stage-local layer index; `block` the layer part it belongs
    to (None: every layer's, or not a layer's; a tuple: a part of any of those blocks, a norm several share); `when`
    the features it needs."""
    name: str
    split: str
    stage: str
    shape: Shape | None
    when: When
    block: str | tuple[str, ...] | None = None
    buffer: bool = False  # a tensor no optimizer trains (megatron-core's persistent buffer): no optimizer state
    dtype: str | None = None  # kept in this dtype whatever the weights' (None: the weights' dtype)
    parts: Callable[[ModelSpec], tuple[int, ...]] | None = None  # a blocked row's parts' sizes along dim 0

    def part_sizes(self, spec: ModelSpec, size: int) -> tuple[int, ...]:
        """The parts of dim 0 that are each split over TP: a gated row's halves, a blocked row's parts, else the
        whole dim."""
        if self.split == GATED:
            return (size // 2, size // 2)
        return self.parts(spec) if self.split == BLOCKED else (size,)

    @property
    def dim(self) -> int | None:
        return SPLIT_DIM.get(self.split)

    @property
    def axes(self) -> tuple[str, ...]:
        """The rank axes (ranks.TP, ranks.PP, ranks.EP) that hold different parts of this tensor: PP always (a
        stage holds its own layers; FIRST and LAST rows live on one stage), TP where it is split over TP ranks.
        EP for expert rows (each expert lives on one EP rank). A rank on an axis a tensor is not split over holds a
        replica (or nothing)."""
        return (PP, TP) + ((EP,) if self.expert else ()) if self.dim is not None else (PP,) + ((EP,) if self.expert else ())

    @property
    def expert(self) -> bool:
        """One row per expert (`{e}` in the name): an expert-parallel rank holds its own experts only."""
        return "{e}" in self.name


def layer_blocks(spec: ModelSpec, i: int) -> frozenset[str]:
    """The blocks global layer i holds: its attention's kind and its MLP's (a dense MLP, or an MoE layer and, where
    the family has one, its shared expert)."""
    return _blocks_of(spec, spec.layer_symbols(i))


def _blocks_of(spec: ModelSpec, symbols: str) -> frozenset[str]:
    blocks = {_SYMBOLS[c] for c in symbols}
    if MOE in blocks and spec.moe_shared_expert_intermediate_size is not None:
        blocks.add(SHARED)
    return frozenset(blocks)


def model_blocks(spec: ModelSpec) -> frozenset[str]:
    """The blocks any layer of the model holds."""
    kinds = {spec.layer_symbols(i) for i in range(spec.num_layers)}
    mtp = frozenset((MTP,)) if spec.mtp_num_layers is not None else frozenset()
    return mtp.union(*(_blocks_of(spec, k) for k in kinds))


def mtp_blocks(spec: ModelSpec) -> frozenset[str]:
    """The blocks of each multi-token prediction layer's transformer layer: the last decoder layer's (megatron-core
    builds it from the decoder's last layer spec; DeepSeek-V3's HF layer after the decoder is an MoE layer too)."""
    return layer_blocks(spec, spec.num_layers - 1)


def _in_blocks(block: str | tuple[str, ...] | None, blocks: Container[str]) -> bool:
    """A row of `block` belongs to a layer of `blocks` (a row of no block to every layer)."""
    if block is None:
        return True
    return any(b in blocks for b in block) if isinstance(block, tuple) else block in blocks


def _present(rule: Rule, spec: ModelSpec, pp: int, blocks: Container[str]) -> bool:
    return _in_blocks(rule.block, blocks) and rule.when(spec, pp)


def _always(s: ModelSpec, pp: int) -> bool:
    return True


def _layernorm(s: ModelSpec, pp: int) -> bool:
    return s.normalization == "LayerNorm"


def _bias(s: ModelSpec, pp: int) -> bool:
    return s.add_bias_linear


def _qk_norm(s: ModelSpec, pp: int) -> bool:
    return s.qk_layernorm and not s.qk_norm_across_heads


def _qk_norm_across(s: ModelSpec, pp: int) -> bool:
    return s.qk_layernorm and s.qk_norm_across_heads


def _shared_gate(s: ModelSpec, pp: int) -> bool:
    return s.moe_shared_expert_gate


def _expert_bias(s: ModelSpec, pp: int) -> bool:
    return s.moe_router_enable_expert_bias


def _q_lora(s: ModelSpec, pp: int) -> bool:
    return s.q_lora_rank is not None


def _q_plain(s: ModelSpec, pp: int) -> bool:
    return s.q_lora_rank is None


def _h(s: ModelSpec, v: int) -> tuple[int, ...]:
    return (s.hidden_size,)


def _d(s: ModelSpec, v: int) -> tuple[int, ...]:
    return (s.kv_channels,)


def _q_head(s: ModelSpec) -> int:
    return s.qk_head_dim + s.qk_pos_emb_head_dim


def _mamba_inner(s: ModelSpec) -> int:
    return s.mamba_num_heads * s.mamba_head_dim


def _mamba_in_parts(s: ModelSpec) -> tuple[int, ...]:
    """Mamba-2's in_proj rows: [z; x; B; C; dt] (gate, input, the state's in and out projections per group, a step
    per head), each split over TP by heads and groups."""
    gn = s.mamba_num_groups * s.mamba_state_dim
    return (_mamba_inner(s), _mamba_inner(s), gn, gn, s.mamba_num_heads)


def _mamba_conv_parts(s: ModelSpec) -> tuple[int, ...]:
    """Mamba-2's convolution channels: [x; B; C]."""
    return _mamba_in_parts(s)[1:4]


MAMBA_CONV = 4  # the convolution's width (megatron-core's MambaMixer d_conv, which Megatron-LM does not set)
_ATTENTIONS, _MLPS = (ATTENTION, MLA, GDN), (DENSE, MOE)  # the blocks a layer's input norm / pre-MLP norm serves


def _gdn_qk(s: ModelSpec) -> int:
    return s.linear_num_key_heads * s.linear_key_head_dim


def _gdn_v(s: ModelSpec) -> int:
    return s.linear_num_value_heads * s.linear_value_head_dim


def _gdn_in_parts(s: ModelSpec) -> tuple[int, ...]:
    """Gated DeltaNet's in_proj rows: [q; k; v; z; b; a] (each head-major), each split over TP by heads."""
    return (_gdn_qk(s), _gdn_qk(s), _gdn_v(s), _gdn_v(s), s.linear_num_value_heads, s.linear_num_value_heads)


def _gdn_conv_parts(s: ModelSpec) -> tuple[int, ...]:
    """Gated DeltaNet's convolution channels: [q; k; v]."""
    return _gdn_in_parts(s)[:3]


def _qkv_rows(s: ModelSpec) -> int:
    """linear_qkv's rows: per query group its q heads (and, with an output gate, as many gate heads), k and v."""
    gate = s.num_attention_heads if s.attention_output_gate else 0
    return (s.num_attention_heads + gate + 2 * s.num_query_groups) * s.kv_channels
_L = "decoder.layers.{i}."
_A = _L + "self_attention."
_X = _L + "mixer."  # megatron-core's MambaLayer: its mixer (MambaMixer) and its own norm
_E = _L + "mlp.experts.local_experts.{e}."  # megatron-core's SequentialMLP; `{e}` the expert (local in a file)
_S = _L + "mlp.shared_experts."
_M = "mtp.layers.{m}."  # `{m}` the multi-token prediction depth (0 first)
_MT = _M + "transformer_layer."
TABLE: tuple[Rule, ...] = (
    Rule("embedding.word_embeddings.weight", VOCAB, FIRST, lambda s, v: (v, s.hidden_size), _always),
    Rule("embedding.position_embeddings.weight", REPLICATED, FIRST,
         lambda s, v: (s.max_position_embeddings, s.hidden_size),
         lambda s, pp: s.position_embedding_type == "learned_absolute"),
    Rule(_L + "input_layernorm.weight", REPLICATED, LAYER, _h, _always, _ATTENTIONS),
    Rule(_L + "input_layernorm.bias", REPLICATED, LAYER, _h, _layernorm, _ATTENTIONS),
    # grouped-query attention (megatron-core's SelfAttention); GPT-OSS's learned softmax offset (a sink logit per head)
    # first: megatron-core builds the core attention before the projections
    Rule(_A + "core_attention.softmax_offset", COLUMN, LAYER, lambda s, v: (s.num_attention_heads,),
         lambda s, pp: s.softmax_type == "learnable", ATTENTION),
    Rule(_A + "linear_proj.weight", ROW, LAYER,
         lambda s, v: (s.hidden_size, s.num_attention_heads * s.kv_channels), _always, ATTENTION),
    Rule(_A + "linear_proj.bias", REPLICATED, LAYER, _h, _bias, ATTENTION),
    Rule(_A + "linear_proj._extra_state", EXTRA, LAYER, None, _always, ATTENTION),
    Rule(_A + "linear_qkv.weight", QKV, LAYER, lambda s, v: (_qkv_rows(s), s.hidden_size), _always, ATTENTION),
    Rule(_A + "linear_qkv.bias", QKV, LAYER, lambda s, v: (_qkv_rows(s),), lambda s, pp: s.qkv_bias, ATTENTION),
    Rule(_A + "linear_qkv._extra_state", EXTRA, LAYER, None, _always, ATTENTION),
    Rule(_A + "q_layernorm.weight", REPLICATED, LAYER, _d, _qk_norm, ATTENTION),
    Rule(_A + "k_layernorm.weight", REPLICATED, LAYER, _d, _qk_norm, ATTENTION),
    # OLMoE's norms over all heads: each TP rank holds its own heads' (query groups') slice
    Rule(_A + "q_layernorm.weight", COLUMN, LAYER,
         lambda s, v: (s.num_attention_heads * s.kv_channels,), _qk_norm_across, ATTENTION),
    Rule(_A + "k_layernorm.weight", COLUMN, LAYER,
         lambda s, v: (s.num_query_groups * s.kv_channels,), _qk_norm_across, ATTENTION),
    # multi-latent attention (megatron-core's MLASelfAttention, local spec, in its state-dict order)
    # multi-latent attention (megatron-core's MLASelfAttention, local spec, in its state-dict order): each head's
    # query [no-position part; rotary part], the latent's rows [kv_lora_rank; the keys' shared rotary part], each
    # head's kv_up rows [key's no-position part; value]. The local spec splits the down projections over TP as column
    # layers (and gathers their output); Transformer Engine's spec keeps them whole on every rank.
    Rule(_A + "linear_proj.weight", ROW, LAYER,
         lambda s, v: (s.hidden_size, s.num_attention_heads * s.v_head_dim), _always, MLA),
    Rule(_A + "linear_proj._extra_state", EXTRA, LAYER, None, _always, MLA),
    Rule(_A + "linear_q_proj.weight", COLUMN, LAYER,
         lambda s, v: (s.num_attention_heads * _q_head(s), s.hidden_size), _q_plain, MLA),
    Rule(_A + "linear_q_proj._extra_state", EXTRA, LAYER, None, _q_plain, MLA),
    Rule(_A + "linear_q_down_proj.weight", COLUMN, LAYER, lambda s, v: (s.q_lora_rank, s.hidden_size), _q_lora, MLA),
    Rule(_A + "linear_q_down_proj._extra_state", EXTRA, LAYER, None, _q_lora, MLA),
    Rule(_A + "linear_q_up_proj.weight", COLUMN, LAYER,
         lambda s, v: (s.num_attention_heads * _q_head(s), s.q_lora_rank), _q_lora, MLA),
    Rule(_A + "linear_q_up_proj._extra_state", EXTRA, LAYER, None, _q_lora, MLA),
    Rule(_A + "linear_kv_down_proj.weight", COLUMN, LAYER,
         lambda s, v: (s.kv_lora_rank + s.qk_pos_emb_head_dim, s.hidden_size), _always, MLA),
    Rule(_A + "linear_kv_down_proj._extra_state", EXTRA, LAYER, None, _always, MLA),
    Rule(_A + "linear_kv_up_proj.weight", COLUMN, LAYER,
         lambda s, v: (s.num_attention_heads * (s.qk_head_dim + s.v_head_dim), s.kv_lora_rank), _always, MLA),
    Rule(_A + "linear_kv_up_proj._extra_state", EXTRA, LAYER, None, _always, MLA),
    Rule(_A + "q_layernorm.weight", REPLICATED, LAYER, lambda s, v: (s.q_lora_rank,), _q_lora, MLA),
    Rule(_A + "kv_layernorm.weight", REPLICATED, LAYER, lambda s, v: (s.kv_lora_rank,), _always, MLA),
    # a gated DeltaNet (megatron-core's GatedDeltaNet, in its state-dict order): a step bias and A per value head, in_proj
    # [q; k; v; z; b; a] and the convolution [q; k; v] split part by part over TP (by key and value heads), the gated
    # norm over each value head (replicated), out_proj row-parallel
    Rule(_A + "dt_bias", COLUMN, LAYER, lambda s, v: (s.linear_num_value_heads,), _always, GDN),
    Rule(_A + "A_log", COLUMN, LAYER, lambda s, v: (s.linear_num_value_heads,), _always, GDN),
    Rule(_A + "in_proj.weight", BLOCKED, LAYER, lambda s, v: (sum(_gdn_in_parts(s)), s.hidden_size), _always, GDN,
         parts=_gdn_in_parts),
    Rule(_A + "in_proj._extra_state", EXTRA, LAYER, None, _always, GDN),
    Rule(_A + "conv1d.weight", BLOCKED, LAYER, lambda s, v: (sum(_gdn_conv_parts(s)), 1, s.linear_conv_kernel_dim),
         _always, GDN, parts=_gdn_conv_parts),
    Rule(_A + "out_norm.weight", REPLICATED, LAYER, lambda s, v: (s.linear_value_head_dim,), _always, GDN),
    Rule(_A + "out_proj.weight", ROW, LAYER, lambda s, v: (s.hidden_size, _gdn_v(s)), _always, GDN),
    Rule(_A + "out_proj._extra_state", EXTRA, LAYER, None, _always, GDN),
    Rule(_L + "pre_mlp_layernorm.weight", REPLICATED, LAYER, _h, _always, _MLPS),
    Rule(_L + "pre_mlp_layernorm.bias", REPLICATED, LAYER, _h, _layernorm, _MLPS),
    # a dense MLP
    Rule(_L + "mlp.linear_fc1.weight", GATED, LAYER,
         lambda s, v: (2 * s.ffn_hidden_size, s.hidden_size), lambda s, pp: s.gated_linear_unit, DENSE),
    Rule(_L + "mlp.linear_fc1.weight", COLUMN, LAYER,
         lambda s, v: (s.ffn_hidden_size, s.hidden_size), lambda s, pp: not s.gated_linear_unit, DENSE),
    Rule(_L + "mlp.linear_fc1.bias", GATED, LAYER, lambda s, v: (2 * s.ffn_hidden_size,),
         lambda s, pp: s.add_bias_linear and s.gated_linear_unit, DENSE),
    Rule(_L + "mlp.linear_fc1.bias", COLUMN, LAYER, lambda s, v: (s.ffn_hidden_size,),
         lambda s, pp: s.add_bias_linear and not s.gated_linear_unit, DENSE),
    Rule(_L + "mlp.linear_fc1._extra_state", EXTRA, LAYER, None, _always, DENSE),
    Rule(_L + "mlp.linear_fc2.weight", ROW, LAYER, lambda s, v: (s.hidden_size, s.ffn_hidden_size), _always, DENSE),
    Rule(_L + "mlp.linear_fc2.bias", REPLICATED, LAYER, _h, _bias, DENSE),
    Rule(_L + "mlp.linear_fc2._extra_state", EXTRA, LAYER, None, _always, DENSE),
    # MoE: a router (replicated) and experts, each a gated MLP split over TP as the dense one is (expert TP = TP)
    Rule(_L + "mlp.router.weight", REPLICATED, LAYER, lambda s, v: (s.num_moe_experts, s.hidden_size), _always, MOE),
    Rule(_L + "mlp.router.bias", REPLICATED, LAYER, lambda s, v: (s.num_moe_experts,), _bias, MOE),
    # DeepSeek's expert bias: a persistent fp32 buffer megatron-core moves by the experts' load, not by gradients
    Rule(_L + "mlp.router.expert_bias", REPLICATED, LAYER, lambda s, v: (s.num_moe_experts,), _expert_bias, MOE,
         buffer=True, dtype="float32"),
    Rule(_E + "linear_fc1.weight", GATED, LAYER, lambda s, v: (2 * s.moe_ffn_hidden_size, s.hidden_size), _always,
         MOE),
    Rule(_E + "linear_fc1.bias", GATED, LAYER, lambda s, v: (2 * s.moe_ffn_hidden_size,), _bias, MOE),
    Rule(_E + "linear_fc1._extra_state", EXTRA, LAYER, None, _always, MOE),
    Rule(_E + "linear_fc2.weight", ROW, LAYER, lambda s, v: (s.hidden_size, s.moe_ffn_hidden_size), _always, MOE),
    Rule(_E + "linear_fc2.bias", REPLICATED, LAYER, _h, _bias, MOE),
    Rule(_E + "linear_fc2._extra_state", EXTRA, LAYER, None, _always, MOE),
    # a shared expert (megatron-core's SharedExpertMLP, after the experts): a dense gated MLP and its sigmoid gate
    Rule(_S + "gate_weight", REPLICATED, LAYER, lambda s, v: (1, s.hidden_size), _shared_gate, SHARED),
    Rule(_S + "linear_fc1.weight", GATED, LAYER,
         lambda s, v: (2 * s.moe_shared_expert_intermediate_size, s.hidden_size), _always, SHARED),
    Rule(_S + "linear_fc1._extra_state", EXTRA, LAYER, None, _always, SHARED),
    Rule(_S + "linear_fc2.weight", ROW, LAYER,
         lambda s, v: (s.hidden_size, s.moe_shared_expert_intermediate_size), _always, SHARED),
    Rule(_S + "linear_fc2._extra_state", EXTRA, LAYER, None, _always, SHARED),
    # a Mamba-2 layer (megatron-core's MambaLayer, in its state-dict order): the layer's norm (Transformer Engine fuses
    # it into in_proj), the mixer's own parameters (a value per head: split over TP by heads), in_proj, the depthwise
    # convolution [channels, 1, kernel], the gated norm over d_inner (its groups whole on a rank), out_proj
    Rule(_L + "norm.weight", REPLICATED, LAYER, _h, _always, MAMBA),
    Rule(_X + "dt_bias", COLUMN, LAYER, lambda s, v: (s.mamba_num_heads,), _always, MAMBA),
    Rule(_X + "A_log", COLUMN, LAYER, lambda s, v: (s.mamba_num_heads,), _always, MAMBA),
    Rule(_X + "D", COLUMN, LAYER, lambda s, v: (s.mamba_num_heads,), _always, MAMBA),
    Rule(_X + "in_proj.weight", BLOCKED, LAYER, lambda s, v: (sum(_mamba_in_parts(s)), s.hidden_size), _always,
         MAMBA, parts=_mamba_in_parts),
    Rule(_X + "in_proj._extra_state", EXTRA, LAYER, None, _always, MAMBA),
    Rule(_X + "conv1d.weight", BLOCKED, LAYER, lambda s, v: (sum(_mamba_conv_parts(s)), 1, MAMBA_CONV), _always, MAMBA,
         parts=_mamba_conv_parts),
    Rule(_X + "conv1d.bias", BLOCKED, LAYER, lambda s, v: (sum(_mamba_conv_parts(s)),), _always, MAMBA,
         parts=_mamba_conv_parts),
    Rule(_X + "norm.weight", COLUMN, LAYER, lambda s, v: (_mamba_inner(s),), _always, MAMBA),
    Rule(_X + "out_proj.weight", ROW, LAYER, lambda s, v: (s.hidden_size, _mamba_inner(s)), _always, MAMBA),
    Rule(_X + "out_proj._extra_state", EXTRA, LAYER, None, _always, MAMBA),
    Rule("decoder.final_layernorm.weight", REPLICATED, LAST, _h, _always),
    Rule("decoder.final_layernorm.bias", REPLICATED, LAST, _h, _layernorm),
    # multi-token prediction layers (megatron-core's MultiTokenPredictionBlock, on the last stage; DeepSeek-V3's MTP):
    # the shifted tokens' embedding and the previous depth's hidden states, each normed, concatenated [embedding;
    # hidden] and projected back to hidden size (a column layer), a transformer layer like the decoder's last (its
    # rows: MTP_LAYER_ROWS, below), a final norm; the embedding and output layer are the model's own
    Rule(_M + "enorm.weight", REPLICATED, MTP_STAGE, _h, _always, MTP),
    Rule(_M + "enorm.bias", REPLICATED, MTP_STAGE, _h, _layernorm, MTP),
    Rule(_M + "hnorm.weight", REPLICATED, MTP_STAGE, _h, _always, MTP),
    Rule(_M + "hnorm.bias", REPLICATED, MTP_STAGE, _h, _layernorm, MTP),
    Rule(_M + "eh_proj.weight", COLUMN, MTP_STAGE, lambda s, v: (s.hidden_size, 2 * s.hidden_size), _always, MTP),
    Rule(_M + "eh_proj._extra_state", EXTRA, MTP_STAGE, None, _always, MTP),
    Rule(_M + "final_layernorm.weight", REPLICATED, MTP_STAGE, _h, _always, MTP),
    Rule(_M + "final_layernorm.bias", REPLICATED, MTP_STAGE, _h, _layernorm, MTP),
    # Tied embeddings: at PP=1 the output layer reuses the embedding; at PP>1 the last stage keeps a copy.
    Rule("output_layer.weight", VOCAB, LAST, lambda s, v: (v, s.hidden_size),
         lambda s, pp: not s.tie_word_embeddings or pp > 1),
    Rule("output_layer._extra_state", EXTRA, LAST, None, _always),
)


def _in_mtp(rule: Rule) -> Rule:
    """A decoder layer's row as the multi-token prediction layer's transformer layer holds it (present only in a model
    with MTP layers: the MTP rows above are gated by their block, MTP, which model_blocks gives only such a model)."""
    return Rule(_MT + rule.name[len(_L):], rule.split, MTP_STAGE, rule.shape,
                lambda s, pp, when=rule.when: s.mtp_num_layers is not None and when(s, pp), rule.block, rule.buffer,
                rule.dtype, rule.parts)


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


# ---------------------------------------------------------------- pipeline stages
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
    """The copies of a tied embedding a stage holds when PP > 1 (the first stage's embedding, the last stage's
    output layer): megatron-core keeps each in a grad-buffer bucket of its own. Empty when untied or PP = 1."""
    if not spec.tie_word_embeddings or pp_size == 1:
        return set()
    return ({"embedding.word_embeddings.weight"} if pp_rank == 0 else set()) | \
        ({"output_layer.weight"} if pp_rank == pp_size - 1 else set())


def source_key(key: str, present: Container[str]) -> str:
    """The tensor that holds `key` in a checkpoint holding the keys `present`: itself, or, for the tied output copy
    that a PP > 1 layout keeps but a PP = 1 checkpoint lacks, the word embedding it copies."""
    if key == "output_layer.weight" and key not in present:
        return "embedding.word_embeddings.weight"
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
    out = [(r.name.format(**local), r.name.format(**glob)) for r in layer if _in_blocks(r.block, blocks)]
    if MOE in blocks:
        out += [(r.name.format(**local, e=j), r.name.format(**glob, e=e)) for j, e in experts for r in expert]
        out += [(r.name.format(**local), r.name.format(**glob)) for r in shared]
    return out


def _mtp_keys(spec: ModelSpec, rules: list[Rule], experts: list[tuple[int, int]]) -> list[tuple[str, str]]:
    """The multi-token prediction layers' keys (the same locally and globally), in megatron-core's order: enorm,
    hnorm, eh_proj, the transformer layer, final_layernorm."""
    mtp = [r for r in rules if r.stage == MTP_STAGE]
    top = [r for r in mtp if not r.name.startswith(_MT)]
    inner = [r for r in mtp if r.name.startswith(_MT)]
    layer = [r for r in inner if not r.expert and r.block != SHARED]
    expert = [r for r in inner if r.expert]
    shared = [r for r in inner if r.block == SHARED]
    out: list[tuple[str, str]] = []
    for m in range(spec.mtp_num_layers or 0):
        out += [(r.name.format(m=m),) * 2 for r in top if ".final_layernorm." not in r.name]
        out += _layer_keys(layer, expert, shared, mtp_blocks(spec), experts, dict(m=m), dict(m=m))
        out += [(r.name.format(m=m),) * 2 for r in top if ".final_layernorm." in r.name]
    return out


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
        _check_divides(key, rule, spec, shape[rule.dim], tp_size)
        shape[rule.dim] //= tp_size
    return tuple(shape)


def rank_numel(spec: ModelSpec, counts: Sequence[int], padded_vocab: int, tp_size: int, pp_rank: int,
               ep_rank: int | None = None, ep_size: int = 1) -> int:
    """Elements of the weights one rank's file holds (what a team of writing processes balances)."""
    pp = len(counts)
    return sum(math.prod(shard_shape(key, spec, padded_vocab, tp_size, pp))
               for _, key in stage_keys(spec, counts, pp_rank, ep_rank, ep_size) if holds_weights(key, spec, pp))


def _check_divides(key: str, rule: Rule, spec: ModelSpec, size: int, tp_size: int) -> None:
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


def target_layout(spec: ModelSpec, tp: int, pp: int, layers: list[int] | None,
                  padded_now: int | None) -> tuple[list[int], int]:
    """(layer counts, padded vocab) of a target layout; refused before anything is written."""
    spec.check_tp(tp)
    counts = layers_per_stage(spec.num_layers, pp, layers)
    padded = spec.padded_vocab_keeping(tp, padded_now)
    for p in range(pp):
        for _, key in stage_keys(spec, counts, p):
            shard_shape(key, spec, padded, tp, pp)
    return counts, padded

