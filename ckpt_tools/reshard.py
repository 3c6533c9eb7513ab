"""`ckpt reshard` (any TP/PP layout -> any other, optimizer state included) and `ckpt import` (HF -> shards).

Both write a save dir OUT holding `checkpoint-<iteration>/` and `latest`, so the trainer resumes
from it with `load: OUT` (or `save_dir: OUT`). Streaming, one file at a time: reshard builds each
target shard from the pieces of the mmap'd source shards that `layout.reshard_pieces` names (a
contiguous piece is written straight from the mapping, no copy; the full tensor is never made), the
same bytes as the layout table's split of the join, so a round trip is bit-exact. Import writes all
TP ranks of a stage side by side, one full tensor in memory at a time. Finished files are hashed
and fsynced in background threads while the next ones are written.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from ckpt_tools import checkpoint as fmt
from ckpt_tools import hf, io, layout, output, to_megatron
from ckpt_tools.errors import FormatError
from ckpt_tools.formats import megatron_resume
from ckpt_tools.hf import HFTensors
from ckpt_tools.plan import prepare
from ckpt_tools.ranks import Grid, Rank
from ckpt_tools.shards import MODEL, OPTIMIZER, OPTIMIZER_FIELDS, Reader
from ckpt_tools.spec import ModelSpec
from ckpt_tools.team import SOLO, Team
from ckpt_tools.writers import Filling, TorchFileWriter, dtype_name


IN_FLIGHT = 16  # output files being filled and hashed at once


class Target:
    """One checkpoint in our format, written stage by stage with every TP rank's files open together."""

    def __init__(self, ckpt_dir: Path, spec: ModelSpec, tp: int, counts: list[int], padded: int, optimizer: bool,
                 ep: int = 1):
        self.dir, self.spec, self.tp, self.counts, self.padded, self.ep = ckpt_dir, spec, tp, counts, padded, ep
        self.mine: set[Rank] | None = None  # the ranks whose files this process writes (a team's share; None: all)
        self.pp = len(counts)
        self.optimizer = optimizer
        # hashes and fsyncs finished files while the next ones are written (sha256 runs at ~2 GB/s a core)
        self._pool = ThreadPoolExecutor(min(8, max(2, os.cpu_count() or 2)))
        self._hashes: dict[str, Future] = {}
        self.nbytes = 0

    def begin_stage(self, pp_rank: int) -> None:
        self.pp_rank = pp_rank
        self._ranks = [r for r in Grid(self.tp, self.pp, self.ep).ranks(pp_rank)  # file order
                       if self.mine is None or r in self.mine]
        self._model = [TorchFileWriter(self.dir / fmt.model_file(rank)) for rank in self._ranks]
        self._model_state: list[dict] = [{} for _ in self._ranks]
        self._optim = [TorchFileWriter(self.dir / fmt.optimizer_file(rank)) for rank in self._ranks] \
            if self.optimizer else []
        self._optim_state: list[dict] = [{} for _ in self._ranks]
        self._local = {}  # global key -> [(file index, file-local key)] of this stage's files
        for i, rank in enumerate(self._ranks):
            for local, key in layout.stage_keys(self.spec, self.counts, pp_rank, rank.ep, self.ep):
                self._local.setdefault(key, []).append((i, local))

    def _split(self, key: str, full: torch.Tensor) -> list[torch.Tensor]:
        if layout.has_padded_rows(key, self.spec, self.pp) and full.shape[0] != self.padded:
            full = layout.pad_vocab(key, full, self.spec, self.padded)
        return layout.split(key, full, self.spec, self.tp, self.pp)

    def holds(self, key: str) -> bool:
        """Whether a file of this stage that this process writes holds `key`."""
        return key in self._local

    def _files(self, key: str) -> list[tuple[int, str, int]]:
        """(file index, file-local key, TP rank) of every file of this stage that holds `key` (an expert: the files of
        its EP rank; anything else: every EP rank's)."""
        return [(i, local, self._ranks[i].tp) for i, local in self._local[key]]

    def put(self, key: str, value: Any) -> None:
        """One model tensor (full, TP=1; `key` global), split and written to every file that holds it."""
        if not layout.holds_weights(key, self.spec, self.pp):
            for i, local, _ in self._files(key):
                self._model_state[i][local] = value
            return
        shards = self._split(key, value)
        for i, local, t in self._files(key):
            self._model_state[i][local] = self._model[i].tensor(shards[t])

    def put_state(self, key: str, field: str, value: torch.Tensor) -> None:
        """One optimizer field of a parameter: a full tensor (master, exp_avg, exp_avg_sq), or the
        replicated step. Fields come one at a time, so one full tensor is in memory, not four."""
        shards = [value] * self.tp if field == "step" else self._split(key, value)
        for i, local, t in self._files(key):
            self._optim_state[i].setdefault(local, {})[field] = self._optim[i].tensor(shards[t])

    def put_zeros(self, key: str, field: str) -> None:
        """An fp32 optimizer field of zeros (a fresh moment), never made in memory nor written (TorchFileWriter.zeros)."""
        shape = layout.shard_shape(key, self.spec, self.padded, self.tp, self.pp)
        for i, local, _ in self._files(key):
            self._optim_state[i].setdefault(local, {})[field] = self._optim[i].zeros(torch.float32, shape)

    def end_stage(self, optimizer_extras: dict) -> None:
        for i in range(len(self._ranks)):
            self._close(self._model[i], {"model": self._model_state[i]})
            if self.optimizer:
                self._close(self._optim[i], {"optimizer": self._optim_state[i], **optimizer_extras})

    def _close(self, writer: TorchFileWriter, obj: dict) -> None:
        filling = writer.close(obj, fsync=False, background=True)  # copies into the file go on on its own thread
        self.nbytes += writer.path.stat().st_size
        self.add_file(writer.path, filling)

    def add_file(self, path: Path, filling: Filling | None = None) -> None:
        """Hash and fsync a finished file in the background, once the copies still filling it (`filling`) are done;
        `records()` waits for all of them. At most IN_FLIGHT files at a time: the writer waits for the oldest (each
        holds a descriptor and a thread until it is hashed)."""
        pending = [f for f in self._hashes.values() if not f.done()]
        if len(pending) >= IN_FLIGHT:
            pending[0].result()
        self._hashes[path.relative_to(self.dir).as_posix()] = self._pool.submit(_record_and_sync, path, filling)

    def records(self) -> dict[str, dict]:
        out = {name: fut.result() for name, fut in sorted(self._hashes.items())}
        self._pool.shutdown()
        return out

    def file_bytes(self, rank: Rank, kind: str, itemsize: int) -> int:
        """About the bytes of one of its files (model tensors of `itemsize`, or their fp32 master and moments): what
        a team balances."""
        numel = layout.rank_numel(self.spec, self.counts, self.padded, self.tp, rank.pp, rank.ep, self.ep)
        return numel * (itemsize if kind == MODEL else 4 * len(OPTIMIZER_FIELDS))

    def share(self, team: Team, kinds: tuple[str, ...], itemsize: int) -> list[tuple[str, Rank]]:
        """The (kind, rank) files this process writes, in the order one process writes them all; sets `mine`."""
        files = [(kind, rank) for kind in kinds for rank in Grid(self.tp, self.pp, self.ep).ranks()]
        owners = team.split([self.file_bytes(rank, kind, itemsize) for kind, rank in files])
        mine = [f for f, owner in zip(files, owners) if owner == team.rank]
        self.mine = {rank for _, rank in mine}
        return mine


