"""`ckpt import HF OUT --format torch_dist | torch` at the speed of copying the bytes (verbs/dist_copy.py's way
for an HF model; the legacy form's files by forms/legacy_copy.py).

The rows of a megatron-core tensor that one HF tensor holds (conversions.hf_rows: q, k and v rows per query group,
gate and up halves, the true vocab's rows) are one chunk each, copied from the safetensors file; a row-parallel tensor
is one run of whole rows per target TP rank (byte ranges too: its columns would have to be gathered in memory), which
Megatron-LM loads at any TP and ByteSource takes as the whole tensor; one .distcp per target rank. The choice between
copying and torch is made per tensor: a tensor whose megatron-core value is not its HF bytes (GPT-2's transposed
Conv1D weights, an arithmetic kind, weights in another dtype than the one asked for or the one the layout table
keeps; in the legacy form and our format, a tensor of more than 2 dimensions too) is made by torch alone
(conversions.from_hf, as the torch path makes it) and written from memory: into torch_dist by the process that writes
a chunk of it, into the same chunks; into a legacy or our rank file as that rank's shard of it
(forms/legacy_copy.py). The rest are still copied file to file.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from ckpt_tools import io, output
from ckpt_tools.errors import CkptError
from ckpt_tools.forms import forms, hf_tensors, legacy_copy, megatron_lm
from ckpt_tools.forms.byte_index import Declined
from ckpt_tools.forms.dtypes import ELEMENT_SIZES, SAFETENSORS_DTYPES
from ckpt_tools.forms.megatron_write import DistWriter
from ckpt_tools.model import conversions, families, hf, layout, shard_ops
from ckpt_tools.model.ranks import TP, Rank
from ckpt_tools.team import SOLO, Team
from ckpt_tools.verbs import to_megatron
from ckpt_tools.verbs.dist_copy import shared_dist
from ckpt_tools.verbs.request import Layout, Request

COPIED_DTYPES = ("float32", "bfloat16", "float16")  # the HF weights' dtypes this path copies


def import_hf(hf_dir: str | Path, out: str | Path, want: Request, dtype: str | None = None, force: bool = False,
              quiet: bool = False, team: Team = SOLO, through: bool = False) -> str | None:
    """paths.import_hf(..., `want` of a Megatron-LM form): each megatron-core tensor's rows that an HF tensor holds
    (conversions.hf_rows: q, k and v rows per query group, gate and up halves, the true vocab's rows) are a chunk
    (the legacy form: rank files, forms/legacy_copy.py), copied from the safetensors file; a tensor whose value is not
    its HF bytes (made_by_torch) is made by torch alone (weights asked for in another dtype than the HF weights': every
    tensor, each rank's shard cast alone in rank files). None, having written nothing, where the bytes are not read so
    (names or shapes that disagree with config.json, GPT-OSS's stacked experts, FP8 weights with their scales, anything
    unreadable): `through` then reads the model through torch (importer.checked, which words what disagrees), every
    tensor made by torch, for the same writers."""
    start = time.perf_counter()
    hf_dir = Path(hf_dir)
    started = start_through(hf_dir, out, want, dtype, force) if through else \
        start_hf_copy(copied_hf(hf_dir, dtype), out, want, force, team)
    if started is None:
        return None
    spec, index, rows, params, out, leftover, target = started[:7]
    args = to_megatron.check(spec, target, params, None, out)
    nbytes = _import(hf_dir, index, rows, out, spec, target, args, force, quiet, team, params)
    summary = to_megatron.imported(hf_dir, spec, out, target, params, nbytes, time.perf_counter() - start)
    return summary + (f"\n{leftover}" if leftover else "")


def start_hf_copy(copied: tuple | None, out: str | Path, want: Request, force: bool, team: Team) -> tuple | None:
    """What `copied_hf` found, the output checked and the target resolved: (spec, index, rows, params dtype, out,
    the note of what an interrupted run left, the target Layout, an HF tensor's dtype name by its name); None where any
    process of the team declined (one path for all: a process that declined sends every one through torch)."""
    if not team.all(copied is not None):
        return None
    spec, index, rows, params = copied
    out = output.check_target(out, force)
    leftover = output.note_leftovers(out)
    return spec, index, rows, params, out, leftover, want.resolve(spec), lambda name: index[name][1]


def start_through(hf_dir: Path, out: str | Path, want: Request, dtype: str | None, force: bool) -> tuple:
    """As start_hf_copy, for a model read through torch (importer.checked): no index (None), every tensor made."""
    from ckpt_tools.verbs import importer
    out = output.check_target(out, force)
    leftover = output.note_leftovers(out)  # before this run stages its own
    spec, tensors, rows, params = importer.checked(hf_dir, dtype)
    target = want.resolve(spec)
    layout.check_ep(spec, target.ep)
    return spec, None, rows, params, out, leftover, target, tensors.dtype_name


def copied_hf(hf_dir: Path, dtype: str | None) -> tuple | None:
    """(spec, index, rows, params dtype) of an HF model whose tensors this path copies (those whose values are not
    their HF bytes made by torch, `made_by_torch`: every tensor, where `dtype` is not the HF weights'); None where it
    does not."""
    try:
        index = _safetensors_index(hf_dir)
        spec = hf.spec_of_model(hf_dir, index)
        rows = {key: (row, names) for key, row, names in hf.hf_keys(spec)}
    except (CkptError, Declined):
        return None
    wanted = {n for _, names in rows.values() for n in names}
    copies = {name: row.hf[0] for _, row, name in hf.hf_copies(spec) if name in index}  # MTP layers' copies
    if any(not _same_bytes(index[a], index[b]) for a, b in copies.items()):
        return None  # the torch path refuses it, naming both
    extra = set(index) - wanted - set(copies) - hf.tied_head(spec)
    if extra or wanted - set(index):
        return None
    params = dtype or index[rows["embedding.word_embeddings.weight"][1][0]][1]
    planning_pad = spec.padded_vocab_size(1)  # HF shapes do not depend on the padding
    for key, (row, names) in rows.items():
        shapes = conversions.hf_shapes(row.kind, spec, layout.full_shape(key, spec, planning_pad))
        if any(index[n][2] != s for n, s in zip(names, shapes)):
            return None
    return spec, index, rows, params


def made_by_torch(key: str, row, names: list[str], index: dict, spec, params: str, flat: bool = False) -> str | None:
    """The dtype torch makes KEY's megatron-core tensor in, where its value is not the bytes of its HF tensors (a
    transposed or arithmetic conversion kind, another dtype than the weights' or the layout table's own; with `flat`,
    the rank files' copies, a tensor of more than 2 dimensions too; every tensor of a model read through torch, whose
    `index` is None); None where they are copied."""
    want = layout.dtype_of(key, spec, params, None)
    if index is None or row.kind in conversions.TRANSPOSED + conversions.ARITHMETIC or \
            any(index[n][1] != want for n in names):
        return want
    if flat and any(len(index[n][2]) > 2 for n in names):
        return want
    return None


def rank_file_source(hf_dir: Path, spec, index: dict, rows: dict, params: str, padded: int):
    """The HF model as forms/legacy_copy.py's source for rank files (the legacy form's, our format's): the tensors
    torch makes (made_by_torch), each (kind, HF names, dtype), beside the row ranges of the others."""
    made = {}
    for key, (row, names) in rows.items():
        dtype = made_by_torch(key, row, names, index, spec, params, flat=True)
        if dtype is not None:
            made[key] = (row.kind, names, dtype)
    return legacy_copy.hf_source(hf_dir, spec, index, rows, TorchMade(hf_dir, spec, padded), made)


class TorchMade:
    """The HF tensors of the tensors made by torch (made_by_torch), read through torch's safetensors reader, opened at
    the first such tensor: a model without one never imports torch."""

    def __init__(self, hf_dir: Path, spec, padded: int):
        self.hf_dir, self.spec, self.padded, self._source = hf_dir, spec, padded, None

    def tensor(self, kind: str, names: list[str], dtype: str | None):
        """The full megatron-core tensor (vocab padding included) as the torch path makes it, in any layout: a
        transposed kind stays a view, so that a rank's shard of it is made contiguous alone; in `dtype` (None: its HF
        tensors', for a rank's shard to be cast alone: the cast is element by element)."""
        import torch
        if self._source is None:
            self._source = hf_tensors.HFTensors(self.hf_dir)
        full = conversions.from_hf(kind, [self._source.get(n) for n in names], self.spec, self.padded)
        return full if dtype is None else full.to(getattr(torch, dtype))

    def rows(self, kind: str, names: list[str], dtype: str) -> memoryview:
        """The bytes of the full megatron-core tensor."""
        return legacy_copy.as_bytes(self.tensor(kind, names, dtype).contiguous())


def _import(hf_dir: Path, index: dict, rows: dict, out: Path, spec, target: Layout, args, force: bool, quiet: bool,
            team: Team, params: str) -> int:
    tp, counts, padded = target.tp, target.counts, target.padded
    with output.staged(out, force, team=team) as tmp:
        iter_dir = tmp / megatron_lm.RELEASE
        iter_dir.mkdir(exist_ok=True)
        if forms.get(target.form).chunks:
            made = TorchMade(hf_dir, spec, padded)
            nbytes = _import_dist(iter_dir, target.form, index, rows, spec, tp, counts, padded, args, quiet, team,
                                  made, params)
        else:
            source = rank_file_source(hf_dir, spec, index, rows, params, padded)
            try:
                nbytes = legacy_copy.write(source, iter_dir, tp, counts, padded, args, 0, quiet, "import", team)
            finally:
                source.close()
        if team.lead:
            hf.copy_carried(hf_dir, iter_dir, hf_dir=True)
            io.write_text_atomic(tmp / megatron_lm.TRACKER, megatron_lm.RELEASE)
    return nbytes


def _import_dist(iter_dir: Path, form: str, index: dict, rows: dict, spec, tp: int, counts: list[int], padded: int,
                 args, quiet: bool, team: Team, made: TorchMade, params: str) -> int:
    pp = len(counts)
    fds: dict[Path, int] = {}

    def run(writer: DistWriter, bar) -> None:
        for p in range(pp):
            for _, key in layout.stage_keys(spec, counts, p):
                if not layout.holds_weights(key, spec, pp):
                    writer.put_extra(p, key)
                elif writer.saves(key, Rank(0, p)):
                    row, names = rows[key]
                    dtype = made_by_torch(key, row, names, index, spec, params)
                    _put_hf(writer, index, fds, p, key, row, names, padded, None if dtype is None else (made, dtype))
            bar.update(1)
            writer.end_stage(p, 0)
        writer.close(0, None)
    try:
        writer = forms.get(form).writer
        return shared_dist(team, lambda: writer(iter_dir, spec, tp, counts, padded, args, None), run, pp, "import",
                           quiet, unit="stage").nbytes
    finally:
        for fd in fds.values():
            os.close(fd)


def _put_hf(writer: DistWriter, index: dict, fds: dict, stage: int, key: str, row, names: list[str],
            padded: int, made: tuple[TorchMade, str] | None = None) -> None:
    """One megatron-core tensor's chunks: the row ranges of its HF tensor(s), and zeros for the vocab padding, each
    cut at the target's TP shards and saved by the TP rank that holds it (one .distcp per target rank, as
    megatron-core saves them). A row-parallel tensor (split over TP by columns) is cut by rows instead, one run of
    rows per target TP rank: each chunk is then a byte range of the HF file, copied file to file, where a column
    block would have to be gathered in memory. torch_dist does not tie chunks to the loading layout: Megatron-LM
    loads each rank's columns from the row chunks they cross, at any TP, as it loads any other save. MADE: (the reader,
    the dtype) of a tensor torch makes (made_by_torch), whose rows are then cut from memory the same way."""
    spec = writer.spec
    fqn, layer = writer.stored(key)
    full = layout.full_shape(key, spec, padded, writer.pp)
    rule = layout.find_rule(key, spec, writer.pp)
    if rule.dim == 1:
        shards = [(r, r * full[0] // writer.tp, (r + 1) * full[0] // writer.tp) for r in range(writer.tp)]
    else:
        shards = [(r, p.start, p.stop) for r in (range(writer.tp) if TP in rule.axes else [0])
                  for p in shard_ops.reshard_pieces(key, spec, 1, padded, writer.tp, padded, r, writer.pp)]

    def put(a: int, b: int, data, with_rank: bool = False) -> None:
        """Rows [a, b) of the full tensor, cut at the TP shards; `data(i, j)` (with_rank: `data(i, j, tp rank)`)."""
        at = a
        for r, lo, hi in shards:
            lo, hi = max(a, lo), min(b, hi)
            if lo < hi:
                stored, offsets, sizes, gshape = writer.placed(key, fqn, layer, full, shard_ops.Piece(0, 0, lo, hi))
                part = data(lo - at, hi - at, r) if with_rank else data(lo - at, hi - at)
                writer.put_chunk(Rank(r, stage), stored, dtype, gshape, offsets, sizes, part)
    if made is not None:  # made by torch once, where this process writes a chunk of it; counted alone elsewhere
        dtype, made_rows = made[1], []
        row_bytes = ELEMENT_SIZES[dtype] * math.prod(full[1:])

        def rows_of(i: int, j: int, rank: int):
            if not writer.writes_rank(Rank(rank, stage)):
                return [(-1, 0, (j - i) * row_bytes)]  # its size only: the file is another process's
            if not made_rows:
                made_rows.append(made[0].rows(row.kind, names, dtype))
            return made_rows[0][i * row_bytes:j * row_bytes]
        return put(0, full[0], rows_of, with_rank=True)
    for name, runs in zip(names, conversions.hf_rows(row.kind, spec, full[0])):
        path, dtype, shape, offset, _ = index[name]
        if path not in fds:
            fds[path] = os.open(path, os.O_RDONLY)
        row_bytes = ELEMENT_SIZES[dtype] * math.prod(shape[1:])  # a row: every element after dim 0
        taken = 0  # rows of the HF tensor taken so far
        for a, b in runs:
            start = offset + taken * row_bytes
            put(a, b, lambda i, j, start=start: [(fds[path], start + i * row_bytes, (j - i) * row_bytes)])
            taken += b - a
    if row.kind == families.VOCAB and padded > spec.vocab_size:
        dtype = index[names[0]][1]
        row_bytes = full[1] * ELEMENT_SIZES[dtype]
        put(spec.vocab_size, padded, lambda i, j: bytes((j - i) * row_bytes))


def _same_bytes(a: tuple, b: tuple, chunk: int = 1 << 24) -> bool:
    """Whether two safetensors tensors (index entries) hold the same dtype, shape and bytes."""
    if a[1:3] != b[1:3] or a[4] != b[4]:
        return False
    with open(a[0], "rb") as fa, open(b[0], "rb") as fb:
        for at in range(0, a[4], chunk):
            n = min(chunk, a[4] - at)
            fa.seek(a[3] + at)
            fb.seek(b[3] + at)
            if fa.read(n) != fb.read(n):
                return False
    return True


def _safetensors_index(hf_dir: Path) -> dict[str, tuple[Path, str, tuple[int, ...], int, int]]:
    """name -> (file, dtype name, shape, data offset, bytes) of every tensor of an HF dir's safetensors files, from
    their headers; Declined for anything the torch path should read (and word)."""
    try:
        return _read_index(hf_dir)
    except Declined:
        raise
    except Exception as e:  # noqa: BLE001 (anything unexpected in a file: the torch path reads and words it)
        raise Declined(f"{hf_dir}: {type(e).__name__}: {e}") from None


def _read_index(hf_dir: Path) -> dict[str, tuple[Path, str, tuple[int, ...], int, int]]:
    index_file = hf_dir / "model.safetensors.index.json"
    if index_file.is_file():
        files = sorted(set(json.loads(index_file.read_text())["weight_map"].values()))
    elif (hf_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise Declined(f"{hf_dir}: no safetensors weights")
    out = {}
    for name in files:
        path = hf_dir / name
        end, at = path.stat().st_size, None
        entries = sorted(hf_tensors.data_offsets(path).items(), key=lambda item: item[1][2])
        for tensor, (code, shape, a, b) in entries:  # safetensors' own rule: the data one tensor after another
            dtype = SAFETENSORS_DTYPES.get(code)
            if dtype not in COPIED_DTYPES or at not in (None, a) \
                    or b - a != math.prod(shape) * ELEMENT_SIZES[dtype] or b > end or tensor in out:
                raise Declined(f"{path}: {tensor} is not a tensor this path copies")
            out[tensor], at = (path, dtype, shape, a, b - a), b
    return out
