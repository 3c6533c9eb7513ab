"""What a merge writes, decided before any tensor is read: the output tensors (`Entry`: source key, HF
names, conversion kind, shapes) in megatron-core order, how they are packed into files, the HF files beside
them (config, generation config, index, tokenizer), the one-line summary; and `prepare`, what every verb that
reads a checkpoint and writes a new one does first. Torch-free; merge, reshard, verify and inspect use it.
"""
from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt_tools import durable, io, output
from ckpt_tools.errors import ConfigError
from ckpt_tools.forms.checkpoint import Meta
from ckpt_tools.forms.dtypes import ELEMENT_SIZES
from ckpt_tools.model import conversions, families, hf, layout, mxfp4
from ckpt_tools.model.fp8 import FP8, SCALE, fp8_config, fp8_quantized, scale_grid
from ckpt_tools.model.spec import ModelSpec
from ckpt_tools.team import SOLO, Team

if TYPE_CHECKING:
    import torch

DTYPE_OPTIONS = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
HF, SAFETENSORS, TORCH = "hf", "safetensors", "torch"  # TORCH: one torch.save state dict with HF names
HF_BIN = "hf-bin"  # an HF dir with pytorch_model*.bin weights, for tools that still expect them
DIRS = (HF, HF_BIN)


@dataclass
class Entry:
    """One source tensor and what it becomes: output names, conversion kind, output shapes."""
    key: str
    kind: str
    names: list[str]
    shapes: list[tuple[int, ...]]

    def nbytes(self, dtype: str | torch.dtype) -> int:
        """Bytes of the output tensors in `dtype`: a name ("bfloat16") or a torch dtype."""
        size = ELEMENT_SIZES[dtype] if isinstance(dtype, str) else dtype.itemsize
        return sum(math.prod(s) * size for s in self.shapes)


def plan(spec: ModelSpec, padded_vocab: int, fmt: str) -> list[Entry]:
    """Every output tensor, in megatron-core order, with its shape (from the rows each is made of)."""
    if fmt in (HF, HF_BIN, TORCH):
        rows = _stacks_together([(key, row.kind, names) for key, row, names in hf.hf_keys(spec)])
        rows += [(key, row.kind, [name]) for key, row, name in hf.hf_copies(spec)]  # MTP layers' copies
    else:  # megatron-core names, full TP=1 PP=1 tensors, vocab trimmed
        rows = [(key, families.VOCAB if layout.has_padded_rows(key, spec, 1) else families.SAME, [key])
                for _, key in layout.stage_keys(spec, [spec.num_layers], 0)
                if layout.holds_weights(key, spec, 1)]
    return [Entry(key, kind, names, conversions.hf_shapes(kind, spec, layout.full_shape(key, spec, padded_vocab, 1)))
            for key, kind, names in rows]


def _stacks_together(rows: list[tuple]) -> list[tuple]:
    """(key, kind, names) rows in order, those whose one name is a slice of a stacked tensor (hf.part_of) moved to its
    first slice's row: each stacked tensor's slices one after another, as the file holds them."""
    groups: list[list[tuple]] = []
    stacks: dict[str, list[tuple]] = {}
    for row in rows:
        base, e = hf.part_of(row[2][0]) if len(row[2]) == 1 else (None, None)
        if e is None:
            groups.append([row])
        elif base in stacks:
            stacks[base].append(row)
        else:
            stacks[base] = [row]
            groups.append(stacks[base])
    return [row for group in groups for row in group]


def _stack_of(e: Entry) -> str | None:
    return hf.part_of(e.names[0])[0] if len(e.names) == 1 and hf.part_of(e.names[0])[1] is not None else None


