"""`ckpt reshard`: any TP/PP layout -> any other, optimizer state included (`ckpt import` is importer.py).

It writes a save dir OUT holding `checkpoint-<iteration>/` and `latest`, so the trainer resumes
from it with `load: OUT` (or `save_dir: OUT`). Streaming, one file at a time: each target shard is built from
the pieces of the mmap'd source shards that `shard_ops.reshard_pieces` names (target.Resharder; the full tensor
is never made), the same bytes as the layout table's split of the join, so a round trip is bit-exact.
Megatron-LM targets are handed to to_megatron.py.
"""
from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import torch

from ckpt_tools import io, output
from ckpt_tools.forms import checkpoint as fmt
from ckpt_tools.forms import megatron_resume
from ckpt_tools.forms.shards import MODEL, OPTIMIZER, Reader
from ckpt_tools.forms.target import Resharder, Target, finish
from ckpt_tools.model.ranks import Grid
from ckpt_tools.team import SOLO, Team
from ckpt_tools.verbs import to_megatron
from ckpt_tools.verbs.plan import prepare
from ckpt_tools.verbs.request import Layout, Request


def reshard(src: str | Path, out: str | Path, tp: int, pp: int, layers: list[int] | None = None,
            vocab_size: int | None = None, force: bool = False, quiet: bool = False, check_hashes: bool = False,
            no_preflight: bool = False, copy_bytes: bool = True, team: Team = SOLO, **asked) -> str:
    """`asked`: the rest of the target, request.Request's fields (form, optimizer, ep, vpp, model). `copy_bytes`:
    for Megatron-LM's forms, copy the source's bytes where verbs.dist_copy takes them (paths.reshard)."""
    from ckpt_tools.verbs import paths
    return paths.reshard(src, out, Request(tp, pp, layers, **asked), vocab_size, force, quiet, check_hashes,
                         no_preflight, team, copy_bytes)


def run(src: str | Path, out: str | Path, want: Request, vocab_size: int | None = None, force: bool = False,
        quiet: bool = False, check_hashes: bool = False, no_preflight: bool = False, team: Team = SOLO) -> str:
    """Rewrite `src` as `want` says into OUT through torch (paths.reshard chooses it). `team`: the processes writing
    the output's files between them (ckpt_tools.team)."""
    want.check()
    start = time.perf_counter()
    out, leftover, shards = prepare(src, out, force, vocab_size, check_hashes, team)
    meta, spec = shards.meta, shards.meta.spec
    resolved = want.resolve(spec, meta.padded_vocab, meta.ep_size, meta)
    tp, pp, counts, padded, ep = resolved.tp, resolved.pp, resolved.counts, resolved.padded, resolved.ep
    with_opt, unread = shards.has_optimizer() and want.optimizer, shards.unread_optimizer()
    output.preflight(out, sum(f.stat().st_size for f in meta.dir.iterdir() if f.is_file()), no_preflight)
    if want.megatron:
        return _reshard_to_megatron(shards, out, resolved, with_opt, force, quiet, start, unread, team)
    # a fresh optimizer stays recorded, not written: only its masters that carry more than the weights are
    fresh = with_opt and shards.fresh_optimizer()
    masters = shards.written_masters() if fresh else set()
    with_opt = with_opt and not fresh
    with output.staged(out, force, team=team) as tmp:
        ckpt = tmp / fmt.checkpoint_name(meta.iteration)
        ckpt.mkdir(exist_ok=True)
        target = Target(ckpt, spec, tp, counts, padded, with_opt or bool(masters), ep)
        extras = shards.optimizer_extras() if with_opt or masters else {}
        # the small model files last: the wait for the last one's hash is short
        kinds = (OPTIMIZER, MODEL) if with_opt or masters else (MODEL,)
        mine = target.share(team, kinds, _itemsize(meta.params_dtype))
        bar = output.progress(len(mine), "reshard", quiet, unit="file")
        resharder = Resharder(shards, target, masters if fresh else None)
        for kind, rank in mine:
            resharder.write_file(kind, rank, extras)
            bar.update(1)
        bar.close()
        if team.lead:
            _copy_rng(shards, target, Grid(tp, pp, ep))
        consumed = int(meta.raw.get("consumed_samples") or 0)
        origin = {"op": "reshard", "from": {"dir": str(meta.dir), "source": meta.source, "tp_size": meta.tp_size,
                                            "pp_size": meta.pp_size, "layers_per_stage": meta.layer_counts,
                                            "padded_vocab": meta.padded_vocab}}
        if meta.ep_size > 1:
            origin["from"]["ep_size"] = meta.ep_size
        new_meta = fmt.build_meta(spec, tp, counts, padded, meta.iteration, consumed, meta.params_dtype,
                                  meta.raw.get("parallel", {}).get("dp_size"), dict(meta.raw.get("config") or {}), {},
                                  origin, ep, fresh_optimizer=fresh)
        nbytes = finish(tmp, meta.iteration, target, new_meta, meta.dir, team=team)
    shards.close()
    from ckpt_tools.verbs.ours_copy import resharded
    return resharded(meta, out, Grid(tp, pp, ep), counts, padded, with_opt, fresh, bool(masters), unread, nbytes,
                     time.perf_counter() - start) + (f"\n{leftover}" if leftover else "")


def _reshard_to_megatron(shards: Reader, out: Path, target: Layout, with_opt: bool, force: bool, quiet: bool,
                         start: float, unread: str | None = None, team: Team = SOLO) -> str:
    meta, spec = shards.meta, shards.meta.spec
    fresh = with_opt and meta.iteration == 0  # Megatron-LM loads no iter_0000000; a fresh state holds nothing
    if with_opt and not fresh:
        to_megatron.check_optimizer_form(target.form, meta.dir)
    resume = megatron_resume.resume_state(shards) if with_opt and not fresh else None
    to_megatron.check(spec, target, meta.params_dtype, resume, meta.dir)
    resharder = Resharder(shards, SimpleNamespace(spec=spec, tp=target.tp, pp=target.pp, padded=target.padded))

    def state_of(key: str, field: str | None, rank: int) -> torch.Tensor:
        shard = resharder.shard(key, field, rank)
        shards.release()
        return shard
    nbytes = to_megatron.write(out, target, spec, meta.params_dtype, lambda key, rank: state_of(key, None, rank),
                               force=force, quiet=quiet, label="reshard", carried_from=meta.dir, resume=resume,
                               state_of=state_of, team=team)
    dropped = fresh and shards.fresh_optimizer() and bool(shards.written_masters())
    shards.close()
    return to_megatron.resharded(meta, out, target, resume, fresh, unread, nbytes, time.perf_counter() - start) + (
        to_megatron.MASTERS_NOT_WRITTEN if dropped else "")


def _itemsize(dtype: str | torch.dtype) -> int:
    return (getattr(torch, dtype) if isinstance(dtype, str) else dtype).itemsize


def _copy_rng(shards: Reader, target: Target, grid: Grid) -> None:
    """RNG and data position: the source's rank (0, 0) state for every target rank (no dropout in TP regions)."""
    rng = shards.rng_state()
    if rng is None:
        return
    for rank in grid.ranks():
        dest = target.dir / fmt.rng_file(rank)
        io.save_file(rng, dest)
        target.add_file(dest)
