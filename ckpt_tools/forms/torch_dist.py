"""Megatron-LM's default form, `--ckpt-format torch_dist` (megatron-core dist_checkpointing over DCP):

    iter_NNNNNNN/metadata.json     {"sharded_backend": "torch_dist", ...}
    iter_NNNNNNN/common.pt         torch.save of the non-sharded state: args, iteration, checkpoint_version (up to
                                   megatron-core 0.18; since 0.19 it is the byte entry `common_state/shard_0_1` in
                                   the .distcp files, a torch.save of the one-element list [state])
    iter_NNNNNNN/.metadata         every tensor once, by global key: global shape, dtype, chunks (forms/dcp.py)
    iter_NNNNNNN/__<rank>_<n>.distcp   the chunks' bytes (each a torch.save archive at an offset)

Keys are megatron-core's with Transformer Engine's norm names (names.py). A layer's tensors are stacked on a
leading layer axis (`decoder.layers.self_attention.linear_qkv.weight` is [num_layers, ...], global layer
index = offset), or, in non-uniform stacks, kept per layer (`decoder.layers.<i>.<name>`). An MoE layer's experts
are stacked on a second axis (`decoder.layers.mlp.experts.experts.linear_fc1.weight` is [num_layers, num_experts,
...], global expert index = offset, whatever the EP split; megatron-core's grouped-GEMM experts save the same), and
its pre-MLP norm is not fused into fc1 under Transformer Engine (`decoder.layers.pre_mlp_layernorm.weight`; the local
spec still saves it under the fused name). Each global tensor
is the TP=1 tensor of the layout table (a SwiGLU fc1 is [all gate; all up], QKV grouped), the vocab padded.

The reader presents the checkpoint at the TP x PP its args record: a TP shard is the layout table's split of
the global tensor, assembled from the chunks it overlaps. Chunks are views of the memory-mapped .distcp files,
so a shard that is one chunk (every split but SwiGLU's) costs no copy and can be copied file to file.

This module plans without torch (the names, the parts of each TP shard, the checks), so the torch-free merge
reads the same plan; forms/torch_dist_tensors.py makes the tensors.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from ckpt_tools import io
from ckpt_tools.errors import ConfigError, FormatError
from ckpt_tools.forms import dcp, megatron_lm, megatron_spec
from ckpt_tools.forms.checkpoint import Meta
from ckpt_tools.forms.dcp_common import COMMON, read_common, read_dcp_common
from ckpt_tools.model import hybrid, layout, shard_ops
from ckpt_tools.model.rules import GATED

OPT_STATE, OPT_BUCKETS = "optimizer.state.", "optimizer.distributed."
PER_PARAM, BUCKETS = "per-parameter", "dp_reshardable buckets"
DCP_PLAIN = "optimizer.state_dict()"  # torch_dcp: megatron-core's non-distributed optimizer's, Adam state by index
# torch_dcp: Float16OptimizerWithFloat16Params' Adam state dict (under `optimizer.optimizer.`, its fp32 masters under
# `optimizer.fp32_from_fp16_params.<group>.<i>`) or FP32Optimizer's (under `optimizer.`)
DCP_STATE = re.compile(r"^(optimizer\.(?:optimizer\.)?)state\.(\d+)\.(exp_avg|exp_avg_sq|step)$")
DCP_MASTERS = "optimizer.fp32_from_fp16_params."
# fsdp_dtensor: Megatron-FSDP's distributed optimizer, per parameter by the wrapped model's parameter name
# (`optimizer.state.module.module.module.<name>.<field>`; its fp32 main weights are the model entries themselves)
FSDP_PARAM = "Megatron-FSDP per-parameter"
FSDP_STATE = re.compile(r"^(optimizer\.state\.(?:module\.)+)(.+)\.(exp_avg|exp_avg_sq|step)$")
FSDP_HALVES = ("_w", "_v")  # Megatron-FSDP saves a SwiGLU fc1 as `<name>_w` (gate) and `<name>_v` (up)
# our optimizer field -> its names in the per-parameter forms (non-distributed optimizer; fully_reshardable)
PER_PARAM_NAMES = {"master": ("fp32_param", "param"), "exp_avg": ("exp_avg",), "exp_avg_sq": ("exp_avg_sq",)}
# entries that hold no model weights: carried by Megatron-LM for its own resume, never an error
_NOT_WEIGHTS = ("rng_state", "optimizer.", "common_state")
Box = list[tuple[int, int]]  # [start, stop) along each dim of a global tensor
_BUCKET = re.compile(r"^optimizer\.distributed\.dp_group_idx_(?P<group>\d+)\.(?P<gbuf>gbuf_idx_\d+)\.dtype_.*"
                     r"\.bucket_idx_(?P<bucket>\d+)\.(?P<name>param|exp_avg|exp_avg_sq)$")


# how megatron-core's sharded state dict names and stacks each layout-table key: forms/torch_dist_names.py
from ckpt_tools.forms.torch_dist_names import (DCP_MODEL, Placed, dcp_candidates, part_names,  # noqa: E402
                                               stored_candidates, te_alias)


class DistCheckpoint:
    """A torch_dist iteration dir: its Meta (from the args in common.pt) and its .metadata index."""

    def __init__(self, meta: Meta, index: dcp.Index, common: dict | None = None, common_path: Path | None = None):
        self.meta, self.index, self.common = meta, index, common or {}
        self.common_path = common_path or meta.dir / COMMON  # common.pt, or the .distcp holding the embedded entry
        self._by_pattern = hybrid.of_meta(meta) is not None  # a HybridModel's keys: one per layer index
        # Megatron-LM's torch_dcp and fsdp_dtensor: the model's own keys, under `model.` / `model.module.`
        self.dcp = meta.source in (megatron_lm.TORCH_DCP, megatron_lm.FSDP_DTENSOR)
        self.fsdp = meta.source == megatron_lm.FSDP_DTENSOR
        self.model_prefix = megatron_lm.FSDP_MODEL if self.fsdp else DCP_MODEL
        self.dcp_fields: dict[str, dict[str, str]] | None = None  # torch_dcp: each parameter's optimizer entries
        self._starts: dict[str, tuple[list[int], list[dcp.Chunk]]] = {}  # chunks of each entry by dim-0 start
        self._coverage: dict[str, list[str]] = {}  # problems of each entry's chunks, found once
        self._joins: dict[str, tuple[dcp.Entry, list[str]]] = {}  # tensors saved in parts: joined entry, parts
        # the optimizer entries, sorted once: which form, and the dp_reshardable buckets by (group, bucket, field)
        self.optimizer_form = PER_PARAM if any(f.startswith(OPT_STATE) for f in index.tensors) else \
            BUCKETS if any(f.startswith(OPT_BUCKETS) for f in index.tensors) else None
        self.has_masters = any(f.startswith(tuple(f"{OPT_STATE}{n}." for n in PER_PARAM_NAMES["master"]))
                               for f in index.tensors)
        if self.dcp:
            found = [m for m in map(FSDP_STATE.match if self.fsdp else DCP_STATE.match, index.tensors) if m]
            self.optimizer_form = (FSDP_PARAM if self.fsdp else DCP_PLAIN) if found else None
            self.dcp_prefix = found[0].group(1) if found else None
            # (fsdp_dtensor: none apart; its model entries are Megatron-FSDP's fp32 main weights)
            self.has_masters = any(f.startswith(DCP_MASTERS) for f in index.tensors)
        self._buckets: dict[tuple[int, str, int, str], list[dcp.Entry]] = {}
        self._buffers: dict[int, set[str]] = {}  # group -> its grad buffers' names (gbuf_idx_g)
        for f, e in index.tensors.items():
            m = _BUCKET.match(f)
            if m:
                group, gbuf, bucket, name = int(m["group"]), m["gbuf"], int(m["bucket"]), m["name"]
                self._buffers.setdefault(group, set()).add(gbuf)
                self._buckets.setdefault((group, gbuf, bucket, name), []).append(e)
        # an interleaved pipeline: its VPP and the layers of its PP x VPP model chunks (each chunk a grad buffer)
        self.vpp, self.virtual_counts = 1, meta.layer_counts

    @classmethod
    def read(cls, iter_dir: Path, vocab_size: int | None = None, load: Callable = io.load_file,
             load_embedded: Callable | None = None) -> DistCheckpoint:
        """`load` reads common.pt, `load_embedded` (path, offset, length) the embedded common state: torch's
        allow-listed loader (the default), or the torch-free torchfile.read for both."""
        index = dcp.read_metadata(iter_dir)
        # torch_dist has dist_checkpointing's metadata.json; a dir without is torch_dcp or fsdp_dtensor
        source = megatron_lm.TORCH_DIST if (iter_dir / "metadata.json").is_file() else \
            megatron_lm.dcp_form(iter_dir, index)
        if source != megatron_lm.TORCH_DIST:
            common_path, common = read_dcp_common(iter_dir, index, load_embedded)
        else:
            common_path, common = read_common(iter_dir, index, load, load_embedded)
        args = megatron_lm.args_of(common_path, common)
        spec, tp, pp, counts = megatron_spec.layout_of(common_path, args, vocab_size)
        if source == megatron_lm.TORCH_DCP and (tp, pp) != (1, 1):
            raise FormatError(f"{common_path}: a torch_dcp checkpoint whose args say TP {tp} x PP {pp}: Megatron-LM saves "
                              f"torch_dcp (FSDP2) at TP = PP = 1 only; the args are damaged, restore the checkpoint")
        if source == megatron_lm.FSDP_DTENSOR and pp != 1:
            raise FormatError(f"{common_path}: an fsdp_dtensor checkpoint at PP {pp}: its layers are keyed by their index "
                              f"within a pipeline stage, which this version does not read; save the run with "
                              f"--ckpt-format torch_dist")
        if source == megatron_lm.FSDP_DTENSOR:
            tp = 1  # every tensor global (a DTensor over the data- and tensor-parallel ranks): read as one TP shard
        emb = index.tensors.get({megatron_lm.TORCH_DCP: DCP_MODEL, megatron_lm.FSDP_DTENSOR: megatron_lm.FSDP_MODEL}
                                .get(source, "") + "embedding.word_embeddings.weight")
        padded = getattr(args, "padded_vocab_size", None) or (emb.shape[0] if emb is not None else None)
        if padded is None:
            raise FormatError(f"{iter_dir / dcp.METADATA}: no embedding.word_embeddings.weight and no "
                              f"padded_vocab_size in args: not a GPT model checkpoint")
        meta = megatron_lm.meta_of(common_path, iter_dir, args, common, spec, tp, pp, counts, padded, source)
        if emb is not None:  # the stored dtype is what the run kept its weights in
            meta.raw["dtypes"]["params"] = emb.dtype
        ckpt = cls(meta, index, common, common_path)
        if ckpt.optimizer_form == BUCKETS:  # an interleaved pipeline's buckets: per model chunk, even splits only
            try:
                ckpt.vpp, ckpt.virtual_counts = megatron_spec.virtual_stages(common_path, args, counts)
            except ConfigError:
                ckpt.optimizer_form = None  # named, not carried (unread_optimizer); the weights read as they are
        if ckpt.optimizer_form == BUCKETS and spec.hybrid:
            ckpt.optimizer_form = None  # a Mamba mixer's parameter order in the buckets differs by version: not decoded
        return ckpt

    def entry(self, key: str, field: str | None = None) -> tuple[dcp.Entry, Placed]:
        """The stored tensor of a global key (or of one of its optimizer fields, per-parameter form), and its place
        on the stacked leading axes."""
        prefix = self.model_prefix if self.dcp else ""
        original = layout.alias_of(key, self.meta.spec)
        if original and prefix + key not in self.index.tensors:
            key = original  # an aliased row (a tied output layer) is saved as the tensor it copies
        candidates = dcp_candidates(key, self.meta.spec, prefix) if self.dcp else \
            stored_candidates(key, self.meta.spec, self._by_pattern)
        if field is not None and self.dcp:  # by the parameter's index (TorchDistShards maps them)
            candidates = [(self.dcp_fields.get(key, {}).get(field, f"(no {field} of {key})"), ())]
        elif field is not None:
            candidates = [(f"{OPT_STATE}{name}.{fqn}", layer) for name in PER_PARAM_NAMES[field]
                          for fqn, layer in candidates]
        for fqn, layer in candidates:
            if fqn in self.index.tensors:
                return self.index.tensors[fqn], layer
            joined = self._joined(fqn, self._part_fqns(key, fqn, field), len(layer))
            if joined is not None:
                return joined, layer
        raise FormatError(f"{self.meta.dir / dcp.METADATA}: no tensor {' or '.join(f for f, _ in candidates)} "
                          f"(for {key}): the checkpoint is not the model its args describe; restore it from the source")

    def _part_fqns(self, key: str, fqn: str, field: str | None) -> list[str] | None:
        """The stored names of the parts of a tensor saved in parts (None: saved whole): megatron-core's
        `<fqn>.<part>` (the layout table's part names), or Megatron-FSDP's SwiGLU halves (`<name>_w`, `<name>_v`, an
        optimizer field's name after them)."""
        if not self.fsdp:
            names = part_names(key, self.meta.spec)
            return None if names is None else [f"{fqn}.{n}" for n in names]
        if layout.find_rule(key, self.meta.spec, None).split != GATED or not self.meta.spec.activation == "swiglu":
            return None
        tail = f".{field}" if field is not None and fqn.endswith(f".{field}") else ""
        return [f"{fqn[:len(fqn) - len(tail)]}{half}{tail}" for half in FSDP_HALVES]

    def _joined(self, fqn: str, part_fqns: list[str] | None, lead: int) -> dcp.Entry | None:
        """A tensor saved in parts (their stored names `part_fqns`) as the one global tensor of the layout table:
        the parts' chunks placed after each other on the first dim after the `lead` stacked axes (no bytes move)."""
        if part_fqns is None or any(n not in self.index.tensors for n in part_fqns):
            return None
        if fqn not in self._joins:
            parts = [self.index.tensors[n] for n in part_fqns]
            chunks, at = [], 0
            for part in parts:
                if part.dtype != parts[0].dtype or part.shape[:lead] + part.shape[lead + 1:] != \
                        parts[0].shape[:lead] + parts[0].shape[lead + 1:]:
                    raise FormatError(f"{self.meta.dir / dcp.METADATA}: {part.fqn} is {part.dtype} "
                                      f"{list(part.shape)}, {parts[0].fqn} {parts[0].dtype} {list(parts[0].shape)}: the "
                                      f"parts of {fqn} do not fit together; restore the checkpoint from the source")
                chunks += [dcp.Chunk(c.offsets[:lead] + (c.offsets[lead] + at,) + c.offsets[lead + 1:], c.sizes,
                                     c.file, c.blob_offset, c.blob_length) for c in part.chunks]
                at += part.shape[lead]
            shape = parts[0].shape[:lead] + (at,) + parts[0].shape[lead + 1:]
            self._joins[fqn] = (dcp.Entry(fqn, shape, parts[0].dtype, tuple(chunks)), [p.fqn for p in parts])
        return self._joins[fqn][0]

    def expected_shape(self, key: str, placed: Placed) -> tuple[int, ...]:
        full = layout.full_shape(key, self.meta.spec, self.meta.padded_vocab, self.meta.pp_size)
        return tuple(n for _, n in placed) + full

    def rank_boxes(self, key: str, rank: int, field: str | None = None) -> tuple[dcp.Entry, list[Box], int, int]:
        """TP rank `rank`'s shard of `key` (at the checkpoint's TP) as parts of the stored tensor: (entry, the
        box of each part in order, the dim they are joined on, how many leading stacked axes are dropped)."""
        meta = self.meta
        entry, layer = self.entry(key, field)
        full = self.expected_shape(key, layer)
        if entry.shape != full:
            raise FormatError(f"{meta.dir / dcp.METADATA}: {entry.fqn} has global shape {list(entry.shape)}, the "
                              f"layout table says {list(full)} for this {meta.spec.architecture} model: the args and "
                              f"the weights disagree; restore the checkpoint from the source")
        lead = [(x, x + 1) for x, _ in layer]
        full = full[len(lead):]
        pieces = shard_ops.reshard_pieces(key, meta.spec, 1, meta.padded_vocab, meta.tp_size, meta.padded_vocab,
                                       rank, meta.pp_size)
        boxes = [lead + [(p.start, p.stop) if d == p.dim else (0, n) for d, n in enumerate(full)] for p in pieces]
        return entry, boxes, pieces[0].dim, len(lead)

    def hits(self, entry: dcp.Entry, box: Box) -> list[tuple[dcp.Chunk, Box]]:
        """The chunks that overlap a box, each with the overlap. The entry's chunks are checked first (inside its
        shape, not overlapping, covering it), so the overlaps cover the box exactly once."""
        problems = self.coverage(entry)
        if problems:
            raise FormatError(f"{self.meta.dir / dcp.METADATA}: {entry.fqn}: {problems[0]}: restore the checkpoint "
                              f"from the source")
        out = []
        for c in self._candidates(entry, *box[0]) if box else entry.chunks:
            inter = [(max(a, o), min(b, o + s)) for (a, b), o, s in zip(box, c.offsets, c.sizes)]
            if all(lo < hi for lo, hi in inter):
                out.append((c, inter))
        return out

    def coverage(self, entry: dcp.Entry) -> list[str]:
        """dcp.coverage_problems of an entry, found once."""
        if entry.fqn not in self._coverage:
            self._coverage[entry.fqn] = dcp.coverage_problems(entry)
        return self._coverage[entry.fqn]

    def _candidates(self, entry: dcp.Entry, lo: int, hi: int) -> list[dcp.Chunk]:
        """The chunks whose dim-0 range meets [lo, hi)."""
        import bisect
        if entry.fqn not in self._starts:
            ordered = sorted(entry.chunks, key=lambda c: c.offsets[:1])
            self._starts[entry.fqn] = ([c.offsets[0] if c.offsets else 0 for c in ordered], ordered)
        starts, ordered = self._starts[entry.fqn]
        found = ordered[:bisect.bisect_left(starts, hi)]
        return [c for c in found if not c.offsets or c.offsets[0] + c.sizes[0] > lo]

    def keys(self) -> list[str]:
        return [key for p in range(self.meta.pp_size)
                for _, key in layout.stage_keys(self.meta.spec, self.meta.layer_counts, p)]

    def validate(self) -> list[str]:
        """Every tensor the layout table expects, of its global shape, its chunks covering it once; no weights
        beyond the table's; every chunk inside its file."""
        meta, problems, used = self.meta, [], set()
        where = meta.dir / dcp.METADATA
        for key in self.keys():
            if not layout.holds_weights(key, meta.spec, meta.pp_size):
                continue
            try:
                entry, layer = self.entry(key)
            except FormatError as e:
                problems.append(str(e))
                continue
            if entry.fqn in used:
                continue
            used.add(entry.fqn)
            used.update(self._joins.get(entry.fqn, (None, []))[1])  # the parts it was joined from
            alias = te_alias(entry.fqn, meta.spec, self._by_pattern)  # the same tensor under the other spec's name, where written
            if alias in self.index.tensors:
                used.add(alias)
            if self.dcp:  # the model's keys: a tensor under both specs' names (as `ckpt` writes fsdp_dtensor), whole
                # or as its SwiGLU halves
                names = [f for f, _ in dcp_candidates(key, meta.spec, self.model_prefix)]
                used.update(n for f in names for n in [f, *(self._part_fqns(key, f, None) or [])]
                            if n in self.index.tensors)
            want = self.expected_shape(key, layer)
            if entry.shape != want:
                problems.append(f"{where}: {entry.fqn} has global shape {list(entry.shape)}, the layout table says "
                                f"{list(want)}: the args and the weights disagree; restore the checkpoint")
            problems += [f"{where}: {entry.fqn}: {p}: restore the checkpoint from the source"
                         for p in self.coverage(entry)]
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

    def chunk_info(self, entry: dcp.Entry, chunk: dcp.Chunk):
        """Where a chunk's bytes are (torchfile.TensorInfo, absolute offset), checked against .metadata."""
        info = dcp.chunk_info(self.meta.dir, chunk)
        path = self.meta.dir / chunk.file
        if info.dtype != entry.dtype:
            raise FormatError(f"{path}: chunk of {entry.fqn} at {list(chunk.offsets)} is {info.dtype}, .metadata "
                              f"says {entry.dtype}: restore the file from the source")
        if info.offset + info.nbytes > path.stat().st_size:
            raise FormatError(f"{path}: {path.stat().st_size} bytes, but the chunk of {entry.fqn} at "
                              f"{list(chunk.offsets)} ends at byte {info.offset + info.nbytes}: the file is "
                              f"truncated; restore it from the source")
        return info

    def byte_parts(self) -> dict[str, list[list[tuple[Path, object]]]] | None:
        """Every model tensor's TP shards as runs of rows of chunks in the files, [(file, TensorInfo)] per rank
        along dim 0 (the leading stacked axes dropped); None when some shard is not made so: a shard split on dim 1
        must be one whole chunk, a dim-0 shard may be rows of several chunks (as chunks copied from another layout
        or from an HF model's tensors are). A row-parallel tensor saved as runs of whole rows (as `ckpt import`
        saves it) is given as one shard, the whole tensor: its TP shards' columns are no byte ranges, its rows are."""
        out = {}
        for key in self.keys():
            if not layout.holds_weights(key, self.meta.spec, self.meta.pp_size):
                continue
            ranks = []
            for rank in range(self.meta.tp_size):
                entry, boxes, dim, stacked = self.rank_boxes(key, rank)
                parts = [part for box in boxes for part in self._rows_of(entry, box, dim + stacked, stacked) or [None]]
                if None in parts or (len(parts) > 1 and dim != 0):
                    ranks = self._whole_rows(key)
                    if ranks is None:
                        return None
                    break
                ranks.append(parts)
            out[key] = ranks
        return out

    def _whole_rows(self, key: str) -> list[list[tuple[Path, object]]] | None:
        """A row-parallel tensor stored as runs of whole rows: [its rows' parts] (one shard, TP 1); else None."""
        if layout.find_rule(key, self.meta.spec, self.meta.pp_size).dim != 1:
            return None
        entry, layer = self.entry(key)
        lead = [(x, x + 1) for x, _ in layer]
        box = lead + [(0, n) for n in self.expected_shape(key, layer)[len(lead):]]
        parts = self._rows_of(entry, box, len(lead), len(lead))
        return None if parts is None or None in parts else [parts]

    def _rows_of(self, entry: dcp.Entry, box: Box, split: int, stacked: int) -> list[tuple[Path, object]] | None:
        """A box as (file, TensorInfo) runs of whole rows of the chunks it meets, in order along stored dim `split`;
        None where some chunk is cut on another dim, or rows of it are not contiguous bytes."""
        parts = []
        for chunk, inter in sorted(self.hits(entry, box), key=lambda hit: hit[1][split][0]):
            whole = [(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes)]
            if any(not inter[d] == whole[d] == tuple(box[d]) for d in range(len(box)) if d != split) or \
                    (inter[split] != whole[split] and any(n != 1 for n in chunk.sizes[:split])):
                return None
            info = self.chunk_info(entry, chunk)
            row = info.nbytes // chunk.sizes[split] if chunk.sizes[split] else 0
            lo, hi = inter[split][0] - whole[split][0], inter[split][1] - whole[split][0]
            shape = (hi - lo,) + tuple(chunk.sizes[split + 1:])
            shape = shape if split == stacked else tuple(chunk.sizes[stacked:])  # dim-1: the whole chunk
            parts.append((self.meta.dir / chunk.file, type(info)(info.dtype, shape, info.offset + lo * row)))
        return parts

    # ------------------------------------------------------------ the bucket form (dp_reshardable)
    def stage_params(self, pp_rank: int, counts: list[int] | None = None) -> list[tuple[str, tuple[int, ...], bool]]:
        """(global key, TP shard shape, shared embedding) of a stage's parameters in named_parameters() order (of the
        stages of `counts`: an interleaved pipeline's model chunks; default: the checkpoint's PP stages)."""
        meta, spec, out = self.meta, self.meta.spec, []
        counts = counts or meta.layer_counts
        shared = layout.tied_copies(spec, len(counts), pp_rank)
        for _, key in layout.stage_keys(spec, counts, pp_rank):
            shape = layout.shard_shape(key, spec, meta.padded_vocab, meta.tp_size, len(counts))
            if shape is not None and layout.has_optimizer_state(key, spec, len(counts)):  # not a buffer
                out.append((key, shape, key in shared))
        return out

    def bucket_count(self, group: int, chunk: int = 0) -> int:
        """How many buckets one model-parallel rank's grad buffer (of model chunk `chunk`) has (its `param`
        tensors)."""
        return sum(1 for g, b, _, name in self._buckets if g == group and b == f"gbuf_idx_{chunk}" and name == "param")

    def bucket_entry(self, group: int, bucket: int, name: str, chunk: int = 0) -> dcp.Entry:
        """The 1-D tensor of one bucket and field of one model-parallel rank's grad buffer: model chunk `chunk`'s
        (megatron-core's distributed optimizer numbers its grad buffers chunk by chunk: one per chunk of a dense
        model)."""
        found = self._buckets.get((group, f"gbuf_idx_{chunk}", bucket, name), [])
        buffers = self._buffers.get(group, set())
        if len(found) != 1 or buffers != {f"gbuf_idx_{v}" for v in range(self.vpp)}:
            raise FormatError(f"{self.meta.dir / dcp.METADATA}: {len(found)} tensors {OPT_BUCKETS}dp_group_idx_"
                              f"{group}.gbuf_idx_{chunk}.dtype_*.bucket_idx_{bucket}.{name} (grad buffers "
                              f"{', '.join(sorted(buffers)) or 'none'}): one grad buffer of one dtype pair per model "
                              f"chunk (a dense model) is read")
        return found[0]

    def step(self):
        """Adam's step: per parameter group in common.pt or the dp_reshardable optimizer object, or `common_step`."""
        opt = self.common.get("optimizer") or {}
        inner = opt.get("optimizer") if isinstance(opt, dict) else None
        if not isinstance(inner, dict):
            return None
        try:
            common_step = (inner.get("state") or {}).get("common_step")
            if common_step is not None:
                return float(common_step)
            steps = [float(g["step"]) for g in inner.get("param_groups", []) if g.get("step") is not None]
        except (AttributeError, TypeError, ValueError, KeyError) as e:
            raise FormatError(f"{self.common_path}: the optimizer's param groups are malformed "
                              f"({type(e).__name__}): restore the checkpoint from the source") from None
        return max(steps) if steps else None
