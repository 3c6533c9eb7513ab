"""The conversion kinds: a full megatron-core tensor <-> its HF tensor(s) (a family's `Name` rows name the kind).

Each kind is the row ranges of the full tensor each HF tensor is made of (`hf_rows`, plain Python: the torch-free merge
copies them as byte ranges), transposed for a TRANSPOSED kind; an ARITHMETIC kind's values differ too (the byte-copy
merge and the legacy-form and ours imports decline a model holding one; the torch_dist import has torch make those
tensors alone: formats/hf_copy.made_by_torch).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ckpt_tools import shard_ops
from ckpt_tools.errors import LayoutError
from ckpt_tools.families import (C_ATTN, CONV1D, GATE_UP_T, GATED, GDN_IN, NORM_OFFSET, QKV, QKV_FUSED, QKV_GATED,
                                 SAME, VOCAB)
from ckpt_tools.rules import gdn_in_parts
from ckpt_tools.spec import ModelSpec

if TYPE_CHECKING:
    import torch


# HF GPT-2's Conv1D (and GPT-OSS's experts) store a weight [in, out]: these kinds' 2-D tensors are transposed
TRANSPOSED = (CONV1D, C_ATTN, GATE_UP_T)


def hf_rows(kind: str, spec: ModelSpec, rows: int) -> list[shard_ops.Rows]:
    """For each HF tensor of a conversion kind, the row ranges of the full megatron-core tensor (of `rows`
    rows) that it is made of, in order; a TRANSPOSED kind then transposes a 2-D result."""
    if kind in (SAME, CONV1D, NORM_OFFSET):
        return [[(0, rows)]]
    if kind == QKV_GATED:  # q_proj head by head [q_h; gate_h], then k and v
        q, k, v = shard_ops.qkv_head_rows(spec)
        hpg, d = spec.heads_per_group, spec.kv_channels
        heads = [(a + j * d, a + (j + 1) * d) for a, _ in q for j in range(hpg)]
        gates = [(a + j * d, a + (j + 1) * d) for a, _ in shard_ops.qkv_gate_rows(spec) for j in range(hpg)]
        return [[r for pair in zip(heads, gates) for r in pair], k, v]
    if kind == GDN_IN:
        return _gdn_in_rows(spec)
    if kind == VOCAB:
        return [[(0, spec.vocab_size)]]
    if kind == QKV:
        return list(shard_ops.qkv_head_rows(spec))
    if kind == GATED:  # [gate; up]
        return [[(0, rows // 2)], [(rows // 2, rows)]]
    if kind == GATE_UP_T:  # gate 0, up 0, gate 1, up 1, ...
        return [[(r, r + 1) for j in range(rows // 2) for r in (j, rows // 2 + j)]]
    if kind in (C_ATTN, QKV_FUSED):
        return [[r for part in shard_ops.qkv_head_rows(spec) for r in part]]
    raise LayoutError(f"unknown conversion kind {kind}")


def _gdn_in_rows(spec: ModelSpec) -> list[shard_ops.Rows]:
    """transformers' in_proj_qkvz and in_proj_ba (per key head: [q; k; v; z] of its value heads, then [b; a]) as rows
    of megatron-core's in_proj [q; k; v; z; b; a] (each head-major)."""
    nk, dk, dv = spec.linear_num_key_heads, spec.linear_key_head_dim, spec.linear_value_head_dim
    per = spec.linear_num_value_heads // nk  # value heads per key head
    starts = [sum(gdn_in_parts(spec)[:j]) for j in range(6)]  # the table's parts: q, k, v, z, b, a
    widths = (dk, dk, per * dv, per * dv, per, per)  # each key head's share of each part
    rows = [[(starts[j] + g * widths[j], starts[j] + (g + 1) * widths[j]) for j in parts]
            for g in range(nk) for parts in ((0, 1, 2, 3), (4, 5))]
    return [[r for g in rows[0::2] for r in g], [r for g in rows[1::2] for r in g]]


# kinds whose HF values are not megatron-core's bytes (not copied as bytes: see the module's docstring)
ARITHMETIC = (NORM_OFFSET,)


def hf_shapes(kind: str, spec: ModelSpec, full_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The shapes of the tensors that to_hf makes of a full tensor of `full_shape`."""
    shapes = [(sum(b - a for a, b in rows),) + tuple(full_shape[1:]) for rows in hf_rows(kind, spec, full_shape[0])]
    return [s[::-1] if kind in TRANSPOSED and len(s) == 2 else s for s in shapes]


def to_hf(kind: str, full: torch.Tensor, spec: ModelSpec) -> list[torch.Tensor]:
    """A full megatron-core tensor -> its HF tensor(s). Works on meta tensors (shape planning)."""
    if kind == VOCAB:  # refuses a tensor with fewer rows than the true vocab
        return [shard_ops.trim_vocab("embedding.word_embeddings.weight", full, spec)]
    if kind == NORM_OFFSET:
        return [full + 1]
    parts = [full if rows == [(0, full.shape[0])] else shard_ops.take_rows(full, rows)
             for rows in hf_rows(kind, spec, full.shape[0])]
    return [t.t() if kind in TRANSPOSED and t.dim() == 2 else t for t in parts]


def from_hf(kind: str, tensors: list[torch.Tensor], spec: ModelSpec, padded_vocab: int) -> torch.Tensor:
    """Inverse of to_hf; vocab tensors come back padded to `padded_vocab` with zero rows."""
    if kind == SAME:
        return tensors[0]
    if kind == NORM_OFFSET:  # exact for weights in [0.5, 2] (Sterbenz), as the way back is
        return tensors[0] - 1
    if kind in (QKV_GATED, GDN_IN):  # each HF tensor's rows to their places
        layout_rows = hf_rows(kind, spec, sum(t.shape[0] for t in tensors))
        full = tensors[0].new_empty((sum(t.shape[0] for t in tensors),) + tuple(tensors[0].shape[1:]))
        for t, rows in zip(tensors, layout_rows):
            at = 0
            for a, b in rows:
                full[a:b] = t[at:at + b - a]
                at += b - a
        return full
    if kind == VOCAB:
        return shard_ops.pad_vocab("embedding.word_embeddings.weight", tensors[0], spec, padded_vocab)
    if kind == QKV:
        return shard_ops.qkv_join_heads(*tensors, spec)
    if kind == GATED:
        import torch
        return torch.cat(tensors, dim=0)
    if kind == CONV1D:
        return tensors[0].t()
    if kind == GATE_UP_T:
        import torch
        rows = tensors[0].t() if tensors[0].dim() == 2 else tensors[0]
        return torch.cat([rows[0::2], rows[1::2]], dim=0)
    if kind in (C_ATTN, QKV_FUSED):
        whole = tensors[0].t() if kind == C_ATTN and tensors[0].dim() == 2 else tensors[0]
        q_rows = spec.num_attention_heads * spec.kv_channels
        q, k, v = whole.split([q_rows, (whole.shape[0] - q_rows) // 2, (whole.shape[0] - q_rows) // 2], dim=0)
        return shard_ops.qkv_join_heads(q, k, v, spec)
    raise LayoutError(f"unknown conversion kind {kind}")
