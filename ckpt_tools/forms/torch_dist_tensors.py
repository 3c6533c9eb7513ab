"""The tensors of a torch_dist checkpoint (forms/torch_dist.py plans which parts each TP shard is): chunks
are views of the privately mapped .distcp files (zero copy, their pages released like any shard's); a TP shard
that is exactly one chunk is that view, one made of several (SwiGLU's [gate_r; up_r]) is assembled.
"""
from __future__ import annotations

import math
import mmap
from pathlib import Path

import torch

from ckpt_tools import io
from ckpt_tools.errors import FormatError
from ckpt_tools.forms import dcp
from ckpt_tools.forms import megatron_optim as mo
from ckpt_tools.forms.shards import Reader
from ckpt_tools.forms.torch_dist import (BUCKETS, DCP_MASTERS, DCP_PLAIN, DCP_STATE, FSDP_PARAM, FSDP_STATE,
                                         OPT_BUCKETS, Box, DistCheckpoint)
from ckpt_tools.model import layout


def open_torch_dist(iter_dir: Path, vocab_size: int | None = None) -> TorchDistShards:
    return TorchDistShards(DistCheckpoint.read(iter_dir, vocab_size))


class TorchDistShards(Reader):
    def __init__(self, ckpt: DistCheckpoint):
        super().__init__(ckpt.meta)
        self.ckpt = ckpt
        self._maps: dict[str, mmap.mmap] = {}
        self._chunks: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self._layouts: dict[int, mo.Layout] = {}
        self._stages: dict[str, int] | None = None  # an interleaved pipeline: each key's virtual stage

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
        out = torch.zeros(tuple(b - a for a, b in box), dtype=getattr(torch, entry.dtype))
        for c, inter in hits:
            src = self._chunk(entry, c)[tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(inter, c.offsets))]
            out[tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(inter, box))] = src
        return out

    def shards(self, global_key: str, field: str | None = None) -> list:
        meta = self.meta
        if not layout.holds_weights(global_key, meta.spec, meta.pp_size):
            return [None] * meta.tp_size
        form = self.ckpt.optimizer_form if field is not None else None
        if field is not None and form is None:
            raise FormatError(f"{meta.dir}: no optimizer state (no {field!r} for {global_key}): use the model weights")
        if field == "step":
            return [torch.tensor(self.step())] * meta.tp_size
        if form == DCP_PLAIN and self.ckpt.dcp_fields is None:
            self.ckpt.dcp_fields = self._dcp_fields()
        if form == FSDP_PARAM and self.ckpt.dcp_fields is None:
            self.ckpt.dcp_fields = self._fsdp_fields()
        if form == BUCKETS:
            out = [self._bucket_shard(global_key, field, rank) for rank in range(meta.tp_size)]
        else:
            if field == "master" and not self.ckpt.has_masters:  # fp32 training: the weights are the masters
                if self.meta.params_dtype != "float32":
                    held = f"{DCP_MASTERS}*" if self.ckpt.dcp else "optimizer.state.fp32_param.* or .param.*"
                    raise FormatError(f"{meta.dir / dcp.METADATA}: no fp32 masters ({held}) beside "
                                      f"{self.meta.params_dtype} weights: the optimizer state is incomplete; restore the "
                                      f"checkpoint from the source")
                return [t.float() for t in self.shards(global_key)]
            out = []
            for rank in range(meta.tp_size):
                entry, boxes, dim, stacked = self.ckpt.rank_boxes(global_key, rank, field)
                parts = [self._box(entry, box) for box in boxes]
                parts = [p[(0,) * stacked] for p in parts]  # the stacked leading axes (size 1) dropped
                out.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim))
            if form == DCP_PLAIN and field == "master" and not mo.same_as_weight(out[0], self.shards(global_key)[0]):
                raise FormatError(f"{meta.dir / dcp.METADATA}: {global_key}: its fp32 master "
                                  f"({self.ckpt.dcp_fields[global_key]['master']}) rounded to the weights' dtype is not "
                                  f"the weight: the optimizer's parameter numbering is not this model's; restore the "
                                  f"checkpoint from the source")
        self._handed += out
        return out

    # ------------------------------------------------------------ optimizer state
    def has_optimizer(self) -> bool:
        return self.ckpt.optimizer_form is not None

    def step(self) -> float:
        if self.ckpt.optimizer_form in (DCP_PLAIN, FSDP_PARAM):
            return self._dcp_step()
        step = self.ckpt.step()
        if step is None:  # dp_reshardable: in each model-parallel rank's optimizer object (the same step)
            where, groups = self._blob_groups()
            steps = [float(g["step"]) for g in groups if isinstance(g, dict) and isinstance(g.get("step"), (int, float))]
            if not steps:
                raise FormatError(f"{where}: holds no param_groups with a step: restore it")
            step = float(max(steps))
        return step

    # ------------------------------------------------------------ torch_dcp: optimizer.state_dict(), by index
    def _blob(self, name: str):
        file, offset, length = self.ckpt.index.blobs[name]
        return io.load_bytes(self._file(file)[offset:offset + length], f"{self.meta.dir / file} ({name})")

    def _dcp_groups(self) -> list[dict]:
        """Adam's param groups, each field a bytes entry `<prefix>param_groups.<g>.<field>`."""
        prefix = f"{self.ckpt.dcp_prefix}param_groups."
        groups: dict[int, dict] = {}
        for name in self.ckpt.index.blobs:
            if name.startswith(prefix):
                g, field = name[len(prefix):].split(".", 1)
                groups.setdefault(int(g), {})[field] = self._blob(name)
        if not groups or any("params" not in g for g in groups.values()):
            raise FormatError(f"{self.meta.dir / dcp.METADATA}: no {prefix}<g>.params entries: the optimizer state "
                              f"cannot be mapped to the model's parameters; restore the checkpoint from the source")
        return [groups[g] for g in sorted(groups)]

    def _dcp_fields(self) -> dict[str, dict[str, str]]:
        """Each parameter's optimizer entries in a torch_dcp checkpoint: megatron-core's default param groups over the
        model's parameters in named_parameters() order (TP = PP = 1), mapped by forms/megatron_optim.plain_order."""
        meta, tensors = self.meta, self.ckpt.index.tensors
        params = [mo.Param(key, shape, False) for key, shape, _ in self.ckpt.stage_params(0)]
        if any(f.endswith(".layer_norm_weight") for f in tensors):  # Transformer Engine's order
            params = mo.te_order(params)
        groups = self._dcp_groups()
        masters = None
        if self.ckpt.has_masters:
            masters = [sum(1 for f in tensors if f.startswith(f"{DCP_MASTERS}{g}.")) for g in range(len(groups))]
        prefix = self.ckpt.dcp_prefix
        out = {}
        for p, g, j, index in mo.plain_order(meta.dir / dcp.METADATA, groups, params, masters):
            fields = {name: f"{prefix}state.{index}.{name}" for name in ("exp_avg", "exp_avg_sq")}
            if masters is not None:
                fields["master"] = f"{DCP_MASTERS}{g}.{j}"
            out[p.key] = fields
        return out

    def _fsdp_fields(self) -> dict[str, dict[str, str]]:
        """Each parameter's optimizer entries in an fsdp_dtensor checkpoint: `<prefix><its model entry's name>.<field>`
        (Megatron-FSDP's wrapped parameter names; a SwiGLU fc1's halves joined by DistCheckpoint.entry)."""
        out = {}
        for key, _, _ in self.ckpt.stage_params(0):
            name = self.ckpt.entry(key)[0].fqn[len(self.ckpt.model_prefix):]
            out[key] = {field: f"{self.ckpt.dcp_prefix}{name}.{field}" for field in ("exp_avg", "exp_avg_sq")}
        return out

    def _fsdp_groups(self) -> list[dict]:
        """Megatron-FSDP's param groups: each parameter's group settings are bytes entries
        `optimizer.param_to_group_meta.<name>.<setting>`; parameters of equal settings make one group."""
        prefix, found = "optimizer.param_to_group_meta.", {}
        for name in self.ckpt.index.blobs:
            if name.startswith(prefix):
                param, setting = name[len(prefix):].rsplit(".", 1)
                found.setdefault(param, {})[setting] = self._blob(name)
        groups: list[dict] = []
        for param, settings in found.items():
            same = [g for g in groups if {k: v for k, v in g.items() if k != "params"} == settings]
            if same:
                same[0]["params"].append(param)
            else:
                groups.append({**settings, "params": [param]})
        if not groups:
            raise FormatError(f"{self.meta.dir / dcp.METADATA}: no optimizer.param_to_group_meta.* entries: the "
                              f"optimizer's param groups are missing; restore the checkpoint, or pass --no-optimizer")
        return groups

    def _dcp_step(self) -> float:
        """Adam's step: per parameter (torch's Adam: `<prefix>state.<i>.step`, the same for all) or per group."""
        pattern = FSDP_STATE if self.ckpt.fsdp else DCP_STATE
        steps = [f for f in self.ckpt.index.tensors if (m := pattern.match(f)) and m.group(3) == "step"]
        if steps:
            entry = self.ckpt.index.tensors[steps[0]]
            return float(self._chunk(entry, entry.chunks[0]).reshape(()).item())
        found = [float(g["step"]) for g in self._dcp_groups() if isinstance(g.get("step"), (int, float))]
        if not found:
            raise FormatError(f"{self.meta.dir / dcp.METADATA}: no Adam step (per parameter or per param group): the "
                              f"optimizer state is incomplete; restore the checkpoint from the source")
        return max(found)

    def _blob_groups(self) -> tuple[str, list]:
        """The param groups in the dp_reshardable optimizer object (model-parallel rank 0's)."""
        blob = f"{OPT_BUCKETS}dp_group_idx_0.optimizer/shard_0_1"
        if blob not in self.ckpt.index.blobs:
            raise FormatError(f"{self.meta.dir / dcp.METADATA}: no Adam step (no {blob}, no param_groups in "
                              f"common.pt): the optimizer state is incomplete; restore the checkpoint")
        file, offset, length = self.ckpt.index.blobs[blob]
        where = f"{self.meta.dir / file} ({blob})"
        obj = io.load_bytes(self._file(file)[offset:offset + length], where)
        obj = obj[0] if isinstance(obj, list) and obj else obj
        return where, obj.get("param_groups", []) if isinstance(obj, dict) else []

    def megatron_optimizer(self):
        if self.ckpt.dcp:  # Adam's param groups and the scheduler, each field a bytes entry
            where = self.meta.dir / dcp.METADATA
            prefix = "opt_param_scheduler."
            scheduler = {name[len(prefix):]: self._blob(name) for name in self.ckpt.index.blobs
                         if name.startswith(prefix)}
            groups = (self._fsdp_groups() if self.ckpt.fsdp else self._dcp_groups()) if self.has_optimizer() else None
            return where, groups, where, scheduler or None
        opt = self.ckpt.common.get("optimizer")
        inner = opt.get("optimizer") if isinstance(opt, dict) else None
        groups = inner.get("param_groups") if isinstance(inner, dict) else None
        where = self.ckpt.common_path
        if groups is None and self.ckpt.optimizer_form == BUCKETS:
            where, groups = self._blob_groups()
        return where, groups, self.ckpt.common_path, self.ckpt.common.get("opt_param_scheduler")

    def _group(self, tp_rank: int, pp_rank: int) -> int:
        """megatron-core's dp_group_idx of a rank: its rank in the TP x PP model-parallel group, TP fastest."""
        return tp_rank + self.meta.tp_size * pp_rank

    def _layout(self, stage: int) -> mo.Layout:
        """megatron-core's grad-buffer layout of a stage's parameters (every TP rank's is alike; with an interleaved
        pipeline a model chunk's: virtual stage s is chunk s // PP of PP rank s % PP, its own grad buffer, bucketed
        only for the first chunk, as Megatron-LM's get_model sets `disable_bucketing`). The order of the
        parameters is the trained spec's (a Transformer Engine layer's differs from the local spec's, and a
        torch_dist file does not say which trained it): args' --transformer-impl is tried first, then the other;
        a layout is taken only when the stored buckets have its lengths and every fp32 master, of every TP rank,
        rounds to its weight. Otherwise nothing is decoded."""
        if stage not in self._layouts:
            args = self.ckpt.common.get("args")
            dp = mo.dp_size_of(args)
            pp_rank, chunk = stage % self.meta.pp_size, stage // self.meta.pp_size
            params = [mo.Param(k, shape, shared)
                      for k, shape, shared in self.ckpt.stage_params(stage, self.ckpt.virtual_counts)]
            orders = [mo.te_order(params), params]
            if getattr(args, "transformer_impl", "transformer_engine") == "local":
                orders.reverse()
            reasons = []
            for order in orders:
                found = mo.buffer_layout(order, dp, mo.bucket_size_of(args, pp_rank, dp) if chunk == 0 else None,
                                         bool(getattr(args, "ddp_pad_buckets_for_high_nccl_busbw", False)))
                reason = self._misfit(found, stage)
                if reason is None:
                    self._layouts[stage] = found
                    break
                reasons.append(reason)
            else:
                what = f"PP rank {pp_rank}" + (f", model chunk {chunk}" if self.ckpt.vpp > 1 else "")
                raise FormatError(f"{self.meta.dir / dcp.METADATA}: the grad buffer of {what} does not fit "
                                  f"megatron-core's layout of its parameters in either spec's order ({reasons[0]}; "
                                  f"{reasons[1]}): the optimizer state cannot be mapped")
        return self._layouts[stage]

    def _misfit(self, found: mo.Layout, stage: int) -> str | None:
        """Why the stored buckets are not this layout (None: they are)."""
        pp_rank, chunk = stage % self.meta.pp_size, stage // self.meta.pp_size
        for tp_rank in range(self.meta.tp_size):
            group = self._group(tp_rank, pp_rank)
            count = self.ckpt.bucket_count(group, chunk)
            want = [n for _, _, n in found.buckets]
            if count != len(want):
                return (f"rank {group} has {count} bucket(s), the layout {len(want)} (from args: overlap_grad_reduce, "
                        f"ddp_bucket_size, data-parallel size)")
            stored = [self.ckpt.bucket_entry(group, b, "param", chunk).shape[0] for b in range(len(want))]
            if stored != want:
                return f"rank {group}'s buckets hold {stored} elements, the layout {want}"
            for key in found.where:
                master = self._slice(found, key, "master", tp_rank, stage)
                if not mo.same_as_weight(master, self.shards(key)[tp_rank]):
                    return f"the fp32 master of {key} (TP rank {tp_rank}) does not round to its weight"
        return None

    def _slice(self, found: mo.Layout, key: str, field: str, tp_rank: int, stage: int) -> torch.Tensor:
        start, end, bucket = found.where[key]
        first = found.buckets[bucket][0]
        pp_rank, chunk = stage % self.meta.pp_size, stage // self.meta.pp_size
        entry = self.ckpt.bucket_entry(self._group(tp_rank, pp_rank), bucket, mo.FLAT_FIELDS[field], chunk)
        shape = layout.shard_shape(key, self.meta.spec, self.meta.padded_vocab, self.meta.tp_size,
                                   len(self.ckpt.virtual_counts))
        return self._box(entry, [(start - first, end - first)]).view(shape)

    def _bucket_shard(self, key: str, field: str, rank: int) -> torch.Tensor:
        stage = self._stage_of(key)
        return self._slice(self._layout(stage), key, field, rank, stage)

    def _stage_of(self, key: str) -> int:
        """The (virtual) stage whose grad buffer holds a key's optimizer state."""
        counts = self.ckpt.virtual_counts
        if self.ckpt.vpp == 1:
            return self._where[key][0]
        if self._stages is None:
            self._stages = {k: s for s in range(len(counts)) for _, k in layout.stage_keys(self.meta.spec, counts, s)}
        return self._stages[key]

    def validate(self) -> list[str]:
        return self.ckpt.validate()

    def unread_optimizer(self) -> str | None:
        n = sum(1 for f in self.ckpt.index.tensors if f.startswith("optimizer."))
        return f"{self.meta.source} optimizer state ({n} optimizer.* tensors)" if n and not self.has_optimizer() else None

    def close(self) -> None:
        self._chunks.clear()
        self._maps.clear()  # each mapping goes with the last tensor over it
        super().close()
