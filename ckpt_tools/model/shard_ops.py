"""Applies the layout table's rules (ckpt_tools.model.layout) to tensors: split / join, a reshard's pieces of the source
shards and their gathering, vocab padding, and grouped QKV <-> separate q, k, v.

The table stays the one place that knows how each tensor is sharded: every function here asks it for the rule
(`layout.find_rule`) and only carries it out. `split()` and `join()` are bit-exact inverses for every row.
Pieces and QKV head rows are plain Python; torch is imported only by the functions that move tensors, so
merge's torch-free byte source (ckpt_tools.forms.byte_ranges) uses them too.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckpt_tools.errors import LayoutError
from ckpt_tools.model.layout import EXTRA, REPLICATED, VOCAB, check_divides, find_rule
from ckpt_tools.model.spec import ModelSpec

if TYPE_CHECKING:
    import torch


# ---------------------------------------------------------------- split / join
def split(key: str, full, spec: ModelSpec, tp_size: int, pp_size: int = 1) -> list:
    """The full tensor -> its TP shards, rank order. Shards are views of `full` where possible."""
    import torch
    rule = find_rule(key, spec, pp_size)
    if rule.split == EXTRA:
        return [full] * tp_size
    if rule.split == REPLICATED:
        return [full] * tp_size
    check_divides(key, rule, spec, full.shape[rule.dim], tp_size)
    parts = rule.part_sizes(spec, full.shape[rule.dim])
    if len(parts) > 1:  # gated / blocked: rank r holds its chunk of each part, in part order
        chunks = [p.chunk(tp_size, 0) for p in full.split(parts, dim=0)]
        return [torch.cat([c[r] for c in chunks], dim=0) for r in range(tp_size)]
    return list(full.chunk(tp_size, dim=rule.dim))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality: NaN equals an identical NaN, -0.0 differs from 0.0, dtypes must match."""
    import torch
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def join(key: str, shards: Sequence, spec: ModelSpec, pp_size: int = 1, check_replicas: bool = True):
    """TP shards (rank order) -> the full tensor. Replicated shards must agree bit for bit."""
    import torch
    rule = find_rule(key, spec, pp_size)
    if rule.split == EXTRA:
        return shards[0]
    if rule.split == REPLICATED:
        if check_replicas:
            for rank, s in enumerate(shards[1:], start=1):
                if not same_bits(s, shards[0]):
                    raise LayoutError(f"{key}: replicated tensor differs between TP rank 0 and TP rank {rank}: "
                                      f"the shards do not come from one consistent checkpoint")
        return shards[0]
    parts = rule.part_sizes(spec, sum(s.shape[rule.dim] for s in shards))
    if len(parts) > 1:
        local = [p // len(shards) for p in parts]
        pieces = [s.split(local, dim=0) for s in shards]
        return torch.cat([p[j] for j in range(len(parts)) for p in pieces], dim=0)
    return torch.cat(list(shards), dim=rule.dim)


# ---------------------------------------------------------------- reshard without the full tensor
@dataclass(frozen=True)
class Piece:
    """Indices [start, stop) along `dim` of source TP rank `rank`'s shard; rank None: zeros (new vocab padding)."""
    rank: int | None
    dim: int
    start: int
    stop: int


def _runs(begin: int, end: int, shard_len: int, offset: int, dim: int) -> list[Piece]:
    """Full-tensor indices [begin, end) of a tensor chunked in `shard_len` runs, cut at shard edges;
    `offset` is where the run starts inside each source shard (the up half of a gated shard)."""
    out = []
    while begin < end:
        rank, local = divmod(begin, shard_len)
        stop = min(end, (rank + 1) * shard_len)
        out.append(Piece(rank, dim, offset + local, offset + local + stop - begin))
        begin = stop
    return out


def reshard_pieces(key: str, spec: ModelSpec, src_tp: int, src_padded: int, tp: int, padded: int, rank: int,
                   pp_size: int = 1) -> list[Piece]:
    """Target TP rank `rank`'s shard of `key` (TP `tp`, padded vocab `padded`) as pieces of the source shards
    (TP `src_tp`, `src_padded`), in order along the split dim: the same tensor as split(join(...)),
    re-padded as pad_vocab does when the padded vocab changes. Replicated and extra-state keys are
    rank 0's whole shard. One piece on dim 0 is a contiguous byte range of one source shard."""
    rule = find_rule(key, spec, pp_size)
    src_shape = rule.shape(spec, src_padded) if rule.shape is not None else None
    if rule.dim is None:
        return [Piece(0, 0, 0, src_shape[0] if src_shape else 0)]
    dim, size = rule.dim, rule.shape(spec, padded)[rule.dim]
    check_divides(key, rule, spec, size, tp)
    check_divides(key, rule, spec, src_shape[dim], src_tp)
    parts = rule.part_sizes(spec, size)
    if len(parts) > 1:  # each part's run of the target rank, from the same part of the source shards
        out, src_offset = [], 0
        for part in parts:
            mine, src_local = part // tp, part // src_tp
            out += _runs(rank * mine, (rank + 1) * mine, src_local, src_offset, 0)
            src_offset += src_local
        return out
    begin, end = rank * size // tp, (rank + 1) * size // tp
    if rule.split == VOCAB and padded != src_padded:  # rows beyond the true vocab become zeros
        keep = min(end, spec.vocab_size)
        zeros = [Piece(None, 0, max(begin, keep), end)] if end > keep else []
        return _runs(begin, keep, src_shape[0] // src_tp, 0, 0) + zeros
    return _runs(begin, end, src_shape[dim] // src_tp, 0, dim)


def gather_parts(pieces: Sequence[Piece], shards: Sequence) -> list:
    """The parts that `pieces` name, in order: views of the source shards (a dim-0 range of a shard is
    contiguous), zeros for new vocab padding."""
    import torch
    parts = []
    for p in pieces:
        if p.rank is None:
            shape = list(shards[0].shape)
            shape[p.dim] = p.stop - p.start
            parts.append(shards[0].new_zeros(shape))
        else:
            src = shards[p.rank]
            whole = not torch.is_tensor(src) or src.dim() == 0 or (p.start, p.stop) == (0, src.shape[p.dim])
            parts.append(src if whole else src.narrow(p.dim, p.start, p.stop - p.start))
    return parts


def gather(pieces: Sequence[Piece], shards: Sequence, out: Callable | None = None):
    """The tensor that `pieces` describe, from the source shards: a view when one contiguous piece, else
    one copy, into `out(shape, dtype)` (a reused buffer) when given."""
    import torch
    parts = gather_parts(pieces, shards)
    if len(parts) == 1 and (out is None or parts[0].is_contiguous()):
        return parts[0]
    if out is None:
        return torch.cat(parts, dim=pieces[0].dim)
    shape = list(parts[0].shape)
    shape[pieces[0].dim] = sum(p.shape[pieces[0].dim] for p in parts)
    return torch.cat(parts, dim=pieces[0].dim, out=out(tuple(shape), parts[0].dtype))


# ---------------------------------------------------------------- vocab padding
def pad_vocab(key: str, full: torch.Tensor, spec: ModelSpec, padded_vocab: int) -> torch.Tensor:
    """Re-pad a vocab tensor to `padded_vocab` rows: true rows kept, rows beyond the true vocab zero."""
    _require(key, spec, VOCAB)
    if full.shape[0] < spec.vocab_size or padded_vocab < spec.vocab_size:
        raise LayoutError(f"{key}: cannot pad {full.shape[0]} rows to {padded_vocab} for a true vocab of "
                          f"{spec.vocab_size}: both must be >= the true vocab; check the recorded vocab size")
    out = full.new_zeros((padded_vocab,) + tuple(full.shape[1:]))
    out[: spec.vocab_size] = full[: spec.vocab_size]
    return out


def trim_vocab(key: str, full: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """Drop the padding rows: only the true vocab leaves the toolkit."""
    _require(key, spec, VOCAB)
    if full.shape[0] < spec.vocab_size:
        raise LayoutError(f"{key}: {full.shape[0]} rows, fewer than the true vocab {spec.vocab_size}: "
                          f"the recorded vocab size is wrong (pass the right one with --vocab-size)")
    return full[: spec.vocab_size]


def _require(key: str, spec: ModelSpec, kind: str) -> None:
    rule = find_rule(key, spec, pp_size=None)
    if rule.split != kind:
        raise LayoutError(f"{key}: is a {rule.split} tensor, not {kind}")


# ---------------------------------------------------------------- grouped QKV <-> separate q, k, v
Rows = list[tuple[int, int]]  # row ranges [start, stop) of a full tensor, in order


def qkv_head_rows(spec: ModelSpec) -> tuple[Rows, Rows, Rows]:
    """The rows of q, k and v in a full grouped QKV tensor (weight or bias), each in head order: per query
    group its q heads, then its k, then its v. HF's q_proj / k_proj / v_proj are these rows concatenated.
    The one place that knows the grouping: the torch functions below and the torch-free merge use it."""
    g, hpg, d = spec.num_query_groups, spec.heads_per_group, spec.kv_channels
    gate = hpg * d if spec.attention_output_gate else 0  # a gated attention's gate heads follow each group's q heads
    group = (2 * hpg + 2) * d if gate else (hpg + 2) * d
    q = [(i * group, i * group + hpg * d) for i in range(g)]
    k = [(stop + gate, stop + gate + d) for _, stop in q]
    v = [(stop, stop + d) for _, stop in k]
    return q, k, v


def qkv_gate_rows(spec: ModelSpec) -> Rows:
    """A gated attention's gate rows in the full QKV tensor, head by head (after each group's q heads)."""
    return [(stop, stop + spec.heads_per_group * spec.kv_channels) for _, stop in qkv_head_rows(spec)[0]]


def take_rows(full: torch.Tensor, rows: Rows) -> torch.Tensor:
    """The rows of `full` named by `rows`, concatenated along dim 0 (a view for a single range)."""
    import torch
    parts = [full[a:b] for a, b in rows]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


def qkv_split_heads(full: torch.Tensor, spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full grouped QKV (weight or bias) -> q, k, v with heads in order (HF's q_proj/k_proj/v_proj)."""
    q, k, v = (take_rows(full, rows) for rows in qkv_head_rows(spec))
    return q, k, v


def qkv_join_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """Inverse of qkv_split_heads: each row range of q, k and v back to its place in the grouped tensor."""
    import torch
    placed = []
    for part, rows in zip((q, k, v), qkv_head_rows(spec)):
        pos = 0
        for start, stop in rows:
            placed.append((start, part[pos:pos + stop - start]))
            pos += stop - start
    return torch.cat([t for _, t in sorted(placed, key=lambda x: x[0])], dim=0)
