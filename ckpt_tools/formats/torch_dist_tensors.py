"""The tensors of a torch_dist checkpoint (formats/torch_dist.py plans which parts each TP shard is): chunks
are views of the privately mapped .distcp files (zero copy, their pages released like any shard's); a TP shard
that is exactly one chunk is that view, one made of several (SwiGLU's [gate_r; up_r]) is assembled.
"""
from __future__ import annotations

import math
import mmap
from pathlib import Path

import torch

from ckpt_tools import layout
from ckpt_tools.errors import FormatError
from ckpt_tools.formats import dcp
from ckpt_tools.formats.torch_dist import Box, DistCheckpoint
from ckpt_tools.shards import Reader


def open_torch_dist(iter_dir: Path, vocab_size: int | None = None) -> TorchDistShards:
    return TorchDistShards(DistCheckpoint.read(iter_dir, vocab_size))


class TorchDistShards(Reader):
    def __init__(self, ckpt: DistCheckpoint):
        super().__init__(ckpt.meta)
        self.ckpt = ckpt
        self._maps: dict[str, mmap.mmap] = {}
        self._chunks: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def _file(self, name: str) -> mmap.mmap:
        if name not in self._maps:
            path = self.meta.dir / name
            with open(path, "rb") as f:  # private, copy-on-write: tensors over it are writable, the file never is
                self._maps[name] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            self._map(path)
        return self._maps[name]

    def _chunk(self, entry: dcp.Entry, chunk: dcp.Chunk) -> torch.Tensor:
        slot = (entry.fqn, chunk.offsets)
        if slot not in self._chunks:
            info = self.ckpt.chunk_info(entry, chunk)
            dtype = getattr(torch, info.dtype)  # chunks need not be aligned to their element size in the file
            t = torch.frombuffer(self._file(chunk.file), dtype=dtype, count=math.prod(info.shape), offset=info.offset)
            self._chunks[slot] = t.view(info.shape)
        return self._chunks[slot]

    def _box(self, entry: dcp.Entry, box: Box) -> torch.Tensor:
        """A part of a stored tensor: a chunk view when one chunk is exactly it, else assembled (one copy)."""
        hits = self.ckpt.hits(entry, box)
        if len(hits) == 1 and hits[0][1] == box:
            c, inter = hits[0]
            return self._chunk(entry, c)[tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(inter, c.offsets))]
        out = torch.empty(tuple(b - a for a, b in box), dtype=getattr(torch, entry.dtype))
        for c, inter in hits:
            src = self._chunk(entry, c)[tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(inter, c.offsets))]
            out[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(inter, box))] = src
        return out

    def shards(self, global_key: str, field: str | None = None) -> list:
        if field is not None:
            raise FormatError(f"{self.meta.dir}: the optimizer state of a torch_dist checkpoint is not read yet "
                              f"(no {field!r} for {global_key}): use the model weights")
        meta = self.meta
        if layout.find_rule(global_key, meta.spec, meta.pp_size).split == layout.EXTRA:
            return [None] * meta.tp_size
        out = []
        for rank in range(meta.tp_size):
            entry, boxes, dim, stacked = self.ckpt.rank_boxes(global_key, rank)
            parts = [self._box(entry, box) for box in boxes]
            parts = [p[0] for p in parts] if stacked else parts
            out.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim))
        self._handed += out
        return out

    def validate(self) -> list[str]:
        return self.ckpt.validate()

    def unread_optimizer(self) -> str | None:
        n = sum(1 for f in self.ckpt.index.tensors if f.startswith("optimizer."))
        return f"torch_dist optimizer state ({n} optimizer.* tensors)" if n else None

    def close(self) -> None:
        self._chunks.clear()
        self._maps.clear()  # each mapping goes with the last tensor over it
        super().close()
