"""`ckpt import HF OUT` and `ckpt reshard SRC OUT` into our format: each rank's `pytorch_model_tp_X_pp_Y.bin` (and
`optimizer_tp_X_pp_Y.bin`) written as torch.save lays it out, its tensors' bytes copied from the source's files by
forms/legacy_copy.py's rank writer, or made by torch one by one where their values are not the source's bytes.

Import: the HF tensors as a TP 1 source (each megatron-core tensor's rows are row ranges of the HF tensors,
conversions.hf_rows; a tensor whose value is not its HF bytes made by torch, hf_copy.made_by_torch; with `through`, the
model read through torch, importer.checked, every tensor made). The fresh optimizer is recorded in meta.json, not
written (contract 2); the fp32 masters of the tensors whose HF values carry more than the dtype they are kept in (an
fp32 router of a bf16 DeepSeek-V3, fp32 weights imported in bf16) are written alone, each rank's into its optimizer file.

Reshard (`reshard`): the source's shards, and its optimizer fields (fp32 master, exp_avg, exp_avg_sq, step), cut to
the target's TP x PP x EP by the layout table's pieces (shard_ops.reshard_pieces) and copied file to file, a
row-parallel shard gathered in memory; its RNG file given to every target rank; a fresh optimizer stays recorded, its
written masters carried. Sources: what byte_ranges.ByteSource reads (ours; Megatron-LM's legacy, torch_dist, torch_dcp
and fsdp_dtensor files, their optimizer's fields made by the form's torch reader, parameter by parameter), or a
source read through its torch reader (ByteSource.through: paths.reshard's where the bytes do not do: a Megatron-LM
optimizer left behind, which the reader names; input the byte index declines, which the reader words; optimizer
extras that hold tensors). Extra-state entries (`_extra_state`) are written None, as megatron-core's local spec and
the trainer hold them.
"""
from __future__ import annotations

import itertools
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from ckpt_tools import durable, io, output
from ckpt_tools.errors import CkptError
from ckpt_tools.forms import checkpoint as fmt
from ckpt_tools.forms import legacy_copy, torchsave
from ckpt_tools.forms.byte_index import Declined, field_shards, has_optimizer
from ckpt_tools.forms.byte_ranges import ByteSource
from ckpt_tools.forms.dtypes import ELEMENT_SIZES
from ckpt_tools.forms.made import MadeShard
from ckpt_tools.forms.torchfile import TensorInfo, Unreadable, read
from ckpt_tools.model import hf, layout, shard_ops
from ckpt_tools.model.ranks import Grid, Rank
from ckpt_tools.model.spec import ModelSpec
from ckpt_tools.team import SOLO, Team
from ckpt_tools.verbs import dist_copy, hf_copy
from ckpt_tools.verbs.request import Request


