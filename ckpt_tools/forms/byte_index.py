"""A checkpoint's tensors as byte ranges of its files, found without torch: each form's index (`Index`: the model's
shards and those to copy, every shard a run of parts of a file), read by `torchfile` from the files' pickles and
indexes. Every shard file must pass the checks the torch reader makes (the size meta.json records,
checkpoint.extra_shards, checkpoint.shard_problems); where any of that differs, or the files hold what only the torch
reader decodes (a Megatron-LM optimizer), the index raises Declined and the verb reads through torch. Single tensors
whose bytes are not the table's (grouped or whole experts) are the index's `made`: the torch reader makes those, and
the byte path copies the rest. forms/readers.py names each form's index; byte_ranges.ByteSource (the source of merge
and of reshard's byte copies) reads the shards it gives.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ckpt_tools.forms import checkpoint, megatron_lm
from ckpt_tools.forms.torchfile import TensorInfo, read
from ckpt_tools.model import layout
from ckpt_tools.model.ranks import Rank

Range = tuple[Path, int, int]  # bytes of a file: (file, offset, nbytes)


class Declined(Exception):
    """These files are read through the torch reader instead (the reason in words)."""


@dataclass(frozen=True)
class Shard:
    """One TP shard of a tensor: its bytes in files, as parts along dim 0 (one part in a per-rank shard file;
    a torch_dist SwiGLU shard is two chunks, [gate_r; up_r])."""
    parts: tuple[tuple[Path, TensorInfo], ...]

    @property
    def dtype(self) -> str:
        return self.parts[0][1].dtype

    @property
    def rows(self) -> int:
        return sum(info.shape[0] for _, info in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for _, info in self.parts)

    @property
    def whole(self) -> list[Range]:
        return [(path, info.offset, info.nbytes) for path, info in self.parts]

    def byte_ranges(self, start: int, stop: int) -> list[Range]:
        """(file, offset, nbytes) of rows [start, stop) along dim 0, one per part they fall in."""
        out, first = [], 0
        for path, info in self.parts:
            row = info.nbytes // info.shape[0]
            lo, hi = max(start, first), min(stop, first + info.shape[0])
            if lo < hi:
                out.append((path, info.offset + (lo - first) * row, (hi - lo) * row))
            first += info.shape[0]
        return out


Shards = dict[str, list[Shard]]  # global key -> its TP shards, rank order


def _state(meta: checkpoint.Meta, name: str, entry: str) -> tuple[Path, dict]:
    """One shard file's `entry` dict, read without torch, when the file has the size meta.json records."""
    path = meta.dir / name
    if not path.is_file() or checkpoint.size_problem(meta, path):
        raise Declined(f"{path}: missing, or not of the size meta.json records")
    obj = read(path)
    if not (isinstance(obj, dict) and isinstance(obj.get(entry), dict)):
        raise Declined(f"{path}: holds no {entry!r} state dict")
    return path, obj[entry]


def _shard(path: Path, info: TensorInfo) -> Shard:
    if info.offset + info.nbytes > path.stat().st_size:
        raise Declined(f"{path}: a tensor beyond the end of the file")
    return Shard(((path, info),))


@dataclass
class Index:
    """A checkpoint's tensors as byte ranges: the model's shards and those to copy (the model's, or its fp32 master
    weights), the form's meta; `ours`: our format; `megatron_optimizer`: a Megatron-LM source that holds optimizer
    state (which the torch path decodes); `made`: the global keys whose bytes are not the table's, which the torch
    reader makes, tensor by tensor (the byte path takes the others)."""
    meta: checkpoint.Meta
    model: Shards
    sources: Shards
    ours: bool = False
    megatron_optimizer: bool = False
    made: frozenset[str] = frozenset()


def _no_master(from_master: bool) -> None:
    if from_master:
        raise Declined("no optimizer state is read from a Megatron-LM checkpoint")