def _record_and_sync(path: Path, filling: Filling | None = None) -> dict:
    """The file's record for meta.json, then its fsync. A file still being filled (`filling`, in file order) is hashed
    as the copies go, read back from the page cache; one written whole has its writeback started first."""
    if filling is None:
        fd = os.open(path, os.O_RDONLY)
        try:
            io.start_writeback(fd, 0, 0)  # the disk busy while the file is hashed: the fsync finds less to wait for
        finally:
            os.close(fd)
        record = fmt.file_record(path)
    else:
        try:
            record = {"size": path.stat().st_size, "sha256": io.sha256_file(path, ready=filling.ready)}
        finally:
            filling.wait()
    io.fsync_file(path)
    return record


class Resharder:
    """Target shards straight from the source shards: `reshard_pieces` of the layout table, gathered."""

    def __init__(self, shards: Reader, target: Target):
        self.shards, self.target = shards, target
        self.src_tp, self.src_padded = shards.meta.tp_size, shards.meta.padded_vocab
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def _scratch(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A reused buffer for gathered shards (written at once): no fresh pages to fault in per tensor."""
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self._buffer[:nbytes].view(dtype).view(shape)

    def shard(self, key: str, field: str | None, rank: int) -> torch.Tensor:
        """Target TP rank `rank`'s shard of `key` (its model tensor, or an optimizer field), gathered."""
        source, t = self.shards.source_key(key), self.target
        shards = self.shards.shards(source, field)
        if layout.find_rule(key, t.spec, t.pp).dim is None:  # replicated: the replicas must agree
            return layout.join(source, shards, t.spec, self.shards.meta.pp_size)
        pieces = layout.reshard_pieces(key, t.spec, self.src_tp, self.src_padded, t.tp, t.padded, rank, t.pp)
        return layout.gather(pieces, shards, self._scratch)

    def put(self, writer: TorchFileWriter, key: str, field: str | None, rank: int):
        """Write target TP rank `rank`'s shard of `key` (its model tensor, or an optimizer field). Pieces
        that are byte ranges of the source files, concatenated on dim 0, are copied file to file."""
        source, t = self.shards.source_key(key), self.target
        if layout.find_rule(key, t.spec, t.pp).dim is None:
            return writer.tensor(self.shard(key, field, rank))
        shards = self.shards.shards(source, field)
        pieces = layout.reshard_pieces(key, t.spec, self.src_tp, self.src_padded, t.tp, t.padded, rank, t.pp)
        parts = layout.gather_parts(pieces, shards)
        where = [self.shards.locate(p) for p in parts]
        if all(where) and (len(parts) == 1 or pieces[0].dim == 0):
            shape = (sum(p.shape[0] for p in parts),) + tuple(parts[0].shape[1:])
            return writer.tensor_from_files(parts[0].dtype, shape,
                                            [(fd, offset, p.nbytes) for (fd, offset), p in zip(where, parts)])
        return writer.tensor(layout.gather(pieces, shards, self._scratch))

    def write_file(self, kind: str, rank: Rank, extras: dict) -> None:
        """One target file (a model or optimizer shard), tensor by tensor, then hashed in the background."""
        t, tp_rank = self.target, rank.tp
        name = (fmt.model_file if kind == MODEL else fmt.optimizer_file)(rank)
        writer, state = TorchFileWriter(t.dir / name), {}
        for local, key in layout.stage_keys(t.spec, t.counts, rank.pp, rank.ep, t.ep):
            extra = not layout.holds_weights(key, t.spec, t.pp)
            if kind == MODEL:
                state[local] = self.shards.shards(self.shards.source_key(key))[0] if extra else \
                    self.put(writer, key, None, tp_rank)
            elif not extra:
                fields = {f: self.put(writer, key, f, tp_rank) for f in OPTIMIZER_FIELDS}
                self.shards.release()
                fields["step"] = writer.tensor(self.shards.shards(self.shards.source_key(key), "step")[0])
                state[local] = fields
            self.shards.release()
        t._close(writer, {MODEL: state} if kind == MODEL else {OPTIMIZER: state, **extras})


def _finish(tmp: Path, iteration: int, target: Target, meta: dict, carried_from: Path | None,
            hf_dir: bool = False, team: Team = SOLO) -> int:
    """Tokenizer, chat templates, generation and HF config carried along; meta.json (the records of every process's
    files); `latest`. The bytes of the shard files, every process's."""
    ckpt = target.dir
    for f in hf.copy_carried(carried_from, ckpt, hf_dir) if team.lead and carried_from is not None else []:
        target.add_file(f)
    shared = team.share(lambda: (target.records(), target.nbytes), to_lead=True)
    if team.lead:
        meta["files"] = dict(sorted((name, r) for records, _ in shared for name, r in records.items()))
        fmt.write_meta(ckpt / fmt.META, meta)
        io.fsync_dir(ckpt)
        io.write_text_atomic(tmp / fmt.LATEST, fmt.checkpoint_name(iteration) + "\n")
        return sum(nbytes for _, nbytes in shared)
    return 0  # process 0 says the total


def reshard(src: str | Path, out: str | Path, tp: int, pp: int, layers: list[int] | None = None,
            vocab_size: int | None = None, force: bool = False, quiet: bool = False, check_hashes: bool = False,
            no_preflight: bool = False, form: str = to_megatron.OURS, optimizer: bool = True,
            copy_bytes: bool = True, ep: int | None = None, team: Team = SOLO) -> str:
    """`copy_bytes`: for Megatron-LM's forms, copy the source's bytes where formats.dist_copy takes them.
    `ep`: the target's expert parallelism (MoE models; None: the source's). `team`: the processes writing the
    output's files between them (ckpt_tools.team)."""
    to_megatron.check_ep_form(form, ep)
    if form != to_megatron.OURS and copy_bytes:
        from ckpt_tools.formats import dist_copy
        summary = dist_copy.reshard(src, out, tp, pp, layers, vocab_size, force, quiet, check_hashes, no_preflight,
                                    optimizer, form, team, ep)
        if summary is not None:
            return summary
    start = time.perf_counter()
    out, leftover, shards = prepare(src, out, force, vocab_size, check_hashes, team)
    meta, spec = shards.meta, shards.meta.spec
    counts, padded = layout.target_layout(spec, tp, pp, layers, meta.padded_vocab)
    ep = to_megatron.target_ep(form, ep, meta.ep_size) if form != to_megatron.OURS else \
        meta.ep_size if ep is None else layout.check_ep(spec, ep)
    with_opt, unread = shards.has_optimizer() and optimizer, shards.unread_optimizer()
    output.preflight(out, sum(f.stat().st_size for f in meta.dir.iterdir() if f.is_file()), no_preflight)
    if form != to_megatron.OURS:
        return _reshard_to_megatron(shards, out, form, tp, counts, padded, with_opt, force, quiet, start, unread, team,
                                    ep)
    with output.staged(out, force, team=team) as tmp:
        ckpt = tmp / fmt.checkpoint_name(meta.iteration)
        ckpt.mkdir(exist_ok=True)
        target = Target(ckpt, spec, tp, counts, padded, with_opt, ep)
        extras = shards.optimizer_extras() if with_opt else {}
        kinds = (OPTIMIZER, MODEL) if with_opt else (MODEL,)  # the small model files last: the wait for the last
        mine = target.share(team, kinds, _itemsize(meta.params_dtype))  # file's hash is short
        bar = output.progress(len(mine), "reshard", quiet, unit="file")
        resharder = Resharder(shards, target)
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
                                  origin, ep)
        nbytes = _finish(tmp, meta.iteration, target, new_meta, meta.dir, team=team)
    shards.close()
    notes = ""
    if padded != meta.padded_vocab:
        notes = (f"; padded vocab {meta.padded_vocab} -> {padded} (TP{tp} does not divide {meta.padded_vocab}; "
                 f"rows beyond the true vocab {spec.vocab_size} are zeros)")
    return (f"resharded {meta.dir} {meta.grid} (layers {meta.layer_counts}) -> {out} "
            f"{Grid(tp, pp, ep)} (layers {counts}), iteration {meta.iteration}, "
            f"{'model + optimizer' if with_opt else f'model only (NOT carried: its {unread}, not read by this version)' if unread else 'model only (the source has no optimizer state)'}, "
            f"{nbytes / 2**20:,.1f} MiB, {time.perf_counter() - start:.1f}s{notes}"
            + (f"\n{leftover}" if leftover else ""))


