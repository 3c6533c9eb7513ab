"""Megatron-LM's optimizer state -> per parameter: fp32 master weight, exp_avg, exp_avg_sq, step (the fields of
our optimizer shards), at the parameter's TP shard shape. Checked against megatron-core 0.16.1's own optimizers
(tests/mcore_optimizer_checkpoints.py, fixtures/megatron_optimizer/).

The forms (one TP x PP rank's state each):
  plain        legacy `torch`, no `--use-distributed-optimizer`: model_optim_rng.pt['optimizer'] =
               {'optimizer': Adam's state_dict (state by integer index, param_groups listing the indices),
               'fp32_from_fp16_params': [[master of each bf16/fp16 param of a group]]}; without it (fp32
               training) the master is the weight itself
  flat         legacy `torch` with `--use-distributed-optimizer`: distrib_optim.pt = {'buckets_coalesced': True,
               gbuf index: {(param dtype, grad dtype): {'param', 'exp_avg', 'exp_avg_sq': fp32 over the buckets'
               unpadded elements, 'numel_unpadded'}}}
  buckets      torch_dist `dp_reshardable` (Megatron-LM's default with the distributed optimizer): one 1-D tensor per
               bucket and field (forms/torch_dist.py names them)
  (torch_dist's per-parameter forms, `optimizer.state.<field>.<key>`, are read by forms/torch_dist.py directly.)

A parameter's place in the two bucket forms is megatron-core's grad-buffer layout, recomputed here from the
model's parameter list (`buffer_layout`); the order of parameters is `named_parameters()`, i.e. the tensors of the
model state dict in order. Params of the plain form are numbered group by group: the weight-decayed group
(`wd_mult` 1: tensors of 2+ dims that are not biases) then the other (`wd_mult` 0), each in parameter order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ckpt_tools.errors import FormatError
from ckpt_tools.forms.megatron_resume import decayed
from ckpt_tools.model.layout import is_buffer

FIELDS = ("master", "exp_avg", "exp_avg_sq")
FLAT_FIELDS = {"master": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
ALIGN = 64  # elements: every parameter starts on a multiple (megatron-core's grad buffer)


@dataclass(frozen=True)
class Param:
    key: str  # stage-local key
    shape: tuple[int, ...]
    shared_embedding: bool = False  # a tied embedding / output copy at PP > 1: a bucket of its own

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Layout:
    """megatron-core's grad buffer of one rank: each parameter's [start, end) and bucket; each bucket's
    [start, end) (end padded) and unpadded length."""
    where: dict[str, tuple[int, int, int]]
    buckets: list[tuple[int, int, int]]

    def gaps(self) -> list[tuple[int, int]]:
        """The alignment gaps between parameters inside the buckets, in the flat (unpadded, end to end) space."""
        out, base = [], 0
        for b, (start, _, unpadded) in enumerate(self.buckets):
            pos = start
            for s, e in sorted((s, e) for s, e, bucket in self.where.values() if bucket == b):
                if s > pos:
                    out.append((base + pos - start, base + s - start))
                pos = e
            base += unpadded
        return out

    def flat_offset(self, key: str) -> int:
        """Where a parameter starts in the buckets' unpadded elements laid end to end (distrib_optim.pt)."""
        start, _, b = self.where[key]
        return sum(n for _, _, n in self.buckets[:b]) + start - self.buckets[b][0]


