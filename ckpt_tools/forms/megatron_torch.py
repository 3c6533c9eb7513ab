"""Megatron-LM's legacy `--ckpt-format torch`: one `mp_rank_TT[_PPP]/model_optim_rng.pt` per TP x PP rank
(megatron_lm.py finds the dir and reads its args). The model state dict has the layout table's keys with
stage-local layer numbers, in megatron-core's local-spec names or Transformer Engine's (names.py), which are
read as the table's. Its optimizer state, plain (in the same file) or of the distributed optimizer
(`distrib_optim.pt` beside it), is decoded into ours by forms/megatron_optim.py.
"""
from __future__ import annotations

from pathlib import Path

from ckpt_tools import io
from ckpt_tools.errors import FormatError
from ckpt_tools.forms import megatron_lm
from ckpt_tools.forms import megatron_optim as mo
from ckpt_tools.forms.shards import MODEL, OPTIMIZER, ShardSet
from ckpt_tools.model import layout, shard_ops
from ckpt_tools.model.ranks import Rank

DISTRIB_OPTIM = megatron_lm.DISTRIB_OPTIM


class LegacyShards(ShardSet):
    """An interleaved pipeline's ranks are its virtual stages (megatron_lm.virtual_file): each reads its model chunk
    of its PP rank's file."""

    def path(self, kind: str, rank: Rank) -> Path:
        physical, _, pp = megatron_lm.virtual_file(self.meta, rank)
        return megatron_lm.model_path(self.meta.dir, physical, pp)

    def _object(self, path: Path, rank: Rank):
        _, v, _ = megatron_lm.virtual_file(self.meta, rank)
        return megatron_lm.chunk(io.load_file(path), v, self.meta.raw.get(megatron_lm.VIRTUAL, 1), path)

    def _loaded(self, path: Path, kind: str, obj, rank: Rank) -> dict:
        model = megatron_lm.model_state(obj, path)
        order = megatron_lm.qkv_order(path, obj)
        if order is not None and kind != MODEL:
            raise FormatError(f"{path}: the optimizer state of a checkpoint_version {order} legacy model is not read "
                              f"(its QKV rows are in the old order too): pass --no-optimizer, or merge the weights")
        if order is not None:  # a 2020 legacy model: its QKV rows into megatron-core's order, as Megatron-LM does
            spec = self.meta.spec
            for key in [k for k in model if k.endswith(megatron_lm.QKV)]:
                model[key] = megatron_lm.reorder_qkv(model[key], order, spec.num_attention_heads // self.meta.tp_size,
                                                     spec.kv_channels, f"{path}: {key}")
        if self.meta.raw.get(megatron_lm.WHOLE_EXPERTS):
            if kind != MODEL:
                raise FormatError(f"{path}: the optimizer state of experts held whole at TP {self.meta.tp_size} "
                                  f"(expert_tensor_parallel_size 1) is not read from the legacy form by this version: "
                                  f"pass --no-optimizer, or save the run with --ckpt-format torch_dist")
            model = self._experts_split(path, model, rank)
        if kind == MODEL:
            return {**obj, MODEL: model}
        if megatron_lm.grouped_experts(obj[MODEL]):  # its parameters are not the table's, one by one
            raise FormatError(f"{path}: the optimizer state of grouped-GEMM experts (weight1/weight2, "
                              f"--moe-use-legacy-grouped-gemm) is not read by this version: pass --no-optimizer to "
                              f"convert the weights")
        return {OPTIMIZER: self._decode(path, obj, model, rank)}

    def _experts_split(self, path: Path, model: dict, rank: Rank) -> dict:
        """A file of an ETP 1 run holds each expert whole: the TP shard of this rank cut from it, as the layout table
        splits experts (a copy of each), so that every tensor reads as TP-split."""
        spec, tp, pp = self.meta.spec, self.meta.tp_size, self.meta.pp_size
        out = dict(model)
        for key, t in model.items():
            if not megatron_lm.expert_weight(key, spec):
                continue
            want = layout.full_shape(key, spec, self.meta.padded_vocab, None)
            if tuple(t.shape) != tuple(want):
                raise FormatError(f"{path}: {key} {list(t.shape)}, expected the whole expert {list(want)} (the args "
                                  f"say expert_tensor_parallel_size 1): the file and its args disagree")
            out[key] = shard_ops.split(key, t, spec, tp, pp)[rank.tp].clone()
        return out

    def _decode(self, path: Path, obj: dict, model: dict, rank: Rank) -> dict:
        """The optimizer state of a (virtual) stage's parameters. An interleaved pipeline's distrib_optim.pt holds a
        grad buffer per model chunk (gbuf index = chunk), bucketed for the first chunk only (Megatron-LM's get_model:
        `disable_bucketing=(model_chunk_idx > 0)`)."""
        params = mo.params_of(model, layout.tied_copies(self.meta.spec, self.meta.pp_size, rank.pp))
        flat = path.parent / DISTRIB_OPTIM
        physical, v, _ = megatron_lm.virtual_file(self.meta, rank)
        vpp = self.meta.raw.get(megatron_lm.VIRTUAL, 1)
        try:
            if flat.is_file():
                args, dp = obj["args"], mo.dp_size_of(obj["args"])
                found = mo.buffer_layout(params, dp, mo.bucket_size_of(args, physical.pp, dp) if v == 0 else None,
                                         bool(getattr(args, "ddp_pad_buckets_for_high_nccl_busbw", False)))
                groups = obj["optimizer"]["optimizer"]["param_groups"]
                data = io.load_file(flat)
                self._map(flat)
                if vpp > 1:  # this chunk's grad buffer, alone
                    buffers = sorted(k for k in data if k != "buckets_coalesced")
                    if buffers != list(range(vpp)):
                        raise FormatError(f"{flat}: grad buffers {buffers}, expected one per model chunk "
                                          f"({list(range(vpp))}): the file is not this interleaved pipeline's; "
                                          f"restore it from the source")
                    data = {"buckets_coalesced": data.get("buckets_coalesced"), v: data[v]}
                return mo.decode_flat(flat, data, params, found, groups, model)
            return mo.decode_plain(path, obj["optimizer"], params, model)
        except (KeyError, TypeError, IndexError, AttributeError, ValueError, RuntimeError) as e:
            where = flat if flat.is_file() else path
            raise FormatError(f"{where}: the optimizer state is malformed ({type(e).__name__}: {str(e)[:100]}): "
                              f"it cannot be mapped to the model's parameters; restore the file") from None

    def file_problems(self, team: object = None) -> tuple[int, list[str]]:
        return 0, []  # Megatron-LM records no sizes or hashes

    def rng_state(self):
        return None  # Megatron-LM's RNG states are its own (CUDA, per rank); the trainer starts them afresh

    def _extra_files(self) -> list[str]:
        return []  # rank dirs beyond the layout are refused when the meta is read

    def _form(self) -> str | None:
        first = self.file(MODEL, self.meta.grid.first)
        if (self.path(MODEL, self.meta.grid.first).parent / DISTRIB_OPTIM).is_file():
            return "flat"
        if self.meta.raw.get(megatron_lm.VIRTUAL, 1) > 1 and first.get("optimizer"):
            return "virtual"  # the plain optimizer's parameters run over the chunks: not decoded by this version
        opt = first.get("optimizer")
        if isinstance(opt, dict) and isinstance(opt.get("optimizer"), dict) and opt["optimizer"].get("state"):
            return "plain"
        return "other" if opt else None

    def megatron_optimizer(self):
        first = self.file(MODEL, self.meta.grid.first)
        opt = first.get("optimizer")
        inner = opt.get("optimizer") if isinstance(opt, dict) else None
        groups = inner.get("param_groups") if isinstance(inner, dict) else None
        path = self.path(MODEL, self.meta.grid.first)
        return path, groups, path, first.get("opt_param_scheduler")

    def has_optimizer(self) -> bool:
        return self._form() in ("plain", "flat")

    def unread_optimizer(self) -> str | None:
        form = self._form()
        if form == "virtual":
            return ("optimizer state of an interleaved pipeline's non-distributed optimizer (its model chunks' "
                    "parameters numbered together), not read by this version")
        return "optimizer state (model_optim_rng.pt['optimizer'], a form not read)" if form == "other" else None