def import_hf(hf_dir: str | Path, out: str | Path, want: Request, dtype: str | None = None, force: bool = False,
              quiet: bool = False, team: Team = SOLO, through: bool = False) -> str | None:
    """paths.import_hf(..., `want` of our format) by copying bytes; `dtype` a dtype name (None: the HF weights'). None
    where the bytes are not read so (hf_copy.import_hf): `through` then reads the model through torch, every tensor
    made by torch, for the same writer. In a team each process writes a run of the rank files (balanced by their
    bytes), process 0 the rest."""
    start = time.perf_counter()
    hf_dir = Path(hf_dir)
    started = hf_copy.start_through(hf_dir, out, want, dtype, force) if through else \
        hf_copy.start_hf_copy(hf_copy.copied_hf(hf_dir, dtype), out, want, force, team)
    if started is None:
        return None
    spec, index, rows, params, out, leftover, target, dtype_of = started
    tp, counts, padded, ep, optimizer = target.tp, target.counts, target.padded, target.ep, want.optimizer
    layout.check_ep(spec, ep)
    ranks = Grid(tp, len(counts), ep).ranks()
    owners = team.split([layout.rank_numel(spec, counts, padded, tp, r.pp, r.ep, ep) for r in ranks])
    mine = [r for r, owner in zip(ranks, owners) if owner == team.rank]
    with output.staged(out, force, team=team) as tmp:
        ckpt = tmp / fmt.checkpoint_name(0)
        ckpt.mkdir(exist_ok=True)
        source, written = hf_copy.rank_file_source(hf_dir, spec, index, rows, params, padded), {}
        carried = hf.fresh_masters(rows, spec, params, dtype_of, len(counts)) if optimizer else set()
        try:
            nbytes = legacy_copy.write_files(source, [(ckpt / fmt.model_file(r), [r]) for r in mine], counts, padded,
                                             tp, ep, {}, quiet, "import", written)
            for r in mine if carried else ():
                path = ckpt / fmt.optimizer_file(r)
                nbytes += _write_masters(path, source, r, carried, rows, tp, counts, ep)
                written[path] = fmt.file_record(path)
        finally:
            source.close()
        origin = {"op": "import", "from": {"dir": str(hf_dir.resolve()), "format": "huggingface"}}
        nbytes = _finish(tmp, 0, written, nbytes, hf_dir, True, team, lambda files: fmt.build_meta(
            spec, tp, counts, padded, 0, 0, params, None, {}, files, origin, ep, fresh_optimizer=optimizer))
    return imported(hf_dir, spec, out, tp, counts, ep, params, optimizer, bool(carried), padded, nbytes,
                    time.perf_counter() - start) + (f"\n{leftover}" if leftover else "")


def _write_masters(path: Path, source: legacy_copy.HFSource, rank: Rank, carried: set[str], rows: dict, tp: int,
                   counts: list[int], ep: int = 1) -> int:
    """A rank's optimizer file holding the fresh fp32 masters of its `carried` tensors alone (the output layer's copy
    at PP > 1 with its embedding's), the HF values split as the torch path splits them; its tensors' bytes."""
    spec, nbytes, state = source.meta.spec, 0, {}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        archive = torchsave.Archive(fd, 0, path.stem)
        for local, key in layout.stage_keys(spec, counts, rank.pp, rank.ep, ep):
            held = layout.source_key(key, rows)
            if held not in carried:
                continue
            row, names = rows[held]
            full = source.maker.tensor(row.kind, names, "float32")
            shard = shard_ops.split(key, full, spec, tp, len(counts))[rank.tp].contiguous()
            ref = str(len(state))
            archive.add(f"data/{ref}", [legacy_copy.as_bytes(shard)])
            state[local] = {"master": torchsave.TensorRef(ref, "float32", tuple(shard.shape))}
            nbytes += shard.numel() * 4
        torchsave.finish(archive, torchsave.dumps({"optimizer": state, **fmt.FRESH_EXTRAS}))
        os.fsync(fd)
    finally:
        os.close(fd)
    return nbytes


def imported(hf_dir: Path, spec: ModelSpec, out: Path, tp: int, counts: list[int], ep: int, dtype: str,
             optimizer: bool, masters: bool, padded: int, nbytes: int, seconds: float) -> str:
    """The one-line summary of an import into our format (either path)."""
    return (f"imported {hf_dir} ({spec.architecture}, {spec.num_layers} layers) -> {out} {Grid(tp, len(counts), ep)} "
            f"(layers {counts}), {dtype}, "
            + ("fresh optimizer state (recorded in meta.json" + (", its fp32 masters written" if masters else
                                                                  ", not written") + ")" if optimizer
               else "no optimizer state") + f", padded vocab {padded}, {nbytes / 2**20:,.1f} MiB, {seconds:.1f}s")