def _reshard_to_megatron(shards: Reader, out: Path, form: str, tp: int, counts: list[int], padded: int,
                         with_opt: bool, force: bool, quiet: bool, start: float, unread: str | None = None,
                         team: Team = SOLO, ep: int = 1) -> str:
    meta, spec = shards.meta, shards.meta.spec
    fresh = with_opt and meta.iteration == 0  # Megatron-LM loads no iter_0000000; a fresh state holds nothing
    if with_opt and not fresh:
        to_megatron.check_optimizer_form(form, meta.dir)
    resume = _resume_state(shards) if with_opt and not fresh else None
    to_megatron.check(spec, tp, counts, padded, meta.params_dtype, form, resume, meta.dir, ep)
    resharder = Resharder(shards, SimpleNamespace(spec=spec, tp=tp, pp=len(counts), padded=padded))

    def state_of(key: str, field: str | None, rank: int) -> torch.Tensor:
        shard = resharder.shard(key, field, rank)
        shards.release()
        return shard
    nbytes = to_megatron.write(out, form, spec, tp, counts, padded, meta.params_dtype,
                               lambda key, rank: state_of(key, None, rank), force=force, quiet=quiet,
                               label="reshard", carried_from=meta.dir, resume=resume, state_of=state_of, team=team,
                               ep=ep)
    shards.close()
    return to_megatron.resharded(meta, out, form, tp, counts, resume, fresh, unread, nbytes,
                                 time.perf_counter() - start, ep)


