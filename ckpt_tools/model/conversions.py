"""The conversion kinds: a full megatron-core tensor <-> its HF tensor(s) (a family's `Name` rows name the kind).

Each kind is a small class (`KINDS` maps the families' names to them): the row ranges of the full tensor each HF
tensor is made of (`hf_rows`, plain Python: the torch-free merge copies them as byte ranges), transposed for a
TRANSPOSED kind; an ARITHMETIC kind's values differ too: the byte paths have torch make those tensors alone, one by
one, and copy the rest (the imports: verbs/hf_copy.made_by_torch; the merge: forms/byte_ranges.ByteSource._made).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ckpt_tools.errors import LayoutError
from ckpt_tools.model import shard_ops
from ckpt_tools.model.families import (C_ATTN, CONV1D, GATE_UP_T, GATED, GDN_IN, NORM_OFFSET, QKV, QKV_FUSED, QKV_GATED,
                                       SAME, VOCAB)
from ckpt_tools.model.rules import gdn_in_parts
from ckpt_tools.model.spec import ModelSpec

if TYPE_CHECKING:
    import torch


class Kind:
    """A conversion kind: the row ranges of the full megatron-core tensor each HF tensor is made of (`rows`, plain
    Python), and the tensors both ways. The base class is one HF tensor holding the full tensor as it is."""
    transposed = False  # HF stores a 2-D tensor [in, out] (GPT-2's Conv1D, GPT-OSS's experts): transposed rows
    arithmetic = False  # HF's values are not megatron-core's (not copied as bytes: see the module's docstring)

    def rows(self, spec: ModelSpec, rows: int) -> list[shard_ops.Rows]:
        return [[(0, rows)]]

    def to_hf(self, full: torch.Tensor, spec: ModelSpec) -> list[torch.Tensor]:
        parts = [full if rows == [(0, full.shape[0])] else shard_ops.take_rows(full, rows)
                 for rows in self.rows(spec, full.shape[0])]
        return [t.t() if self.transposed and t.dim() == 2 else t for t in parts]

    def from_hf(self, tensors: list[torch.Tensor], spec: ModelSpec, padded_vocab: int) -> torch.Tensor:
        return tensors[0]


class NormOffset(Kind):
    """A norm HF stores as 1 + megatron-core's weight."""
    arithmetic = True

    def to_hf(self, full, spec):
        return [full + 1]

    def from_hf(self, tensors, spec, padded_vocab):
        return tensors[0] - 1  # exact for weights in [0.5, 2] (Sterbenz), as the way back is


class Vocab(Kind):
    """An embedding or output layer: HF holds the true vocab's rows, megatron-core pads them."""

    def rows(self, spec, rows):
        return [[(0, spec.vocab_size)]]

    def to_hf(self, full, spec):  # refuses a tensor with fewer rows than the true vocab
        return [shard_ops.trim_vocab("embedding.word_embeddings.weight", full, spec)]

    def from_hf(self, tensors, spec, padded_vocab):
        return shard_ops.pad_vocab("embedding.word_embeddings.weight", tensors[0], spec, padded_vocab)


class Qkv(Kind):
    """q, k and v as three HF tensors; megatron-core interleaves them per query group."""

    def rows(self, spec, rows):
        return list(shard_ops.qkv_head_rows(spec))

    def from_hf(self, tensors, spec, padded_vocab):
        return shard_ops.qkv_join_heads(*tensors, spec)