def _finish(tmp: Path, iteration: int, written: dict, nbytes: int, carried_from: Path, hf_dir: bool, team: Team,
            build) -> int:
    """The checkpoint's end, once every process's files are written (`written`: record by path): the files carried
    from `carried_from` (tokenizer, chat templates, HF config; `hf_dir`: from an HF model), meta.json (`build(files)`,
    every file's record), `latest`. The bytes of the shard files, every process's (process 0 says the total)."""
    ckpt = tmp / fmt.checkpoint_name(iteration)
    shared = team.share(lambda: ({path.relative_to(ckpt).as_posix(): record for path, record in written.items()},
                                 nbytes), to_lead=True)
    if not team.lead:
        return nbytes
    records = {name: record for part, _ in shared for name, record in part.items()}
    for path in hf.copy_carried(carried_from, ckpt, hf_dir):
        records[path.relative_to(ckpt).as_posix()] = fmt.file_record(path)
        durable.fsync_file(path)
    fmt.write_meta(ckpt / fmt.META, build(dict(sorted(records.items()))))
    durable.fsync_dir(ckpt)
    io.write_text_atomic(tmp / fmt.LATEST, fmt.checkpoint_name(iteration) + "\n")
    return sum(n for _, n in shared)


# ---------------------------------------------------------------- reshard: our format's files from the source's bytes
@dataclass
class _Copied:
    """What a reshard into our format copies beside the model: the optimizer fields' shards (`fields`, the step
    among them), or a fresh optimizer's written masters alone (`masters`, those of `master_keys`); the optimizer files'
    other entries (`extras`); the RNG state every target rank gets (`rng`: a file copied, or a state loaded by the
    torch reader); what the summary says (`with_opt`, `fresh`, `unread`)."""
    fields: dict
    masters: object | None
    master_keys: set
    extras: dict
    rng: object | None
    with_opt: bool
    fresh: bool
    unread: str | None = None


def reshard(source: ByteSource, out: str | Path, want: Request, force: bool = False, quiet: bool = False,
            check_hashes: bool = False, no_preflight: bool = False, team: Team = SOLO) -> str | None:
    """paths.reshard(..., `want` of our format) from `source`: its byte ranges copied, the tensors torch makes
    (ByteSource.made, made_fields) written from memory. None (nothing written) where the bytes do not hold what the
    copy needs (paths.reshard then reads the source through its torch reader, ByteSource.through, which this always
    takes). In a team each process writes a run of the files (balanced by their bytes), process 0 the rest."""
    start = time.perf_counter()
    copied = _through(source, want) if source.read_through else _copied(source, want)
    if not team.all(copied is not None):  # one path for all: a process that declined sends every one through torch
        return None
    return _reshard_copy(source, copied, out, want, force, quiet, check_hashes, no_preflight, start, team)


def _through(source: ByteSource, want: Request) -> _Copied:
    """What is copied beside the model from a source read through its torch reader (ByteSource.through)."""
    reader = source.maker
    with_opt = want.optimizer and reader.has_optimizer()
    fresh = with_opt and reader.fresh_optimizer()
    keys = reader.written_masters() if fresh else set()
    fields = {f: source.made_fields(f) for f in (*fmt.OPTIMIZER_FIELDS, "step")} if with_opt and not fresh else {}
    extras = reader.optimizer_extras() if fields or keys else {}
    return _Copied(fields, source.made_fields("master") if keys else None, keys, extras, reader.rng_state(), with_opt,
                   fresh, reader.unread_optimizer())


def _copied(source: ByteSource, want: Request) -> _Copied | None:
    """What the copy takes beside the model, or None where the source is to be read through its torch reader."""
    meta = source.meta
    if source.megatron_optimizer and not want.optimizer:
        return None  # the torch reader says what is left behind
    with_opt = want.optimizer and (has_optimizer(meta) if source.ours else source.megatron_optimizer)
    fresh = with_opt and meta.fresh_optimizer
    try:
        fields, masters, extras = {}, None, {}
        if fresh:
            masters = field_shards(meta, "master", written=True)
            extras = dict(fmt.FRESH_EXTRAS) if masters else {}
        elif with_opt and not source.ours:  # a Megatron-LM optimizer: its fields made by the form's torch reader
            fields = {f: source.made_fields(f) for f in (*fmt.OPTIMIZER_FIELDS, "step")}
            extras = source.maker.optimizer_extras()
        elif with_opt:
            fields = {f: field_shards(meta, f) for f in (*fmt.OPTIMIZER_FIELDS, "step")}
            extras = _extras(meta)
        for shards in (*fields.values(), masters or {}) if source.ours else ():
            source.check_replicas(shards)
        rng = _rng(meta) if source.ours else None
    except (Declined, Unreadable, CkptError, OSError):
        return None
    return _Copied(fields, masters or None, set(masters or ()), extras, rng, with_opt, fresh)