def dist_index(src: Path, vocab_size: int | None, from_master: bool) -> Index:
    """A torch_dist (torch_dcp, fsdp_dtensor) checkpoint's model shards as byte ranges of its chunks, read torch-free;
    every check the torch path's reader makes must pass."""
    _no_master(from_master)
    from ckpt_tools.forms.torch_dist import DistCheckpoint
    ckpt = DistCheckpoint.read(megatron_lm.resolve_iter_dir(src), vocab_size, load=read, load_embedded=read)
    if ckpt.validate():
        raise Declined("the checkpoint does not match the layout table")
    parts = ckpt.byte_parts()
    if parts is None:
        raise Declined("a TP shard that is not whole chunks")
    held = ckpt.optimizer_form is not None or bool(ckpt.common.get("optimizer"))
    model = {key: [Shard(tuple(p)) for p in ranks] for key, ranks in parts.items()}
    return Index(ckpt.meta, model, model, megatron_optimizer=held)


def legacy_index(src: Path, vocab_size: int | None, from_master: bool) -> Index:
    """A legacy (`--ckpt-format torch`) checkpoint's model shards as byte ranges of its rank files, read torch-free;
    every check the torch path's reader makes must pass. An interleaved pipeline's virtual stages are the model chunks
    of their files (megatron_lm.virtual_file). The tensors whose bytes are not the table's are left to the torch
    reader, one by one (`Index.made`): grouped-GEMM experts (their blocks transposed) and experts held whole on every TP
    rank (ETP 1, cut). The fused QKV rows of a legacy row order (megatron_lm.qkv_order) are byte ranges too, their runs
    in megatron-core's order (megatron_lm.qkv_runs)."""
    _no_master(from_master)
    iter_dir = megatron_lm.resolve_iter_dir(src)
    meta = megatron_lm.read_meta(iter_dir, vocab_size, load=read)
    vpp, whole = meta.raw.get(megatron_lm.VIRTUAL, 1), bool(meta.raw.get(megatron_lm.WHOLE_EXPERTS))
    shards: Shards = {}
    made: set[str] = set()
    held, files = False, {}
    for rank in meta.grid.ranks():
        physical, v, pp = megatron_lm.virtual_file(meta, rank)
        path = megatron_lm.model_path(iter_dir, physical, pp)
        if path not in files:
            files[path] = read(path)
            held = held or bool(files[path].get("optimizer")) or (path.parent / megatron_lm.DISTRIB_OPTIM).is_file()
        obj = megatron_lm.chunk(files[path], v, vpp, path)
        state = megatron_lm.model_state(obj, path, split=False)
        if state is None:
            raise Declined(f"{path}: holds no model state dict")
        state = {k: t for k, t in state.items() if not k.endswith(megatron_lm.GROUPED)}
        torch_made = _made_by_torch(meta, rank, state, whole, megatron_lm.grouped_experts(obj.get("model") or {}))
        state = {k: t for k, t in state.items() if k not in torch_made}
        if checkpoint.shard_problems(meta, path, state, rank, _is_tensor, frozenset(torch_made)):
            raise Declined(f"{path}: does not match the layout table")
        _add_shards(shards, meta, rank, path, state, _qkv_runs(meta, megatron_lm.qkv_order(path, obj)))
        made |= set(torch_made.values())
    if made & shards.keys() or any(layout.has_padded_rows(k, meta.spec, meta.pp_size) for k in made):
        raise Declined("a tensor the torch reader makes in some files and not in others, or a vocab tensor")
    return Index(meta, shards, shards, megatron_optimizer=held, made=frozenset(made))


def _made_by_torch(meta: checkpoint.Meta, rank: Rank, state: dict, whole: bool, grouped: bool) -> dict[str, str]:
    """The tensors of one legacy file (file-local key -> global key) that only the torch reader decodes: experts held
    whole (`whole`: cut) or grouped (`grouped`: transposed; their tensors not in `state`)."""
    out = {}
    for local, key in meta.rank_keys(rank, owned=True):
        if megatron_lm.expert_weight(key, meta.spec) and (whole or (grouped and local not in state)):
            out[local] = key
    return out


