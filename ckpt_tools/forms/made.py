"""Tensors a source's torch reader makes, given to the writers of reshard as byte_index.Shard's are: `MadeShard`, one
TP shard's bytes in memory, and `MadeFields`, one optimizer field (or the weights) of every parameter, made parameter
by parameter (byte_ranges.ByteSource: `made_fields`, `made_target_shard`).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ckpt_tools.model import layout, shard_ops

if TYPE_CHECKING:
    from ckpt_tools.forms.byte_ranges import ByteSource


class MadeShard:
    """A TP shard made in memory (by the source's torch reader), read as a byte_index.Shard is: its rows' bytes."""

    def __init__(self, t):
        from ckpt_tools.forms.writers import contiguous_bytes, dtype_name
        self.dtype, self.rows, self.data = dtype_name(t.dtype), t.shape[0] if t.dim() else 1, contiguous_bytes(t)

    @property
    def whole(self) -> list[memoryview]:
        return [self.data]

    def byte_ranges(self, start: int, stop: int) -> list[memoryview]:
        row = len(self.data) // self.rows
        return [self.data[start * row:stop * row]]


class MadeFields:
    """One optimizer field of a source, decoded by its torch reader (None: the weights): each parameter's TP shards (at
    the source's TP), made when asked, the last parameter's kept. Replicated parameters' shards must agree (the torch
    path's check, shard_ops.join). `tensors` gives them as torch made them, `[key]` as MadeShards (the byte copies
    into torch_dist take them as they take a source's shards)."""

    def __init__(self, source: ByteSource, field: str):
        self.source, self.field = source, field
        self._key, self._tensors, self._shards = None, [], []

    def tensors(self, key: str) -> list:
        if key != self._key:
            meta = self.source.meta
            tensors = self.source.maker.shards(key, self.field)
            if self.field != "step" and layout.is_replicated(key, meta.spec, meta.pp_size):  # None: the weights
                shard_ops.join(key, tensors, meta.spec, meta.pp_size)  # raises where the replicas differ
            self._key, self._tensors, self._shards = key, tensors, []
        return self._tensors

    def __getitem__(self, key: str) -> list[MadeShard]:
        tensors = self.tensors(key)
        if not self._shards:
            self._shards = [MadeShard(t) for t in tensors]
        return self._shards

    def shard(self, key: str, held: str, rank: int, tp: int, padded: int, pp: int) -> tuple[str, tuple, list]:
        """Target TP rank `rank`'s shard of `key` (`held`: the parameter that holds it) at TP `tp`: the layout table's
        pieces of the source shards gathered (new vocab padding rows zero) into the source's reused buffer, a
        replicated tensor joined: dtype, shape and its bytes, valid until the next tensor is made (the writers write
        each tensor as it is given)."""
        import torch

        from ckpt_tools.forms.writers import contiguous_bytes, dtype_name
        meta, source = self.source.meta, self.source

        def empty(shape: tuple[int, ...], dtype):
            numel = math.prod(shape)
            if not numel:
                return torch.empty(shape, dtype=dtype)
            data = source.buffer(numel * torch.empty((), dtype=dtype).element_size())
            return torch.frombuffer(data, dtype=dtype, count=numel).view(shape)
        tensors = self.tensors(held)
        if layout.find_rule(key, meta.spec, pp).dim is None:
            t = shard_ops.join(held, tensors, meta.spec, meta.pp_size)
        else:
            pieces = shard_ops.reshard_pieces(key, meta.spec, meta.tp_size, meta.padded_vocab, tp, padded, rank, pp)
            t = shard_ops.gather(pieces, tensors, empty)
        return dtype_name(t.dtype), tuple(t.shape), [contiguous_bytes(t)]