def _extras(meta: fmt.Meta) -> dict:
    """What rank (0, 0)'s optimizer file holds beside the per-parameter state (param groups, scheduler, scaler), read
    without torch; Declined where it holds tensors (the torch path carries those)."""
    obj = read(meta.dir / fmt.optimizer_file(meta.grid.first))
    extras = {k: v for k, v in obj.items() if k != "optimizer"} if isinstance(obj, dict) else None
    if extras is None or _holds_tensors(extras):
        raise Declined("optimizer extras that hold tensors")
    torchsave.dumps(extras)  # what cannot be pickled without torch raises here, before anything is written
    return extras


def _holds_tensors(obj: object) -> bool:
    if isinstance(obj, TensorInfo):
        return True
    if isinstance(obj, dict):
        return any(_holds_tensors(v) for v in obj.values())
    return isinstance(obj, (list, tuple)) and any(_holds_tensors(v) for v in obj)


def _rng(meta: fmt.Meta) -> Path | None:
    """Rank (0, 0)'s RNG file, which every target rank gets as it is; None where there is none. It must read as a
    torch.save archive of a dict, torch-free (the torch path loads it, and words what is wrong)."""
    path = meta.dir / fmt.rng_file(meta.grid.first)
    if not path.is_file():
        if path.name in meta.raw.get("files", {}):
            raise Declined(f"{path}: missing, but meta.json records it")
        return None
    if fmt.size_problem(meta, path) or not isinstance(read(path), dict):  # a damaged file raises Unreadable
        raise Declined(f"{path}: not of the size meta.json records, or not an RNG state")
    return path


def _reshard_copy(source: ByteSource, copied: _Copied, out: str | Path, want: Request, force: bool, quiet: bool,
                  check_hashes: bool, no_preflight: bool, start: float, team: Team) -> str:
    meta, spec = source.meta, source.meta.spec
    out, leftover, target = dist_copy.begin(source, out, want, force, check_hashes, no_preflight, team)
    tp, pp, counts, padded, ep = target.tp, target.pp, target.counts, target.padded, target.ep
    optimizer = bool(copied.fields or copied.master_keys)
    grid = Grid(tp, pp, ep)
    # the small model files last: the wait for the last one's hash is short
    files = [(kind, rank) for kind in (("optimizer", "model") if optimizer else ("model",)) for rank in grid.ranks()]
    itemsize = {"model": ELEMENT_SIZES.get(str(meta.params_dtype).removeprefix("torch."), 2),
                "optimizer": 4 * len(fmt.OPTIMIZER_FIELDS)}
    owners = team.split([layout.rank_numel(spec, counts, padded, tp, r.pp, r.ep, ep) * itemsize[kind]
                         for kind, r in files])
    mine = [f for f, owner in zip(files, owners) if owner == team.rank]
    with output.staged(out, force, team=team) as tmp:
        ckpt = tmp / fmt.checkpoint_name(meta.iteration)
        ckpt.mkdir(exist_ok=True)
        written: dict[Path, dict] = {}
        nbytes = legacy_copy.write_archives([(ckpt / fmt.model_file(r), _model_fill(source, r, counts, padded, tp, ep))
                                             if kind == "model" else
                                             (ckpt / fmt.optimizer_file(r),
                                              _optimizer_fill(source, copied, r, counts, padded, tp, ep))
                                             for kind, r in mine], quiet, "reshard", written)
        if team.lead and copied.rng is not None:  # rank (0, 0)'s state for every target rank (no dropout in TP regions)
            for rank in grid.ranks():
                path = ckpt / fmt.rng_file(rank)
                if isinstance(copied.rng, Path):
                    shutil.copyfile(copied.rng, path)
                else:
                    io.save_file(copied.rng, path)
                written[path] = fmt.file_record(path)
                durable.fsync_file(path)
        origin = {"op": "reshard", "from": {"dir": str(meta.dir), "source": meta.source, "tp_size": meta.tp_size,
                                            "pp_size": meta.pp_size, "layers_per_stage": meta.layer_counts,
                                            "padded_vocab": meta.padded_vocab}}
        if meta.ep_size > 1:
            origin["from"]["ep_size"] = meta.ep_size
        consumed = int(meta.raw.get("consumed_samples") or 0)
        nbytes = _finish(tmp, meta.iteration, written, nbytes, meta.dir, False, team, lambda records: fmt.build_meta(
            spec, tp, counts, padded, meta.iteration, consumed, meta.params_dtype,
            meta.raw.get("parallel", {}).get("dp_size"), dict(meta.raw.get("config") or {}), records, origin, ep,
            fresh_optimizer=copied.fresh))
    return resharded(meta, out, grid, counts, padded, copied.with_opt and not copied.fresh, copied.fresh,
                     bool(copied.master_keys), copied.unread, nbytes, time.perf_counter() - start) + (
        f"\n{leftover}" if leftover else "")