def _qkv_runs(meta: checkpoint.Meta, order: int | None) -> list[tuple[int, int]] | None:
    """A legacy row order's fused QKV rows as runs of megatron-core's (megatron_lm.qkv_runs), None where they are."""
    if order is None:
        return None
    return megatron_lm.qkv_runs(order, meta.spec.num_attention_heads // meta.tp_size, meta.spec.kv_channels)


def ours_index(src: Path, vocab_size: int | None, from_master: bool) -> Index:
    """Our checkpoint's model shards, and with `from_master` its fp32 master weights, as byte ranges of its shard
    files; every check the torch path's reader makes must pass."""
    meta = checkpoint.Meta.read(checkpoint.resolve(src))
    if vocab_size not in (None, meta.spec.vocab_size) or checkpoint.extra_shards(meta):
        raise Declined("--vocab-size differs from meta.json, or extra shard files")
    if from_master and meta.fresh_optimizer:
        raise Declined("a fresh optimizer's masters are made from the weights (contract 2)")
    model = _model_shards(meta)
    return Index(meta, model, {**model, **field_shards(meta)} if from_master else model, ours=True)


def _model_shards(meta: checkpoint.Meta) -> Shards:
    """The tensors of every model shard, which must pass the checks the torch path makes."""
    shards: Shards = {}
    for rank in meta.grid.ranks():
        path, state = _state(meta, checkpoint.model_file(rank), "model")
        if checkpoint.shard_problems(meta, path, state, rank, _is_tensor):
            raise Declined(f"{path}: does not match the layout table")
        _add_shards(shards, meta, rank, path, state)
    return shards


def _is_tensor(t: object) -> bool:
    return isinstance(t, TensorInfo)


def _add_shards(shards: Shards, meta: checkpoint.Meta, rank: Rank, path: Path, state: dict,
                qkv: list[tuple[int, int]] | None = None) -> None:
    """One rank's tensors appended to their keys' shard lists (files are visited in rank order); `qkv`: the fused QKV
    rows of a legacy row order as runs in megatron-core's order (megatron_lm.qkv_runs), one part each."""
    for local, key in meta.rank_keys(rank, owned=True):
        info = state.get(local)
        if not isinstance(info, TensorInfo):
            continue
        shard = _shard(path, info)
        if qkv is not None and key.endswith(megatron_lm.QKV):
            row = info.nbytes // info.shape[0]
            shard = Shard(tuple((path, TensorInfo(info.dtype, (n,) + tuple(info.shape[1:]), info.offset + a * row))
                                for a, n in qkv))
        shards.setdefault(key, []).append(shard)


def field_shards(meta: checkpoint.Meta, field: str = "master", written: bool = False) -> Shards:
    """One optimizer field (the fp32 master weights, exp_avg, exp_avg_sq, or the scalar step) of every optimizer
    shard, each of its parameter's shard shape (the step: a scalar). `written`: a fresh optimizer's files, which hold
    the masters of some parameters alone (contract 2): those, each on every TP rank that holds the parameter."""
    shards: Shards = {}
    for rank in meta.grid.ranks():
        name = checkpoint.optimizer_file(rank)
        if written and not (meta.dir / name).is_file() and name not in meta.raw.get("files", {}):
            continue
        path, state = _state(meta, name, "optimizer")
        for local, key in meta.rank_keys(rank, owned=True):
            shape = layout.shard_shape(key, meta.spec, meta.padded_vocab, meta.tp_size, meta.pp_size)
            if shape is None or not layout.has_optimizer_state(key, meta.spec, meta.pp_size):
                continue
            entry = state.get(local)
            info = entry.get(field) if isinstance(entry, dict) else None
            if written and info is None:
                continue
            if not (isinstance(info, TensorInfo) and info.shape == (() if field == "step" else shape)):
                raise Declined(f"{path}: no {field} of shape {shape} for {local}")
            shards.setdefault(key, []).append(_shard(path, info))
    if written and any(len(ts) != meta.tp_size for ts in shards.values()):
        raise Declined(f"{meta.dir}: a fresh optimizer's masters written for some TP ranks of a parameter only")
    return shards


def has_optimizer(meta: checkpoint.Meta) -> bool:
    """Optimizer shards exist or meta.json records them, or the fresh optimizer it records (as the torch reader's
    has_optimizer)."""
    if meta.fresh_optimizer:
        return True
    recorded = meta.raw.get("files", {})
    return any((meta.dir / checkpoint.optimizer_file(r)).is_file() or checkpoint.optimizer_file(r) in recorded
               for r in meta.grid.ranks())
