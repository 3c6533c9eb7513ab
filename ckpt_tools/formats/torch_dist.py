"""Megatron-LM's default form, `--ckpt-format torch_dist` (megatron-core dist_checkpointing over DCP):

    iter_NNNNNNN/metadata.json     {"sharded_backend": "torch_dist", ...}
    iter_NNNNNNN/common.pt         torch.save of the non-sharded state: args, iteration, checkpoint_version
    iter_NNNNNNN/.metadata         every tensor once, by global key: global shape, dtype, chunks (formats/dcp.py)
    iter_NNNNNNN/__<rank>_<n>.distcp   the chunks' bytes (each a torch.save archive at an offset)

Keys are megatron-core's with Transformer Engine's norm names (names.py). A layer's tensors are stacked on a
leading layer axis (`decoder.layers.self_attention.linear_qkv.weight` is [num_layers, ...], global layer
index = offset), or, in non-uniform stacks, kept per layer (`decoder.layers.<i>.<name>`). Each global tensor
is the TP=1 tensor of the layout table (a SwiGLU fc1 is [all gate; all up], QKV grouped), the vocab padded.

The reader presents the checkpoint at the TP x PP its args record: a TP shard is the layout table's split of
the global tensor, assembled from the chunks it overlaps. Chunks are views of the memory-mapped .distcp files,
so a shard that is one chunk (every split but SwiGLU's) costs no copy and can be copied file to file.
"""
from __future__ import annotations

import bisect
import math
import mmap
from pathlib import Path

import torch

from ckpt_tools import io, layout, megatron_lm, names
from ckpt_tools.checkpoint import Meta
from ckpt_tools.errors import FormatError
from ckpt_tools.formats import dcp
from ckpt_tools.shards import Reader

COMMON = "common.pt"
_LAYERS = "decoder.layers."
# entries that hold no model weights: carried by Megatron-LM for its own resume, never an error
_NOT_WEIGHTS = ("rng_state", "optimizer.", "common_state")


def open_torch_dist(iter_dir: Path, vocab_size: int | None = None) -> TorchDistShards:
    common_path = iter_dir / COMMON
    if not common_path.is_file():
        raise FormatError(f"{common_path}: missing: a torch_dist checkpoint keeps Megatron-LM's args there "
                          f"(saves after mid-2026 embed them in the .distcp files, which this version does not "
                          f"read yet); restore common.pt from the source")
    common = io.load_file(common_path, mmap=False)
    args = megatron_lm.args_of(common_path, common)
    spec, tp, pp, counts = megatron_lm.layout_of(common_path, args, vocab_size)
    index = dcp.read_metadata(iter_dir)
    emb = index.tensors.get("embedding.word_embeddings.weight")
    padded = megatron_lm._arg(args, "padded_vocab_size") or (emb.shape[0] if emb is not None else None)
    if padded is None:
        raise FormatError(f"{iter_dir / dcp.METADATA}: no embedding.word_embeddings.weight and no padded_vocab_size "
                          f"in args: not a GPT model checkpoint")
    meta = megatron_lm.meta_of(common_path, iter_dir, args, common, spec, tp, pp, counts, padded, "torch_dist")
    if emb is not None:  # the stored dtype is what the run kept its weights in
        meta.raw["dtypes"]["params"] = emb.dtype
    return TorchDistShards(meta, index)


