"""`ckpt import HF OUT` into our format by copying bytes (torch only for the tensors it makes): each rank's
`pytorch_model_tp_X_pp_Y.bin` written as torch.save lays it out (`{"model": {local key: tensor}}`), its tensors'
bytes copied from the safetensors files (forms/legacy_copy.py's rank writer over the HF tensors as a TP 1 source:
each megatron-core tensor's rows are row ranges of the HF tensors, conversions.hf_rows; a tensor whose value is not
its HF bytes made by torch, hf_copy.made_by_torch); the fresh optimizer recorded in meta.json, not written (contract
2); meta.json, the carried HF files and `latest` as the torch path (importer.py) writes them. The tensors are the
torch path's, bit for bit.

A fresh optimizer's fp32 masters of the tensors whose HF values carry more than the dtype they are kept in (an fp32
router of a bf16 DeepSeek-V3, contract 2) are written alone, each rank's into its `optimizer_tp_X_pp_Y.bin`, as the
torch path writes them.

None, having written nothing, where the torch path must do it: what verbs/hf_copy.py declines (weights asked for in
another dtype than the HF weights', names or shapes that disagree with config.json), expert parallelism.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from ckpt_tools import durable, io, output
from ckpt_tools.forms import checkpoint as fmt
from ckpt_tools.forms import legacy_copy, torchsave
from ckpt_tools.model import hf, layout, shard_ops
from ckpt_tools.model.ranks import Grid, Rank
from ckpt_tools.model.spec import ModelSpec
from ckpt_tools.team import SOLO, Team
from ckpt_tools.verbs import hf_copy
from ckpt_tools.verbs.request import Request


def import_hf(hf_dir: str | Path, out: str | Path, want: Request, dtype: str | None = None, force: bool = False,
              quiet: bool = False, team: Team = SOLO) -> str | None:
    """paths.import_hf(..., `want` of our format) by copying bytes; `dtype` a dtype name (None: the HF weights'). In a
    team each process writes a run of the rank files (balanced by their bytes), process 0 the rest."""
    start = time.perf_counter()
    hf_dir = Path(hf_dir)
    copied = hf_copy.copied_hf(hf_dir, dtype) if want.ep in (None, 1) else None
    started = hf_copy.start_hf_copy(copied, out, want, force, team)
    if started is None:
        return None
    spec, index, rows, params, out, leftover, target = started
    tp, counts, padded, optimizer = target.tp, target.counts, target.padded, want.optimizer
    ranks = Grid(tp, len(counts)).ranks()
    owners = team.split([layout.rank_numel(spec, counts, padded, tp, r.pp) for r in ranks])
    mine = [r for r, owner in zip(ranks, owners) if owner == team.rank]
    with output.staged(out, force, team=team) as tmp:
        ckpt = tmp / fmt.checkpoint_name(0)
        ckpt.mkdir(exist_ok=True)
        source, written = hf_copy.rank_file_source(hf_dir, spec, index, rows, params, padded), {}
        carried = hf.fresh_masters(rows, spec, params, lambda name: index[name][1], len(counts)) if optimizer else set()
        try:
            nbytes = legacy_copy.write_files(source, [(ckpt / fmt.model_file(r), [r]) for r in mine], counts, padded,
                                             tp, 1, {}, quiet, "import", written)
            for r in mine if carried else ():
                path = ckpt / fmt.optimizer_file(r)
                nbytes += _write_masters(path, source, r, carried, rows, tp, counts)
                written[path] = fmt.file_record(path)
        finally:
            source.close()
        shared = team.share(lambda: ({path.name: record for path, record in written.items()}, nbytes), to_lead=True)
        if team.lead:
            records = {name: record for part, _ in shared for name, record in part.items()}
            nbytes = sum(n for _, n in shared)
            for path in hf.copy_carried(hf_dir, ckpt, True):
                records[path.relative_to(ckpt).as_posix()] = fmt.file_record(path)
                durable.fsync_file(path)
            origin = {"op": "import", "from": {"dir": str(hf_dir.resolve()), "format": "huggingface"}}
            meta = fmt.build_meta(spec, tp, counts, padded, 0, 0, params, None, {}, dict(sorted(records.items())),
                                  origin, fresh_optimizer=optimizer)
            fmt.write_meta(ckpt / fmt.META, meta)
            durable.fsync_dir(ckpt)
            io.write_text_atomic(tmp / fmt.LATEST, fmt.checkpoint_name(0) + "\n")
    return imported(hf_dir, spec, out, tp, counts, 1, params, optimizer, bool(carried), padded, nbytes,
                    time.perf_counter() - start) + (f"\n{leftover}" if leftover else "")


def _write_masters(path: Path, source: legacy_copy.HFSource, rank: Rank, carried: set[str], rows: dict, tp: int,
                   counts: list[int]) -> int:
    """A rank's optimizer file holding the fresh fp32 masters of its `carried` tensors alone (the output layer's copy
    at PP > 1 with its embedding's), the HF values split as the torch path splits them; its tensors' bytes."""
    spec, nbytes, state = source.meta.spec, 0, {}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        archive = torchsave.Archive(fd, 0, path.stem)
        for local, key in layout.stage_keys(spec, counts, rank.pp):
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