def buffer_layout(params: list[Param], dp_size: int, bucket_size: int | None, pad_for_nccl: bool = False) -> Layout:
    """megatron-core's param_and_grad_buffer layout: parameters in reverse order, each starting on a multiple of
    64 elements; a bucket closes once it holds `bucket_size` elements (and around a shared embedding), its end
    padded to a multiple of lcm(dp_size, 128) (and 65536 with --ddp-pad-buckets-for-high-nccl-busbw)."""
    div = math.lcm(dp_size, 128, 65536) if pad_for_nccl else math.lcm(dp_size, 128)
    where: dict[str, tuple[int, int, int]] = {}
    buckets: list[tuple[int, int, int]] = []
    pos = bucket_start = count = 0

    def close(end: int) -> int:
        nonlocal bucket_start, count
        padded = -(-end // div) * div
        buckets.append((bucket_start, padded, end - bucket_start))
        bucket_start, count = padded, 0
        return padded

    end = 0
    for p in reversed(params):
        pos = -(-pos // ALIGN) * ALIGN
        if p.shared_embedding and count > 0:
            pos = close(pos)
        end = pos + p.numel
        where[p.key] = (pos, end, len(buckets))
        count += 1
        full = bucket_size is not None and end - bucket_start >= bucket_size
        pos = close(end) if full or p.shared_embedding else end
    if count > 0:
        close(end)
    return Layout(where, buckets)


def te_order(params: list) -> list:
    """The parameters of a Transformer Engine layer in its named_parameters() order: its input norm is fused into
    linear_qkv, which megatron-core builds after linear_proj, so the norm follows linear_proj (the local spec
    registers input_layernorm first). Items are Params or (key, ...) tuples."""
    def key(p) -> str:
        return p.key if isinstance(p, Param) else p[0]
    out, held = [], []
    for i, p in enumerate(params):
        k = key(p)
        if ".input_layernorm." in k:
            held.append(p)
            continue
        out.append(p)
        following = key(params[i + 1]) if i + 1 < len(params) else ""
        if ".self_attention.linear_proj." in k and following != k.rsplit(".", 1)[0] + ".bias":
            out += held  # after linear_proj's last parameter
            held = []
    return out + held


def same_as_weight(master, weight) -> bool:
    """A fp32 master rounded to the weight's dtype is the weight (Megatron copies masters into the weights
    after every step): the check that an optimizer state belongs to these weights at these places."""
    return tuple(master.shape) == tuple(weight.shape) and bool(torch.equal(master.to(weight.dtype), weight))


def bucket_size_of(args, pp_rank: int, dp_size: int) -> int | None:
    """The DDP bucket size a Megatron-LM run used on a pipeline stage: none without --overlap-grad-reduce and on
    every stage but the first."""
    if not getattr(args, "overlap_grad_reduce", False) or pp_rank > 0:
        return None
    return getattr(args, "ddp_bucket_size", None) or max(40_000_000, 1_000_000 * dp_size)


def dp_size_of(args) -> int:
    return int(getattr(args, "data_parallel_size", None) or 1) * int(getattr(args, "context_parallel_size", None) or 1)


def params_of(model: dict, shared: set[str]) -> list[Param]:
    """The parameters of one rank's model state dict, in named_parameters() order (its buffers are not)."""
    return [Param(k, tuple(v.shape), k in shared) for k, v in model.items()
            if torch.is_tensor(v) and not k.endswith("_extra_state") and not is_buffer(k)]


def _refuse(path: Path, what: str) -> FormatError:
    return FormatError(f"{path}: {what}: the optimizer state cannot be mapped to the model's parameters; the file is "
                       f"damaged or of a layout this version does not read: restore it from the source")


def _step(path: Path, groups: list[dict]):
    steps = {float(g["step"]) for g in groups if g.get("step") is not None}
    if not steps:
        raise _refuse(path, "its param groups hold no Adam step")
    return torch.tensor(max(steps))


def plain_order(path: Path, groups: list, params: list[Param],
                masters: list[int] | None) -> list[tuple[Param, int, int, int]]:
    """Where megatron-core's non-distributed optimizer (Float16OptimizerWithFloat16Params or FP32Optimizer) keeps each
    parameter's state: (param, its param group, its place in the group, its Adam state index). `groups`: Adam's
    param_groups; `masters`: how many fp32 masters each group holds (None: fp32 weights, no masters). megatron-core's
    default groups: weight decay on the 2-D weights, none on biases and 1-D parameters, in the model's order."""
    by_wd = {1.0: [p for p in params if decayed(p.key, p.shape)]}
    by_wd[0.0] = [p for p in params if p not in by_wd[1.0]]
    out = []
    for g_index, group in enumerate(groups):
        mult = float(group.get("wd_mult", 1.0 if group.get("weight_decay", 0) else 0.0))
        if group.get("lr_mult", 1.0) != 1.0 or group.get("is_expert_parallel") or group.get("is_decoupled_lr") \
                or mult not in by_wd:
            raise _refuse(path, f"param group {g_index} (wd_mult {mult}, lr_mult {group.get('lr_mult')}) is not one "
                                f"of the default weight-decay groups")
        members, indices = by_wd[mult], group.get("params", [])
        if len(members) != len(indices):
            raise _refuse(path, f"param group {g_index} lists {len(indices)} parameters, the model has {len(members)} "
                                f"{'with' if mult else 'without'} weight decay")
        if masters is not None and masters[g_index] != len(indices):
            raise _refuse(path, f"param group {g_index} has {masters[g_index]} fp32 masters for {len(indices)} "
                                f"parameters (some weights are not 16-bit)")
        out += [(p, g_index, j, index) for j, (p, index) in enumerate(zip(members, indices))]
    return out


def decode_plain(path: Path, opt: dict, params: list[Param], model: dict) -> dict[str, dict]:
    """The legacy non-distributed form (Float16OptimizerWithFloat16Params or FP32Optimizer)."""
    inner = opt.get("optimizer") if "param_groups" not in opt else opt  # FP32Optimizer: Adam's own state_dict
    if not isinstance(inner, dict) or not isinstance(inner.get("param_groups"), list):
        raise _refuse(path, "['optimizer'] holds no Adam state_dict with param_groups")
    groups, state = inner["param_groups"], inner.get("state", {})
    masters = opt.get("fp32_from_fp16_params")
    if masters is None and any(t.dtype != torch.float32 for t in (model[p.key] for p in params)):
        raise _refuse(path, "no fp32_from_fp16_params beside the Adam state of 16-bit weights (the fp32 masters "
                            "are missing)")
    out: dict[str, dict] = {}
    for p, g_index, j, index in plain_order(path, groups, params, None if masters is None else
                                            [len(m) for m in masters]):
        group = groups[g_index]
        s = state.get(index, {})
        if masters is not None:
            master = masters[g_index][j]
        else:  # fp32 training: the weight is the master
            master = model[p.key]
        fields = {"master": master, "exp_avg": s.get("exp_avg"), "exp_avg_sq": s.get("exp_avg_sq")}
        for name, t in fields.items():
            if not torch.is_tensor(t) or tuple(t.shape) != p.shape:
                raise _refuse(path, f"{p.key}: its {name} (param {index} of group {g_index}) is "
                                    f"{tuple(t.shape) if torch.is_tensor(t) else t!r}, expected {p.shape}")
        if not same_as_weight(master, model[p.key]):
            raise _refuse(path, f"{p.key}: its fp32 master (param {index} of group {g_index}) rounded to "
                                f"{model[p.key].dtype} is not the weight: the parameter numbering differs")
        step = s.get("step", group.get("step"))
        if step is None:
            raise _refuse(path, f"{p.key}: no Adam step (neither per parameter nor per group)")
        out[p.key] = {**{k: v.float() for k, v in fields.items()}, "step": torch.tensor(float(step))}
    missing = [p.key for p in params if p.key not in out]
    if missing:
        raise _refuse(path, f"no state for {', '.join(missing[:3])}")
    return out


def decode_flat(path: Path, flat: dict, params: list[Param], layout: Layout, groups: list[dict],
                model: dict) -> dict[str, dict]:
    """The legacy distributed-optimizer form (distrib_optim.pt): one grad buffer of one dtype pair; every master
    must round to its weight (else the layout is not the run's, and nothing is decoded)."""
    buffers = [v for k, v in flat.items() if k != "buckets_coalesced"]
    if not flat.get("buckets_coalesced") or len(buffers) != 1 or len(buffers[0]) != 1:
        raise _refuse(path, f"{len(buffers)} grad buffers ({', '.join(map(str, flat))}); one buffer of one dtype pair "
                            f"(a dense model without experts) is read")
    (dtypes, state), = buffers[0].items()
    unpadded = sum(n for _, _, n in layout.buckets)
    if state.get("numel_unpadded") != unpadded:
        raise _refuse(path, f"{state.get('numel_unpadded')} elements, the model's grad-buffer layout has {unpadded} "
                            f"(check the run's --overlap-grad-reduce / --ddp-bucket-size / data-parallel size in args)")
    for name in FLAT_FIELDS.values():
        t = state.get(name)
        if not torch.is_tensor(t) or t.dim() != 1 or t.numel() != unpadded or t.dtype != torch.float32:
            raise _refuse(path, f"its {name!r} is {tuple(t.shape) if torch.is_tensor(t) else t!r:.40}, expected fp32 "
                                f"of {unpadded} elements")
    master = state["param"]
    stray = [(a, b) for a, b in layout.gaps() if bool(master[a:b].any())]
    if stray:  # the gaps are zeros in the file: data there means the buckets were laid out otherwise
        raise _refuse(path, f"its fp32 masters hold data in {len(stray)} alignment gap(s) of the grad-buffer layout "
                            f"computed from args (first at element {stray[0][0]}): the run's bucketing differs from "
                            f"what args say (--overlap-grad-reduce, --ddp-bucket-size, data-parallel size)")
    step = _step(path, groups)
    out = {}
    for p in params:
        start = layout.flat_offset(p.key)
        out[p.key] = {f: state[FLAT_FIELDS[f]][start:start + p.numel].view(p.shape) for f in FIELDS}
        if not same_as_weight(out[p.key]["master"], model[p.key]):
            raise _refuse(path, f"{p.key}: the fp32 master at element {start} of the grad-buffer layout does not "
                                f"round to the weight: the run's buffer layout differs from the one computed")
        out[p.key]["step"] = step
    return out