class TorchDistShards(Reader):
    def __init__(self, meta: Meta, index: dcp.Index):
        super().__init__(meta)
        self.index = index
        self._maps: dict[str, mmap.mmap] = {}
        self._chunks: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self._starts: dict[str, tuple[list[int], list[dcp.Chunk]]] = {}  # chunks of each entry by dim-0 start

    # ------------------------------------------------------------ names
    def entry(self, key: str) -> tuple[dcp.Entry, int | None]:
        """The stored tensor of a global key, and its layer on the stacked axis (None: not stacked)."""
        spec = self.meta.spec
        if key == "output_layer.weight" and key not in self.index.tensors and spec.tie_word_embeddings:
            key = "embedding.word_embeddings.weight"  # a tied output layer is saved as the embedding
        i = layout.layer_index(key)
        if i is None:
            candidates = [(key, None)]
        else:
            rest = names.to_te(key[len(f"{_LAYERS}{i}."):])
            candidates = [(f"{_LAYERS}{i}.{rest}", None), (f"{_LAYERS}{rest}", i)]
        for fqn, layer in candidates:
            if fqn in self.index.tensors:
                return self.index.tensors[fqn], layer
        raise FormatError(f"{self.meta.dir / dcp.METADATA}: no tensor {' or '.join(f for f, _ in candidates)} "
                          f"(for {key}): the checkpoint is not the model its args describe; restore it from the source")

    def _expected_shape(self, key: str, layer: int | None) -> tuple[int, ...]:
        full = layout.full_shape(key, self.meta.spec, self.meta.padded_vocab, self.meta.pp_size)
        return full if layer is None else (self.meta.spec.num_layers,) + full

    # ------------------------------------------------------------ bytes
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
            info = dcp.chunk_info(self.meta.dir, chunk)
            if info.dtype != entry.dtype:
                raise FormatError(f"{self.meta.dir / chunk.file}: chunk of {entry.fqn} at {list(chunk.offsets)} is "
                                  f"{info.dtype}, .metadata says {entry.dtype}: restore the file from the source")
            size = (self.meta.dir / chunk.file).stat().st_size
            if info.offset + info.nbytes > size:
                raise FormatError(f"{self.meta.dir / chunk.file}: {size} bytes, but the chunk of {entry.fqn} at "
                                  f"{list(chunk.offsets)} ends at byte {info.offset + info.nbytes}: the file is "
                                  f"truncated; restore it from the source")
            dtype = getattr(torch, info.dtype)  # chunks need not be aligned to their element size in the file
            t = torch.frombuffer(self._file(chunk.file), dtype=dtype, count=math.prod(info.shape), offset=info.offset)
            self._chunks[slot] = t.view(info.shape)
        return self._chunks[slot]

    def _candidates(self, entry: dcp.Entry, lo: int, hi: int) -> list[dcp.Chunk]:
        """The chunks whose dim-0 range meets [lo, hi)."""
        if entry.fqn not in self._starts:
            ordered = sorted(entry.chunks, key=lambda c: c.offsets[:1])
            self._starts[entry.fqn] = ([c.offsets[0] if c.offsets else 0 for c in ordered], ordered)
        starts, ordered = self._starts[entry.fqn]
        found = ordered[:bisect.bisect_left(starts, hi)]
        return [c for c in found if not c.offsets or c.offsets[0] + c.sizes[0] > lo]

    def _box(self, entry: dcp.Entry, box: list[tuple[int, int]]) -> torch.Tensor:
        """The part [start, stop) per dim of a global tensor: a chunk view when one chunk is exactly it,
        else assembled from the chunks it overlaps (one copy). A part not covered is an error."""
        shape = tuple(b - a for a, b in box)
        hits = []
        for c in self._candidates(entry, *box[0]) if box else entry.chunks:
            inter = [(max(a, o), min(b, o + s)) for (a, b), o, s in zip(box, c.offsets, c.sizes)]
            if all(lo < hi for lo, hi in inter):
                hits.append((c, inter))
        if len(hits) == 1 and hits[0][1] == box:
            c, inter = hits[0]
            t = self._chunk(entry, c)
            return t[tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(inter, c.offsets))]
        out = torch.empty(shape, dtype=getattr(torch, entry.dtype))
        covered = 0
        for c, inter in hits:
            src = self._chunk(entry, c)[tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(inter, c.offsets))]
            out[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(inter, box))] = src
            covered += math.prod(hi - lo for lo, hi in inter)
        if covered != math.prod(shape):
            raise FormatError(f"{self.meta.dir / dcp.METADATA}: {entry.fqn}: the chunks cover {covered} of the "
                              f"{math.prod(shape)} elements of {[list(b) for b in box]} (a chunk is missing): restore "
                              f"the checkpoint from the source")
        return out

    # ------------------------------------------------------------ the reader interface
    def shards(self, global_key: str, field: str | None = None) -> list:
        if field is not None:
            raise FormatError(f"{self.meta.dir}: the optimizer state of a torch_dist checkpoint is not read yet "
                              f"(no {field!r} for {global_key}): use the model weights")
        meta, spec = self.meta, self.meta.spec
        rule = layout.find_rule(global_key, spec, meta.pp_size)
        if rule.split == layout.EXTRA:
            return [None] * meta.tp_size
        entry, layer = self.entry(global_key)
        full = self._expected_shape(global_key, layer)
        if entry.shape != full:
            raise FormatError(f"{meta.dir / dcp.METADATA}: {entry.fqn} has global shape {list(entry.shape)}, the layout "
                              f"table says {list(full)} for this {spec.architecture} model: the args and the weights "
                              f"disagree; restore the checkpoint from the source")
        lead = [] if layer is None else [(layer, layer + 1)]
        full = full[len(lead):]
        out = []
        for rank in range(meta.tp_size):
            pieces = layout.reshard_pieces(global_key, spec, 1, meta.padded_vocab, meta.tp_size, meta.padded_vocab,
                                           rank, meta.pp_size)
            parts = []
            for p in pieces:
                box = lead + [(p.start, p.stop) if d == p.dim else (0, n) for d, n in enumerate(full)]
                part = self._box(entry, box)
                parts.append(part[0] if lead else part)
            out.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=pieces[0].dim))
        self._handed += out
        return out

    def validate(self) -> list[str]:
        """Every tensor the layout table expects, of its global shape and a known dtype, its chunks covering it
        once; no weights beyond the table's; every chunk inside its file."""
        meta, problems, used = self.meta, [], set()
        where = meta.dir / dcp.METADATA
        for key in self.keys():
            if layout.find_rule(key, meta.spec, meta.pp_size).split == layout.EXTRA:
                continue
            try:
                entry, layer = self.entry(key)
            except FormatError as e:
                problems.append(str(e))
                continue
            if entry.fqn in used:
                continue
            used.add(entry.fqn)
            want = self._expected_shape(key, layer)
            if entry.shape != want:
                problems.append(f"{where}: {entry.fqn} has global shape {list(entry.shape)}, the layout table says "
                                f"{list(want)}: the args and the weights disagree; restore the checkpoint")
            problems += [f"{where}: {entry.fqn}: {p}: restore the checkpoint from the source"
                         for p in dcp.coverage_problems(entry)]
            for c in entry.chunks:
                path = meta.dir / c.file
                if not path.is_file():
                    problems.append(f"{path}: missing, but .metadata places {entry.fqn} in it: restore it")
                    break
                if c.blob_offset + c.blob_length > path.stat().st_size:
                    problems.append(f"{path}: {path.stat().st_size} bytes, but the chunk of {entry.fqn} at "
                                    f"{list(c.offsets)} ends at byte {c.blob_offset + c.blob_length}: the file is "
                                    f"truncated; restore it from the source")
                    break
        extra = [f for f in self.index.tensors if f not in used and not f.startswith(_NOT_WEIGHTS)]
        if extra:
            problems.append(f"{where}: {len(extra)} tensor(s) not in the layout table of this {meta.spec.architecture} "
                            f"model ({', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}): a feature this version "
                            f"does not read (experts, extra heads); the checkpoint cannot be converted without them")
        return problems

    def close(self) -> None:
        self._chunks.clear()
        self._starts.clear()
        self._maps.clear()  # each mapping goes with the last tensor over it
        super().close()
