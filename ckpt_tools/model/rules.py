"""The vocabulary of the layout table (ckpt_tools.model.layout): split kinds, pipeline-stage kinds, blocks, and the
`Rule` a row is, with the predicates and sizes the rows are written in. Plain Python, no torch.

Split kinds:
  replicated   every TP rank holds the whole tensor (norms, per-head q/k norms, row-parallel biases, positions)
  column       dim 0 in TP equal chunks
  row          dim 1 in TP equal chunks (its bias is replicated)
  qkv          dim 0; full rows are grouped per query group [q heads of the group; (gate heads); k; v] and the
               groups are dealt to ranks in order, so a rank's shard is a contiguous run of groups
  gated        dim 0 of a SwiGLU fc1 whose full tensor is [gate; up]; rank r holds [gate_r; up_r]
  blocked      dim 0 made of parts (the row's `parts`), each split in TP equal chunks; rank r holds [part0_r;
               part1_r; ...] (gated is blocked in two halves; Mamba's in_proj [z; x; B; C; dt], its conv1d [x; B; C];
               a gated DeltaNet's in_proj [q; k; v; z; b; a], its conv1d [q; k; v])
  vocab        dim 0 over the padded vocab; rows beyond the true vocab are padding (zeros when made here)
  extra_state  `_extra_state` (None or bytes in megatron-core); carried as is, never split
"""
from __future__ import annotations

from collections.abc import Callable, Container
from dataclasses import dataclass

from ckpt_tools.model.ranks import EP, PP, TP
from ckpt_tools.model.spec import ModelSpec

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
SYMBOLS = {"*": ATTENTION, "+": MLA, "-": DENSE, "E": MOE, "M": MAMBA, "G": GDN}  # the layer pattern's symbols'
# blocks


@dataclass(frozen=True)
class Alias:
    """A row whose tensor, in a model where `when` holds, is another row's tensor (`of`): megatron-core's tied output
    layer is its word embedding. At PP = 1 it is not a tensor of its own; at PP > 1 its stage keeps a copy (a
    gradient bucket of its own), which megatron-core saves only as the original."""
    of: str
    when: Callable[[ModelSpec], bool]


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
    part_names: tuple[str, ...] | None = None  # their names where megatron-core saves them apart (`<key>.<name>`)
    alias: Alias | None = None  # the row whose tensor this one is, in the models the alias names

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


def in_blocks(block: str | tuple[str, ...] | None, blocks: Container[str]) -> bool:
    """A row of `block` belongs to a layer of `blocks` (a row of no block to every layer)."""
    if block is None:
        return True
    return any(b in blocks for b in block) if isinstance(block, tuple) else block in blocks


def always(s: ModelSpec, pp: int) -> bool:
    return True


def with_layernorm(s: ModelSpec, pp: int) -> bool:
    return s.normalization == "LayerNorm"


def with_bias(s: ModelSpec, pp: int) -> bool:
    return s.add_bias_linear


def qk_norm_per_head(s: ModelSpec, pp: int) -> bool:
    return s.qk_layernorm and not s.qk_norm_across_heads


def qk_norm_across(s: ModelSpec, pp: int) -> bool:
    return s.qk_layernorm and s.qk_norm_across_heads


def with_shared_gate(s: ModelSpec, pp: int) -> bool:
    return s.moe_shared_expert_gate


def with_expert_bias(s: ModelSpec, pp: int) -> bool:
    return s.moe_router_enable_expert_bias


def q_lora(s: ModelSpec, pp: int) -> bool:
    return s.q_lora_rank is not None


def q_plain(s: ModelSpec, pp: int) -> bool:
    return s.q_lora_rank is None


def hidden_vector(s: ModelSpec, v: int) -> tuple[int, ...]:
    return (s.hidden_size,)


def head_vector(s: ModelSpec, v: int) -> tuple[int, ...]:
    return (s.kv_channels,)


def q_head_dim(s: ModelSpec) -> int:
    return s.qk_head_dim + s.qk_pos_emb_head_dim


def mamba_inner(s: ModelSpec) -> int:
    return s.mamba_num_heads * s.mamba_head_dim


def mamba_in_parts(s: ModelSpec) -> tuple[int, ...]:
    """Mamba-2's in_proj rows: [z; x; B; C; dt] (gate, input, the state's in and out projections per group, a step
    per head), each split over TP by heads and groups."""
    gn = s.mamba_num_groups * s.mamba_state_dim
    return (mamba_inner(s), mamba_inner(s), gn, gn, s.mamba_num_heads)


def mamba_conv_parts(s: ModelSpec) -> tuple[int, ...]:
    """Mamba-2's convolution channels: [x; B; C]."""
    return mamba_in_parts(s)[1:4]


MAMBA_CONV = 4  # the convolution's width (megatron-core's MambaMixer d_conv, which Megatron-LM does not set)
ATTENTIONS, MLPS = (ATTENTION, MLA, GDN), (DENSE, MOE)  # the blocks a layer's input norm / pre-MLP norm serves


def gdn_qk(s: ModelSpec) -> int:
    return s.linear_num_key_heads * s.linear_key_head_dim


def gdn_v(s: ModelSpec) -> int:
    return s.linear_num_value_heads * s.linear_value_head_dim


def gdn_in_parts(s: ModelSpec) -> tuple[int, ...]:
    """Gated DeltaNet's in_proj rows: [q; k; v; z; b; a] (each head-major), each split over TP by heads."""
    return (gdn_qk(s), gdn_qk(s), gdn_v(s), gdn_v(s), s.linear_num_value_heads, s.linear_num_value_heads)


def gdn_conv_parts(s: ModelSpec) -> tuple[int, ...]:
    """Gated DeltaNet's convolution channels: [q; k; v]."""
    return gdn_in_parts(s)[:3]


def qkv_rows(s: ModelSpec) -> int:
    """linear_qkv's rows: per query group its q heads (and, with an output gate, as many gate heads), k and v."""
    gate = s.num_attention_heads if s.attention_output_gate else 0
    return (s.num_attention_heads + gate + 2 * s.num_query_groups) * s.kv_channels
