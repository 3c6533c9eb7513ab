"""`ckpt merge`: sharded checkpoint -> one HuggingFace model dir, or one safetensors file.

Model-free and streaming: the output files are planned from the layout table (names, dtypes,
shapes) before any tensor is read; then, tensor by tensor, the TP shards are read from their
mmap'd files, joined, converted, written and their pages released. Memory stays near the largest
tensor; the model is never built and the checkpoint is never held in RAM.
"""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ckpt_tools import hf, io, layout, output
from ckpt_tools.errors import CkptError, ConfigError
from ckpt_tools.shards import ShardSet, open_checked
from ckpt_tools.spec import ModelSpec
from ckpt_tools.writers import SafetensorsWriter

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
HF, SAFETENSORS = "hf", "safetensors"


@dataclass
class Entry:
    """One source tensor and what it becomes: output names, conversion kind, output shapes."""
    key: str
    kind: str
    names: list[str]
    shapes: list[tuple[int, ...]]

    def nbytes(self, dtype: torch.dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        return sum(torch.Size(s).numel() * size for s in self.shapes)


def plan(spec: ModelSpec, padded_vocab: int, fmt: str) -> list[Entry]:
    """Every output tensor, in megatron-core order, with its shape computed on the meta device."""
    if fmt == HF:
        rows = [(key, row.kind, names) for key, row, names in hf.hf_keys(spec)]
    else:  # megatron-core names, full TP=1 PP=1 tensors, vocab trimmed
        rows = [(key, hf.VOCAB if layout.find_rule(key, spec, 1).split == layout.VOCAB else hf.SAME, [key])
                for _, key in layout.stage_keys(spec, [spec.num_layers], 0)
                if layout.find_rule(key, spec, 1).split != layout.EXTRA]
    entries = []
    for key, kind, names in rows:
        meta = torch.empty(layout.full_shape(key, spec, padded_vocab, 1), device="meta")
        entries.append(Entry(key, kind, names, [tuple(t.shape) for t in hf.to_hf(kind, meta, spec)]))
    return entries


def split_files(entries: list[Entry], dtype: torch.dtype, max_bytes: int) -> list[list[Entry]]:
    """Entries in order, packed into files of at most max_bytes (a tensor bigger than that gets its own)."""
    files: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        n = e.nbytes(dtype)
        if files[-1] and size + n > max_bytes:
            files.append([])
            size = 0
        files[-1].append(e)
        size += n
    return files


def find_tokenizer(shards: ShardSet, tokenizer: str | Path | None) -> Path | None:
    if tokenizer is not None:
        path = Path(tokenizer)
        if not hf.tokenizer_files(path):
            raise ConfigError(f"{path}: no tokenizer files ({', '.join(hf.TOKENIZER_FILES[:2])}, ...): "
                              f"pass a HuggingFace tokenizer dir to --tokenizer")
        return path
    return shards.meta.dir if hf.tokenizer_files(shards.meta.dir) else None


def _tied_copy_note(shards: ShardSet) -> str | None:
    """With tied embeddings and PP > 1 the last stage keeps a copy; HF keeps one tensor. Say if they differ."""
    spec = shards.meta.spec
    if not spec.tie_word_embeddings or "output_layer.weight" not in shards.keys():
        return None
    emb = shards.full("embedding.word_embeddings.weight")[: spec.vocab_size]
    out = shards.full("output_layer.weight")[: spec.vocab_size]
    shards.release()
    if layout.same_bits(emb, out):
        return None
    diff = (emb.float() - out.float()).abs().max().item()
    return (f"note: the last stage's copy of the tied embedding differs from the first stage's (max abs {diff:.3g}); "
            f"the merged model uses the first stage's embedding")


def prepare(src: str | Path, out: str | Path, force: bool, vocab_size: int | None,
            check_hashes: bool) -> tuple[Path, str | None, ShardSet]:
    """What merge and reshard do before anything else: refuse an existing OUT (unless force), note
    leftovers of an interrupted run, open SRC and refuse shards that do not match the layout table."""
    out = output.check_target(out, force)
    return out, output.note_leftovers(out), open_checked(src, vocab_size, check_hashes)


def merge(src: str | Path, out: str | Path, *, fmt: str = HF, dtype: str | None = None,
          from_master: bool = False, max_shard_size: int = 5 * 10**9, tokenizer: str | Path | None = None,
          vocab_size: int | None = None, force: bool = False, quiet: bool = False, check_hashes: bool = False,
          no_preflight: bool = False) -> str:
    """Write the merged model; returns the one-line summary."""
    start = time.perf_counter()
    out, leftover, shards = prepare(src, out, force, vocab_size, check_hashes)
    meta, spec = shards.meta, shards.meta.spec
    if from_master and not shards.has_optimizer():
        raise CkptError(f"{meta.dir}: no optimizer shards with fp32 master weights "
                        f"({'Megatron-LM optimizer state is not read' if meta.source == 'megatron-lm' else 'saved without optimizer'}): "
                        f"merge without --from-master-weights")
    field = "master" if from_master else None
    target = DTYPES[dtype] if dtype else (torch.float32 if from_master else TORCH_DTYPES[meta.params_dtype])
    tok_dir = find_tokenizer(shards, tokenizer) if fmt == HF else None
    entries = plan(spec, meta.padded_vocab, fmt)
    files = split_files(entries, target, max_shard_size) if fmt == HF else [entries]
    total = sum(e.nbytes(target) for e in entries)
    names = (["model.safetensors"] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    output.preflight(out, total, no_preflight)
    note = _tied_copy_note(shards)
    extras = _hf_json(spec, target, tok_dir) if fmt == HF else None
    with output.staged(out, force, directory=fmt == HF) as tmp:
        bar = output.progress(total, "merge", quiet)
        for name, group in zip(names, files):
            path = tmp / name if fmt == HF else tmp
            metadata = {"format": "pt"}
            if fmt == SAFETENSORS:
                metadata["ckpt_tools"] = json.dumps({"model": spec.to_dict(), "iteration": meta.iteration,
                                                     "source_layout": {"tp": meta.tp_size, "pp": meta.pp_size}})
            writer = SafetensorsWriter(path, [(n, target, s) for e in group for n, s in zip(e.names, e.shapes)],
                                       metadata)
            for e in group:
                for n, t in zip(e.names, hf.to_hf(e.kind, shards.full(e.key, field), spec)):
                    writer.write(n, t.to(target))
                shards.release()
                bar.update(e.nbytes(target))
            writer.close()
        bar.close()
        if extras is not None:
            _write_hf_extras(tmp, *extras, tok_dir, files, names, total)
    shards.close()
    seconds = time.perf_counter() - start
    summary = (f"merged {meta.dir} ({spec.architecture}, TP{meta.tp_size} x PP{meta.pp_size}, iteration "
               f"{meta.iteration}) -> {out}: {sum(len(e.names) for e in entries)} tensors, "
               f"{total / 2**20:,.1f} MiB in {len(files)} file(s), {hf.DTYPE_NAMES[target]}"
               f"{', from fp32 master weights' if from_master else ''}, vocab {meta.padded_vocab} -> "
               f"{spec.vocab_size} rows, {seconds:.1f}s")
    return "\n".join(x for x in (summary, note, leftover) if x)


def _hf_json(spec: ModelSpec, dtype: torch.dtype, tok_dir: Path | None) -> tuple[dict, dict]:
    """(config.json, generation_config.json) contents."""
    bos, eos = hf.special_ids(tok_dir)
    gen = {"_from_model_config": True, "do_sample": False}
    gen.update({k: v for k, v in (("bos_token_id", bos), ("eos_token_id", eos)) if v is not None})
    return hf.hf_config(spec, dtype, bos, eos), gen


def _write_hf_extras(tmp: Path, config: dict, gen: dict, tok_dir: Path | None, files: list[list[Entry]],
                     names: list[str], total: int) -> None:
    io.write_json_atomic(tmp / "config.json", config)
    io.write_json_atomic(tmp / "generation_config.json", gen)
    if len(files) > 1:
        weight_map = {n: fname for fname, group in zip(names, files) for e in group for n in e.names}
        io.write_json_atomic(tmp / "model.safetensors.index.json",
                             {"metadata": {"total_size": total}, "weight_map": weight_map})
    for f in hf.tokenizer_files(tok_dir) if tok_dir is not None else []:
        shutil.copyfile(f, tmp / f.name)


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