def _itemsize(dtype: str | torch.dtype) -> int:
    return (getattr(torch, dtype) if isinstance(dtype, str) else dtype).itemsize


def _resume_state(shards: Reader) -> megatron_resume.ResumeState:
    """What Megatron-LM needs to resume beside the tensors: the source's own param groups and schedule when it is
    a Megatron-LM checkpoint, else Megatron-LM's for the trainer's config."""
    meta = shards.meta
    consumed = int(meta.raw.get("consumed_samples") or 0)
    saved = shards.megatron_optimizer()
    if saved is not None:
        where, groups, scheduler_where, scheduler = saved
        return megatron_resume.from_megatron(where, groups, scheduler_where, scheduler, meta.iteration, shards.step(),
                                             consumed)
    return megatron_resume.from_ours(meta.dir / "meta.json", dict(meta.raw.get("config") or {}),
                                     meta.raw.get("parallel", {}).get("dp_size"), meta.iteration, shards.step(),
                                     consumed)


def _copy_rng(shards: Reader, target: Target, grid: Grid) -> None:
    """RNG and data position: the source's rank (0, 0) state for every target rank (no dropout in TP regions)."""
    rng = shards.rng_state()
    if rng is None:
        return
    for rank in grid.ranks():
        dest = target.dir / fmt.rng_file(rank)
        io.save_file(rng, dest)
        target.add_file(dest)