def _model_fill(source: ByteSource, rank: Rank, counts: list[int], padded: int, tp: int, ep: int):
    return lambda put: legacy_copy.model_dicts(source, [rank], counts, padded, tp, ep, {}, put)


def _optimizer_fill(source: ByteSource, copied: _Copied, rank: Rank, counts: list[int], padded: int, tp: int,
                    ep: int):
    """One target rank's optimizer file: each trained parameter's fields (or a fresh optimizer's written masters
    alone), in the torch path's order."""
    spec, pp = source.meta.spec, len(counts)

    def fill(put) -> dict:
        state, refs = {}, itertools.count()
        for local, key in layout.stage_keys(spec, counts, rank.pp, rank.ep, ep):
            held = source.held(key)
            if copied.masters is not None:
                wanted = {"master": copied.masters} if held in copied.master_keys else {}
            elif layout.has_optimizer_state(key, spec, pp):
                wanted = {f: copied.fields[f] for f in fmt.OPTIMIZER_FIELDS}
            else:
                continue
            entry = {}
            for f, shards in wanted.items():
                entry[f] = put(str(next(refs)), *legacy_copy.shard(source, key, rank.tp, tp, padded, pp, shards))
                source.release()
            if copied.fields and wanted:
                step = copied.fields["step"][held][0]
                entry["step"] = put(str(next(refs)), step.dtype, (), step.whole if isinstance(step, MadeShard) else
                                    [(source.files.fd(p), o, n) for p, o, n in step.whole])
            if entry:
                state[local] = entry
        return {"optimizer": state, **copied.extras}
    return fill


def resharded(meta: fmt.Meta, out: Path, grid: Grid, counts: list[int], padded: int, with_opt: bool, fresh: bool,
              masters: bool, unread: str | None, nbytes: int, seconds: float) -> str:
    """The one-line summary of a reshard into our format (either path)."""
    notes = ""
    if padded != meta.padded_vocab:
        notes = (f"; padded vocab {meta.padded_vocab} -> {padded} (TP{grid.tp} does not divide {meta.padded_vocab}; "
                 f"rows beyond the true vocab {meta.spec.vocab_size} are zeros)")
    if fresh:
        carried = "model + the fresh optimizer (recorded" + (
            ", its masters that carry more written)" if masters else ", not written)")
    elif with_opt:
        carried = "model + optimizer"
    elif unread:
        carried = f"model only (NOT carried: its {unread}, not read by this version)"
    else:
        carried = "model only (the source has no optimizer state)"
    return (f"resharded {meta.dir} {meta.grid} (layers {meta.layer_counts}) -> {out} {grid} (layers {counts}), "
            f"iteration {meta.iteration}, {carried}, {nbytes / 2**20:,.1f} MiB, {seconds:.1f}s{notes}")