class Gated(Kind):
    """A SwiGLU fc1 as HF's gate and up tensors: [gate; up]."""

    def rows(self, spec, rows):
        return [[(0, rows // 2)], [(rows // 2, rows)]]

    def from_hf(self, tensors, spec, padded_vocab):
        import torch
        return torch.cat(tensors, dim=0)


class Conv1d(Kind):
    """GPT-2's Conv1D weight, [in, out]."""
    transposed = True

    def from_hf(self, tensors, spec, padded_vocab):
        return tensors[0].t()


class GateUpT(Kind):
    """GPT-OSS's experts' gate_up, [in, out] with gate and up columns alternating: gate 0, up 0, gate 1, up 1, ..."""
    transposed = True

    def rows(self, spec, rows):
        return [[(r, r + 1) for j in range(rows // 2) for r in (j, rows // 2 + j)]]

    def from_hf(self, tensors, spec, padded_vocab):
        import torch
        rows = tensors[0].t() if tensors[0].dim() == 2 else tensors[0]
        return torch.cat([rows[0::2], rows[1::2]], dim=0)


class QkvFused(Kind):
    """One HF tensor [q; k; v] (each head-major); megatron-core interleaves them per query group."""

    def rows(self, spec, rows):
        return [[r for part in shard_ops.qkv_head_rows(spec) for r in part]]

    def from_hf(self, tensors, spec, padded_vocab):
        whole = tensors[0].t() if self.transposed and tensors[0].dim() == 2 else tensors[0]
        q_rows = spec.num_attention_heads * spec.kv_channels
        q, k, v = whole.split([q_rows, (whole.shape[0] - q_rows) // 2, (whole.shape[0] - q_rows) // 2], dim=0)
        return shard_ops.qkv_join_heads(q, k, v, spec)


class CAttn(QkvFused):
    """GPT-2's c_attn: QkvFused as a Conv1D weight, [in, out]."""
    transposed = True


class Placed(Kind):
    """HF tensors whose rows go to scattered places of the full tensor: each range placed where `rows` says."""

    def from_hf(self, tensors, spec, padded_vocab):
        layout_rows = self.rows(spec, sum(t.shape[0] for t in tensors))
        full = tensors[0].new_empty((sum(t.shape[0] for t in tensors),) + tuple(tensors[0].shape[1:]))
        for t, rows in zip(tensors, layout_rows):
            at = 0
            for a, b in rows:
                full[a:b] = t[at:at + b - a]
                at += b - a
        return full


class QkvGated(Placed):
    """Qwen3-Next's gated attention: q_proj head by head [q_h; gate_h], then k and v."""

    def rows(self, spec, rows):
        q, k, v = shard_ops.qkv_head_rows(spec)
        hpg, d = spec.heads_per_group, spec.kv_channels
        heads = [(a + j * d, a + (j + 1) * d) for a, _ in q for j in range(hpg)]
        gates = [(a + j * d, a + (j + 1) * d) for a, _ in shard_ops.qkv_gate_rows(spec) for j in range(hpg)]
        return [[r for pair in zip(heads, gates) for r in pair], k, v]


class GdnIn(Placed):
    """transformers' in_proj_qkvz and in_proj_ba (per key head: [q; k; v; z] of its value heads, then [b; a]) as rows
    of megatron-core's in_proj [q; k; v; z; b; a] (each head-major)."""

    def rows(self, spec, rows):
        nk, dk, dv = spec.linear_num_key_heads, spec.linear_key_head_dim, spec.linear_value_head_dim
        per = spec.linear_num_value_heads // nk  # value heads per key head
        starts = [sum(gdn_in_parts(spec)[:j]) for j in range(6)]  # the table's parts: q, k, v, z, b, a
        widths = (dk, dk, per * dv, per * dv, per, per)  # each key head's share of each part
        by_head = [[(starts[j] + g * widths[j], starts[j] + (g + 1) * widths[j]) for j in parts]
                   for g in range(nk) for parts in ((0, 1, 2, 3), (4, 5))]
        return [[r for g in by_head[0::2] for r in g], [r for g in by_head[1::2] for r in g]]


# the families' kind names (a `Name` row's kind) -> the kind; a new kind is a class and a line here
KINDS: dict[str, Kind] = {SAME: Kind(), NORM_OFFSET: NormOffset(), VOCAB: Vocab(), QKV: Qkv(), GATED: Gated(),
                          CONV1D: Conv1d(), GATE_UP_T: GateUpT(), QKV_FUSED: QkvFused(), C_ATTN: CAttn(),
                          QKV_GATED: QkvGated(), GDN_IN: GdnIn()}
TRANSPOSED = tuple(name for name, kind in KINDS.items() if kind.transposed)
ARITHMETIC = tuple(name for name, kind in KINDS.items() if kind.arithmetic)


def _kind(name: str) -> Kind:
    if name not in KINDS:
        raise LayoutError(f"unknown conversion kind {name}")
    return KINDS[name]


def hf_rows(kind: str, spec: ModelSpec, rows: int) -> list[shard_ops.Rows]:
    """For each HF tensor of a conversion kind, the row ranges of the full megatron-core tensor (of `rows`
    rows) that it is made of, in order; a TRANSPOSED kind then transposes a 2-D result."""
    return _kind(kind).rows(spec, rows)


def hf_shapes(kind: str, spec: ModelSpec, full_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The shapes of the tensors that to_hf makes of a full tensor of `full_shape`."""
    shapes = [(sum(b - a for a, b in rows),) + tuple(full_shape[1:]) for rows in hf_rows(kind, spec, full_shape[0])]
    return [s[::-1] if _kind(kind).transposed and len(s) == 2 else s for s in shapes]


def to_hf(kind: str, full: torch.Tensor, spec: ModelSpec) -> list[torch.Tensor]:
    """A full megatron-core tensor -> its HF tensor(s). Works on meta tensors (shape planning)."""
    return _kind(kind).to_hf(full, spec)


def from_hf(kind: str, tensors: list[torch.Tensor], spec: ModelSpec, padded_vocab: int) -> torch.Tensor:
    """Inverse of to_hf; vocab tensors come back padded to `padded_vocab` with zero rows."""
    return _kind(kind).from_hf(tensors, spec, padded_vocab)
