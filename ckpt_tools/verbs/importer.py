"""`ckpt import` (HF -> shards): all TP ranks of a stage written side by side, one full tensor in memory at a time,
into our format (target.Target) or, through to_megatron.py, Megatron-LM's forms.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ckpt_tools import output
from ckpt_tools.errors import FormatError
from ckpt_tools.forms import checkpoint as fmt
from ckpt_tools.forms.hf_tensors import HFTensors
from ckpt_tools.forms.shards import MODEL
from ckpt_tools.forms.target import Target, finish
from ckpt_tools.forms.writers import dtype_name
from ckpt_tools.model import conversions, hf, layout, shard_ops
from ckpt_tools.model.spec import ModelSpec
from ckpt_tools.team import SOLO, Team
from ckpt_tools.verbs import ours_copy, to_megatron
from ckpt_tools.verbs.request import Layout, Request


def import_hf(hf_dir: str | Path, out: str | Path, tp: int = 1, pp: int = 1, layers: list[int] | None = None,
              dtype: torch.dtype | None = None, force: bool = False, quiet: bool = False, copy_bytes: bool = True,
              team: Team = SOLO, **asked) -> str:
    """`asked`: the rest of the target, request.Request's fields (form, optimizer, ep, vpp, model). `copy_bytes`: copy
    the HF tensors' rows where verbs.dist_copy (Megatron-LM's forms) or verbs.ours_copy (ours) take them
    (paths.import_hf)."""
    from ckpt_tools.verbs import paths
    return paths.import_hf(hf_dir, out, Request(tp, pp, layers, **asked), dtype_name(dtype) if dtype else None, force,
                           quiet, team, copy_bytes)


def run(hf_dir: str | Path, out: str | Path, want: Request, dtype: torch.dtype | None = None, force: bool = False,
        quiet: bool = False, team: Team = SOLO) -> str:
    """Import the HF model as `want` says into OUT through torch (paths.import_hf chooses it; `dtype`: the weights',
    None: the HF weights' own). `team`: the processes writing the output's files between them (ckpt_tools.team)."""
    want.check()
    start = time.perf_counter()
    hf_dir, out = Path(hf_dir), output.check_target(out, force)
    leftover = output.note_leftovers(out)  # before this run stages its own
    tail = f"\n{leftover}" if leftover else ""
    source = HFTensors(hf_dir)
    spec = hf.spec_of_model(hf_dir, source.where)
    target = want.resolve(spec)
    layout.check_ep(spec, target.ep)
    tp, counts, padded, ep, pp, optimizer = target.tp, target.counts, target.padded, target.ep, target.pp, \
        want.optimizer
    rows = {key: (row, names) for key, row, names in hf.hf_keys(spec)}
    wanted = {n for _, names in rows.values() for n in names}
    extra = sorted(set(source.where) - {hf.part_of(n)[0] for n in wanted} - hf.tied_head(spec))
    missing = sorted(n for n in wanted if not source.holds(n))
    copies = hf.check_copies(source, spec, hf_dir)  # MTP layers' copies of the embedding and head
    extra = [n for n in extra if n not in copies]
    if not missing and extra and all(n.startswith("mtp.") for n in extra):
        raise FormatError(f"{hf_dir}: {len(extra)} multi-token prediction tensors ({', '.join(extra[:2])} ...), which "
                          f"transformers' {spec.architecture} does not load and this version does not convert: save "
                          f"the model without them (transformers' save_pretrained drops them) to convert the rest")
    if missing or extra:
        what = "; ".join(x for x in (f"missing {', '.join(missing[:4])}" if missing else "",
                                     f"unexpected {', '.join(extra[:4])}" if extra else "") if x)
        raise FormatError(f"{hf_dir}: tensors do not match a {spec.architecture} model of this config.json ({what}): "
                          f"the weights and config.json disagree")
    wrong = [f"{name} {list(source.shape(name))}, expected {n} slices first"  # a stacked tensor: one slice per expert
             for name, n in hf.slice_counts(wanted).items() if source.shape(name)[0] != n]
    for key, (row, names) in rows.items():
        for name, shape in zip(names, conversions.hf_shapes(row.kind, spec, layout.full_shape(key, spec, padded))):
            if source.shape(name) != tuple(shape):
                wrong.append(f"{name} {list(source.shape(name))}, expected {list(shape)}")
    if wrong:
        raise FormatError(f"{hf_dir}: tensor shapes do not match a {spec.architecture} model of this config.json "
                          f"({'; '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''}): "
                          f"the weights and config.json disagree")
    first = source.get(rows["embedding.word_embeddings.weight"][1][0])
    params_dtype = dtype or first.dtype
    if want.megatron:
        return _import_to_megatron(hf_dir, source, rows, out, target, spec, params_dtype, force, quiet, start,
                                   team) + tail
    # A fresh optimizer is recorded in meta.json, not written (contract 2): zero moments, step 0, masters equal to the
    # weights; the masters are written (alone) where the HF weights carry more than the weights' dtype keeps.
    carried = hf.fresh_masters(rows, spec, dtype_name(params_dtype), source.dtype_name, pp) if optimizer else set()
    masters = bool(carried)
    with output.staged(out, force, team=team) as tmp:
        ckpt = tmp / fmt.checkpoint_name(0)
        ckpt.mkdir(exist_ok=True)
        files = Target(ckpt, spec, tp, counts, padded, masters, ep)
        files.share(team, (MODEL,), params_dtype.itemsize * (3 if masters else 1))  # a rank's model + masters
        stages = sorted({rank.pp for rank in files.mine})  # the others' stages are not read here
        bar = output.progress(sum(len(layout.stage_keys(spec, counts, p)) for p in stages), "import", quiet,
                              unit="tensor")
        for p in stages:
            files.begin_stage(p)
            for _, key in layout.stage_keys(spec, counts, p):
                if not files.holds(key):  # an expert of another process's EP ranks
                    bar.update(1)
                    continue
                if not layout.holds_weights(key, spec, pp):
                    files.put(key, None)
                    bar.update(1)
                    continue
                source_key = layout.source_key(key, rows)  # an aliased row's copy (a tied output layer): its original
                row, names = rows[source_key]
                original = conversions.from_hf(row.kind, [source.get(n) for n in names], spec, padded)
                full = original.to(_dtype(key, spec, params_dtype))
                files.put(key, full, master=original.float() if source_key in carried else False)
                bar.update(1)
            files.end_stage(dict(fmt.FRESH_EXTRAS))
        bar.close()
        origin = {"op": "import", "from": {"dir": str(hf_dir.resolve()), "format": "huggingface"}}
        meta = fmt.build_meta(spec, tp, counts, padded, 0, 0, dtype_name(params_dtype), None, {}, {}, origin, ep,
                              fresh_optimizer=optimizer)
        nbytes = finish(tmp, 0, files, meta, hf_dir, hf_dir=True, team=team)
    return ours_copy.imported(hf_dir, spec, out, tp, counts, ep, dtype_name(params_dtype), optimizer, masters, padded,
                              nbytes, time.perf_counter() - start) + tail


def _import_to_megatron(hf_dir: Path, source: HFTensors, rows: dict, out: Path, target: Layout, spec: ModelSpec,
                        params_dtype: torch.dtype, force: bool, quiet: bool, start: float, team: Team = SOLO) -> str:
    tp, pp, padded, current = target.tp, target.pp, target.padded, {}

    def shard_of(key: str, rank: int) -> torch.Tensor:
        if key not in current:  # one full tensor in memory, split for every TP rank
            row, names = rows[layout.source_key(key, rows)]  # an aliased row's copy (tied output layer): its original
            full = conversions.from_hf(row.kind, [source.get(n) for n in names], spec, padded).to(_dtype(key, spec, params_dtype))
            current.clear()
            current[key] = shard_ops.split(key, full, spec, tp, pp)
        return current[key][rank]
    nbytes = to_megatron.write(out, target, spec, dtype_name(params_dtype), shard_of, force=force, quiet=quiet,
                               label="import", carried_from=hf_dir, hf_dir=True, team=team)
    return to_megatron.imported(hf_dir, spec, out, target, dtype_name(params_dtype), nbytes,
                                time.perf_counter() - start)


def _dtype(key: str, spec, params_dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor is imported in: the weights' (params_dtype), or its layout row's own."""
    return getattr(torch, layout.dtype_of(key, spec, str(params_dtype).removeprefix("torch."), None))