def split_files(entries: list[Entry], dtype: str | torch.dtype, max_bytes: int,
                nbytes: Callable[[Entry], int] | None = None) -> list[list[Entry]]:
    """Entries in order, packed into files of at most max_bytes (a tensor bigger than that gets its own; a stacked
    tensor's slices stay in one file)."""
    files: list[list[Entry]] = [[]]
    size = 0
    for i, e in enumerate(entries):
        n = e.nbytes(dtype) if nbytes is None else nbytes(e)
        stack = _stack_of(e)
        if files[-1] and size + n > max_bytes and (stack is None or stack != _stack_of(entries[i - 1])):
            files.append([])
            size = 0
        files[-1].append(e)
        size += n
    return files


@dataclass
class Job:
    """What one merge writes, decided from meta.json and the options alone (no tensor read yet)."""
    meta: Meta
    fmt: str
    dtype: str  # of the output tensors: "bfloat16", "float16" or "float32"
    from_master: bool
    entries: list[Entry]
    files: list[list[Entry]]  # the entries of each output file
    fp8: tuple[int, int] | None = None  # the decoder layers' linear weights in FP8 blocks of this size (fp8_quantized)
    mxfp4: bool = False  # the experts' weights in MXFP4 (ckpt_tools.model.mxfp4)

    @classmethod
    def make(cls, meta: Meta, fmt: str, dtype: str | None, from_master: bool, max_shard_size: int,
             fp8: tuple[int, int] | None = None, packed: bool = False) -> Job:
        target = DTYPE_OPTIONS[dtype] if dtype else ("float32" if from_master else meta.params_dtype)
        for option, given in (("--fp8-blocks", fp8 is not None), ("--mxfp4", packed)):
            if given and fmt != HF:
                raise ConfigError(f"{option} writes a HuggingFace model dir (--format hf), not {fmt}: drop one of them")
        if fp8 is not None and packed:
            raise ConfigError("--fp8-blocks and --mxfp4 together: choose one")
        family = families.get(meta.spec.architecture)
        if packed and not family.mxfp4:
            raise ConfigError(f"--mxfp4: {family.name}'s HF weights have no MXFP4 form (the families with one: "
                              f"{', '.join(f.name for f in families.all_families() if f.mxfp4)}): drop --mxfp4")
        if fp8 is not None and not family.fp8_blocks:
            raise ConfigError(f"--fp8-blocks: {family.name}'s HF weights have no block-scaled FP8 form (the families "
                              f"with one: {', '.join(f.name for f in families.all_families() if f.fp8_blocks)}): drop "
                              f"--fp8-blocks")
        entries = plan(meta.spec, meta.padded_vocab, fmt)
        for e in entries if packed else ():
            for name, shape in zip(e.names, e.shapes):
                if mxfp4.quantized(name, family):
                    mxfp4.check_shape(name, shape)
        job = cls(meta, fmt, target, from_master, entries, [], fp8, packed)
        job.files = split_files(entries, target, max_shard_size, job.entry_bytes) if fmt in DIRS else [entries]
        return job

    def entry_dtype(self, e: Entry) -> str:
        """The dtype an entry is written in: the job's, or its layout row's own (the expert bias: float32)."""
        return layout.dtype_of(e.key, self.meta.spec, self.dtype)

    def outputs(self, e: Entry) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype, shape) of each tensor an entry writes: an FP8 weight and its block scales where `fp8`."""
        out = []
        for n, s in zip(e.names, e.shapes):
            if self.fp8 is not None and fp8_quantized(n, s):
                out += [(n, FP8, s), (n + SCALE, "float32", scale_grid(s, self.fp8))]
            elif self.mxfp4 and mxfp4.quantized(n, families.get(self.meta.spec.architecture)):
                out += [(name, "uint8", shape) for name, shape in zip(packed_names(n), mxfp4.packed_shapes(s))]
            else:
                out.append((n, self.entry_dtype(e), s))
        return out

    def offsets(self, group: list[Entry]) -> dict[str, int]:
        """Where each output tensor of one file (a stacked tensor's slices each) starts in its data section."""
        at, pos = {}, 0
        for name, dtype, shape in self.tensors(group):
            at[name] = pos
            pos += math.prod(shape) * ELEMENT_SIZES[dtype]
        for name, dtype, shape in (t for e in group for t in self.outputs(e)):
            base, part = hf.part_of(name)
            if part is not None:
                at[name] = at[base] + part * math.prod(shape) * ELEMENT_SIZES[dtype]
        return at

    def entry_bytes(self, e: Entry) -> int:
        return sum(math.prod(s) * ELEMENT_SIZES[d] for _, d, s in self.outputs(e))

    @property
    def total(self) -> int:
        return sum(self.entry_bytes(e) for e in self.entries)

    @property
    def names(self) -> list[str]:
        n = len(self.files)
        stem, ext = ("pytorch_model", "bin") if self.fmt == HF_BIN else ("model", "safetensors")
        return [f"{stem}.{ext}"] if n == 1 else [f"{stem}-{i + 1:05d}-of-{n:05d}.{ext}" for i in range(n)]

    def tensors(self, group: list[Entry]) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, dtype, shape) of each tensor of one output file, in order (a stacked tensor's slices as one)."""
        return hf.stacked([t for e in group for t in self.outputs(e)])

    def metadata(self) -> dict[str, str]:
        """The safetensors header's __metadata__."""
        metadata = {"format": "pt"}
        if self.fmt == SAFETENSORS:
            m = self.meta
            metadata["ckpt_tools"] = json.dumps({"model": m.spec.to_dict(), "iteration": m.iteration,
                                                 "source_layout": {"tp": m.tp_size, "pp": m.pp_size}})
        return metadata

    def write(self, out: Path, force: bool, quiet: bool, tok_dir: Path | None,
              write_file: Callable[[Path, list[Entry], object], None], team: Team = SOLO, at_once: int = 1) -> None:
        """OUT, staged and renamed when complete: `write_file(path, entries, bar)` writes each safetensors
        file (updating the progress bar per entry), `at_once` of them at a time (durable.each_file's threads: the
        caller says whether write_file allows it; a file stops at its next entry once another has failed), then
        config, index and tokenizer files for HF. In a team each process writes its run of the files (team.split by
        bytes), process 0 the files beside them."""
        extras = _hf_json(self.meta.spec, self.dtype, tok_dir, self.fp8, self.mxfp4) if self.fmt in DIRS else None
        owners = team.split([sum(self.entry_bytes(e) for e in group) for group in self.files])
        with output.staged(out, force, directory=self.fmt in DIRS, team=team) as tmp:
            mine = [i for i, owner in enumerate(owners) if owner == team.rank]
            bar = output.progress(sum(self.entry_bytes(e) for i in mine for e in self.files[i]), "merge", quiet)
            lock = threading.Lock()
            durable.each_file([(tmp / self.names[i] if self.fmt in DIRS else tmp, self.files[i]) for i in mine],
                              lambda path, group, stopped: write_file(path, group, _Progress(bar, lock, stopped)),
                              at_once)
            bar.close()
            if extras is not None and team.lead:
                _write_hf_extras(tmp, *extras, tok_dir, [[n for n, _, _ in self.tensors(group)]
                                                         for group in self.files], self.names, self.total)

    def summary(self, out: Path, seconds: float, *notes: str | None) -> str:
        meta, spec = self.meta, self.meta.spec
        line = (f"merged {meta.dir} ({spec.architecture}, {meta.grid}, iteration "
                f"{meta.iteration}) -> {out}: {sum(len(self.tensors(group)) for group in self.files)} tensors, "
                f"{self.total / 2**20:,.1f} MiB in {len(self.files)} file(s), {self.dtype}"
                + (f" (decoder linear weights in {self.fp8[0]}x{self.fp8[1]} FP8 blocks)" if self.fp8 else "")
                + (" (experts' weights in MXFP4)" if self.mxfp4 else "")
                + f"{', from fp32 master weights' if self.from_master else ''}, vocab {meta.padded_vocab} -> "
                f"{spec.vocab_size} rows, {seconds:.1f}s")
        return "\n".join(x for x in (line, *notes) if x)


class _Progress:
    """The progress bar as one of the files written at once sees it (durable.each_file): updated after each entry
    under a lock shared by the files, and the point where a file stops (durable.Stopped) once another has failed."""

    def __init__(self, bar, lock, stopped):
        self.bar, self.lock, self.stopped = bar, lock, stopped

    def update(self, n: int) -> None:
        if self.stopped.is_set():
            raise durable.Stopped()
        with self.lock:
            self.bar.update(n)


def packed_names(name: str) -> tuple[str, str]:
    """The blocks' and scales' names of an MXFP4 weight (a slice `name[e]`: the slices of theirs)."""
    base, part = hf.part_of(name)
    suffix = "" if part is None else f"[{part}]"
    return base + mxfp4.BLOCKS + suffix, base + mxfp4.SCALES + suffix


def tokenizer_dir(checkpoint_dir: Path, tokenizer: str | Path | None) -> Path | None:
    """The tokenizer dir to copy: --tokenizer, else the checkpoint's own tokenizer files (if any)."""
    if tokenizer is not None:
        path = Path(tokenizer)
        if not hf.tokenizer_files(path):
            raise ConfigError(f"{path}: no tokenizer files ({', '.join(hf.TOKENIZER_FILES[:2])}, ...): "
                              f"pass a HuggingFace tokenizer dir to --tokenizer")
        return path
    return checkpoint_dir if hf.carried_files(checkpoint_dir) else None


def _hf_json(spec: ModelSpec, dtype: str, tok_dir: Path | None, fp8: tuple[int, int] | None = None,
             packed: bool = False) -> tuple[dict, dict | None]:
    """(config.json, generation_config.json) contents; None: the carried generation_config.json is copied."""
    bos, eos = hf.special_ids(tok_dir)
    ours = hf.hf_config(spec, dtype, bos, eos)
    if fp8 is not None:
        ours[hf.QUANTIZATION] = fp8_config(fp8)
    if packed:
        ours[hf.QUANTIZATION] = mxfp4.config(families.get(spec.architecture))
    config = hf.merged_config(ours, spec, tok_dir)
    if tok_dir is not None and (tok_dir / hf.GENERATION_CONFIG).is_file():
        return config, None
    gen = {"_from_model_config": True, "do_sample": False}
    gen.update({k: v for k, v in (("bos_token_id", bos), ("eos_token_id", eos)) if v is not None})
    return config, gen


def _write_hf_extras(tmp: Path, config: dict, gen: dict, tok_dir: Path | None, files: list[list[str]],
                     names: list[str], total: int) -> None:
    io.write_json_atomic(tmp / "config.json", config)
    if gen is not None:
        io.write_json_atomic(tmp / hf.GENERATION_CONFIG, gen)
    if len(files) > 1:
        weight_map = {n: fname for fname, group in zip(names, files) for n in group}
        index = "pytorch_model.bin.index.json" if names[0].endswith(".bin") else "model.safetensors.index.json"
        io.write_json_atomic(tmp / index, {"metadata": {"total_size": total}, "weight_map": weight_map})
    if tok_dir is not None:  # tokenizer, chat templates, generation config; our copy of config.json stays behind
        for f in hf.copy_carried(tok_dir, tmp):
            if f.name == hf.ORIGINAL_CONFIG:
                f.unlink()


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB', '1000' -> bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    s = text.strip().upper()
    num = s.rstrip("KMGTIB")
    try:
        value = float(num)
        return int(value * units[s[len(num):]])
    except (ValueError, KeyError):
        raise ConfigError(f"bad size {text!r}: use a number with an optional unit, e.g. 5GB, 500MB, 2GiB") from None