# ---------------------------------------------------------------- import: HF -> shards
def import_hf(hf_dir: str | Path, out: str | Path, tp: int, pp: int, layers: list[int] | None = None,
              dtype: torch.dtype | None = None, optimizer: bool = True, force: bool = False, quiet: bool = False,
              form: str = to_megatron.OURS, copy_bytes: bool = True, ep: int = 1, team: Team = SOLO) -> str:
    """`copy_bytes`: for Megatron-LM's forms, copy the HF tensors' rows where formats.dist_copy takes them.
    `ep`: expert parallelism of the output (MoE models). `team`: the processes writing the output's files between
    them (ckpt_tools.team)."""
    to_megatron.check_ep_form(form, ep)
    if form != to_megatron.OURS and copy_bytes:
        from ckpt_tools.formats import dist_copy
        summary = dist_copy.import_hf(hf_dir, out, tp, pp, layers, dtype_name(dtype) if dtype else None, force, quiet,
                                      form, team, ep)
        if summary is not None:
            return summary
    start = time.perf_counter()
    hf_dir, out = Path(hf_dir), output.check_target(out, force)
    leftover = output.note_leftovers(out)  # before this run stages its own
    tail = f"\n{leftover}" if leftover else ""
    spec = hf.spec_from_hf(hf_dir / "config.json")
    counts, padded = layout.target_layout(spec, tp, pp, layers, None)
    layout.check_ep(spec, ep)
    source = HFTensors(hf_dir)
    rows = {key: (row, names) for key, row, names in hf.hf_keys(spec)}
    wanted = {n for _, names in rows.values() for n in names}
    extra = sorted(set(source.where) - wanted)
    if spec.tie_word_embeddings and "lm_head.weight" in extra:  # some tied models also save the head
        extra.remove("lm_head.weight")
    missing = sorted(wanted - set(source.where))
    if missing or extra:
        what = "; ".join(x for x in (f"missing {', '.join(missing[:4])}" if missing else "",
                                     f"unexpected {', '.join(extra[:4])}" if extra else "") if x)
        raise FormatError(f"{hf_dir}: tensors do not match a {spec.architecture} model of this config.json ({what}): "
                          f"the weights and config.json disagree")
    wrong = []  # shapes too, before anything is written: a mismatch would crash mid-way or import garbage
    for key, (row, names) in rows.items():
        for name, want in zip(names, hf.hf_shapes(row.kind, spec, layout.full_shape(key, spec, padded))):
            if source.shape(name) != tuple(want):
                wrong.append(f"{name} {list(source.shape(name))}, expected {list(want)}")
    if wrong:
        raise FormatError(f"{hf_dir}: tensor shapes do not match a {spec.architecture} model of this config.json "
                          f"({'; '.join(wrong[:4])}{' ...' if len(wrong) > 4 else ''}): "
                          f"the weights and config.json disagree")
    first = source.get(rows["embedding.word_embeddings.weight"][1][0])
    params_dtype = dtype or first.dtype
    if form != to_megatron.OURS:
        return _import_to_megatron(hf_dir, source, rows, out, form, spec, tp, counts, padded, params_dtype, force,
                                   quiet, start, team, ep) + tail
    with output.staged(out, force, team=team) as tmp:
        ckpt = tmp / fmt.checkpoint_name(0)
        ckpt.mkdir(exist_ok=True)
        target = Target(ckpt, spec, tp, counts, padded, optimizer, ep)
        target.share(team, (MODEL,), params_dtype.itemsize * (7 if optimizer else 1))  # a rank's model + optimizer
        stages = sorted({rank.pp for rank in target.mine})  # the others' stages are not read here
        bar = output.progress(sum(len(layout.stage_keys(spec, counts, p)) for p in stages), "import", quiet,
                              unit="tensor")
        for p in stages:
            target.begin_stage(p)
            for _, key in layout.stage_keys(spec, counts, p):
                if not target.holds(key):  # an expert of another process's EP ranks
                    bar.update(1)
                    continue
                if not layout.holds_weights(key, spec, pp):
                    target.put(key, None)
                    bar.update(1)
                    continue
                row, names = rows[key if key in rows else "embedding.word_embeddings.weight"]
                full = hf.from_hf(row.kind, [source.get(n) for n in names], spec, padded).to(params_dtype)
                target.put(key, full)
                if optimizer:
                    target.put_state(key, "master", full.float())
                    target.put_zeros(key, "exp_avg")
                    target.put_zeros(key, "exp_avg_sq")
                    target.put_state(key, "step", torch.tensor(0.0))
                bar.update(1)
            target.end_stage({"param_groups": [], "scheduler": {"iteration": 0}, "scaler": None})
        bar.close()
        origin = {"op": "import", "from": {"dir": str(hf_dir.resolve()), "format": "huggingface"}}
        meta = fmt.build_meta(spec, tp, counts, padded, 0, 0, dtype_name(params_dtype), None, {}, {}, origin, ep)
        nbytes = _finish(tmp, 0, target, meta, hf_dir, hf_dir=True, team=team)
    return (f"imported {hf_dir} ({spec.architecture}, {spec.num_layers} layers) -> {out} {Grid(tp, pp, ep)} "
            f"(layers {counts}), {dtype_name(params_dtype)}, "
            f"{'fresh optimizer state' if optimizer else 'no optimizer state'}, padded vocab {padded}, "
            f"{nbytes / 2**20:,.1f} MiB, {time.perf_counter() - start:.1f}s{tail}")


def _import_to_megatron(hf_dir: Path, source: HFTensors, rows: dict, out: Path, form: str, spec: ModelSpec, tp: int,
                        counts: list[int], padded: int, params_dtype: torch.dtype, force: bool, quiet: bool,
                        start: float, team: Team = SOLO, ep: int = 1) -> str:
    pp, current = len(counts), {}

    def shard_of(key: str, rank: int) -> torch.Tensor:
        if key not in current:  # one full tensor in memory, split for every TP rank
            row, names = rows[key if key in rows else "embedding.word_embeddings.weight"]
            full = hf.from_hf(row.kind, [source.get(n) for n in names], spec, padded).to(params_dtype)
            current.clear()
            current[key] = layout.split(key, full, spec, tp, pp)
        return current[key][rank]
    nbytes = to_megatron.write(out, form, spec, tp, counts, padded, dtype_name(params_dtype), shard_of, force=force,
                               quiet=quiet, label="import", carried_from=hf_dir, hf_dir=True, team=team, ep=ep)
    return to_megatron.imported(hf_dir, spec, out, form, tp, counts, dtype_name(params_dtype), padded, nbytes,
                                time.perf_counter() - start, ep)
