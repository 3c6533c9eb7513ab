"""Building and damaging small checkpoints for the bad-input tests (test_bad_input, test_hostile_files,
test_fuzz, test_merge_sources), and running the CLI on them.

The inputs are built without training (`make_ckpt`: full_init tensors split by the layout table,
optimizer and RNG files, meta.json through build_meta / write_meta so it carries size + sha256 records
and its checksum), then damaged one way per case. `reseal` rewrites meta.json's records and checksum
after a damage when the case is about something behind those checks (a shard of the wrong shape, say,
would otherwise be caught first by its recorded size).
"""
from __future__ import annotations

import builtins
import inspect
import json
import os
import random
import shutil
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckpt_tools.cli import main
from ckpt_tools.forms import checkpoint as fmt
from ckpt_tools.model import layout, shard_ops
from ckpt_tools.model.ranks import Rank
from ckpt_tools.model.spec import ModelSpec
from trainer.model import full_init

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "fixtures" / "configs"
ITERATION, CONSUMED = 100, 1600


def M(tp: int, pp: int) -> str:
    """The file names of one rank's shards: model, optimizer, RNG."""
    return fmt.model_file(Rank(tp, pp))


def O(tp: int, pp: int) -> str:  # noqa: E743
    return fmt.optimizer_file(Rank(tp, pp))


def R(tp: int, pp: int) -> str:
    return fmt.rng_file(Rank(tp, pp))


OUT = "OUT"  # the output name the cases use


# ---------------------------------------------------------------- building and damaging checkpoints
def llama(**changes) -> ModelSpec:
    """The tiny Llama of test_megatron_lm (GQA, untied): 4 layers, hidden 64, vocab 250 (256 padded)."""
    base = {"architecture": "llama", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
            "num_query_groups": 2, "ffn_hidden_size": 96, "vocab_size": 250, "max_position_embeddings": 128,
            "norm_epsilon": 1e-6, "rotary_base": 500000.0, "tie_word_embeddings": False}
    return ModelSpec(**{**base, **changes})


def make_ckpt(save_dir: Path, spec: ModelSpec, tp: int = 2, pp: int = 2, seed: int = 7, optimizer: bool = True,
              iteration: int = ITERATION) -> Path:
    """A save dir (`latest` + checkpoint-N) in our format, made without training; returns the checkpoint dir.

    Model shards: full_init tensors split by the layout table; replicated norms get a seeded perturbation, so
    that shards of two seeds differ everywhere (a shard from another checkpoint breaks the TP replicas).
    Optimizer shards: fp32 master = the weights, seeded moments, step = iteration. RNG files as the trainer's.
    """
    ckpt = Path(save_dir) / fmt.checkpoint_name(iteration)
    ckpt.mkdir(parents=True)
    padded = spec.padded_vocab_size(tp)
    counts = layout.layers_per_stage(spec.num_layers, pp)
    gen = torch.Generator().manual_seed(seed)
    for p in range(pp):
        model: list[dict] = [{} for _ in range(tp)]
        optim: list[dict] = [{} for _ in range(tp)]
        for local, key in layout.stage_keys(spec, counts, p):
            rule = layout.find_rule(key, spec, pp)
            if rule.split == layout.EXTRA:
                for t in range(tp):
                    model[t][local] = None
                continue
            full = full_init(key, spec, padded, seed=seed)
            if rule.split == layout.REPLICATED:
                full = full + 0.01 * torch.randn(full.shape, generator=gen)
            fields = {"master": full, "exp_avg": 1e-3 * torch.randn(full.shape, generator=gen),
                      "exp_avg_sq": 1e-6 * torch.rand(full.shape, generator=gen)}
            parts = {f: shard_ops.split(key, v, spec, tp, pp) for f, v in fields.items()}
            for t in range(tp):
                model[t][local] = parts["master"][t].clone()
                optim[t][local] = {f: parts[f][t].clone() for f in fields} | {"step": torch.tensor(float(iteration))}
        for t in range(tp):
            torch.save({"model": model[t]}, ckpt / M(t, p))
            if optimizer:
                torch.save({"optimizer": optim[t], "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95)}],
                            "scheduler": {"iteration": iteration, "lr": 1e-3}, "scaler": None}, ckpt / O(t, p))
            torch.save({"torch": torch.get_rng_state(), "python": random.Random(seed).getstate(), "cuda": None,
                        "iteration": iteration, "consumed_samples": CONSUMED}, ckpt / R(t, p))
    files = {f.name: fmt.file_record(f) for f in sorted(ckpt.iterdir())}
    meta = fmt.build_meta(spec, tp, counts, padded, iteration, CONSUMED, "float32", 1,
                          {"seq_length": 64, "lr": 1e-3}, files)
    fmt.write_meta(ckpt / fmt.META, meta)
    (Path(save_dir) / fmt.LATEST).write_text(ckpt.name + "\n")
    return ckpt


def read_meta(ckpt: Path) -> dict:
    return json.loads((ckpt / fmt.META).read_text())


def reseal(ckpt: Path, change: Callable[[dict], None] | None = None) -> None:
    """meta.json made consistent again after a deliberate damage: recorded files that exist get their new
    size + sha256, `change` edits the content, and the checksum is recomputed."""
    meta = read_meta(ckpt)
    meta.pop("checksum", None)
    meta["files"] = {n: (fmt.file_record(ckpt / n) if (ckpt / n).is_file() else r) for n, r in meta["files"].items()}
    if change is not None:
        change(meta)
    fmt.write_meta(ckpt / fmt.META, meta)


def resave(ckpt: Path, name: str, change: Callable[[dict], None], seal: bool = True) -> None:
    """Load a shard file, change its object, save it back (torch.save), and reseal meta.json."""
    obj = torch.load(ckpt / name, weights_only=True)
    change(obj)
    torch.save(obj, ckpt / name)
    if seal:
        reseal(ckpt)


def tensor_record_span(path: Path) -> tuple[int, int]:
    """(offset, length) in the file of the biggest tensor storage record of a torch.save zip."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "rb") as f:  # local header: 30 bytes + name + extra, then the stored (uncompressed) bytes
        f.seek(info.header_offset)
        head = f.read(30)
    name_len, extra_len = int.from_bytes(head[26:28], "little"), int.from_bytes(head[28:30], "little")
    return info.header_offset + 30 + name_len + extra_len, info.file_size


def flip_tensor_bytes(path: Path, n: int = 4) -> None:
    """Flip bits inside one tensor's data (not the zip or pickle structure): the file still loads."""
    start, length = tensor_record_span(path)
    data = bytearray(path.read_bytes())
    for i in range(n):
        data[start + length // 2 + 4 * i] ^= 0x5A
    path.write_bytes(bytes(data))


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def copy_save(save_dir: Path, dest: Path) -> Path:
    """A private copy of a save dir; returns its checkpoint dir."""
    shutil.copytree(save_dir, dest)
    return dest / (save_dir / fmt.LATEST).read_text().strip()


class SystemCall:
    """Unpickling it runs `os.system(cmd)` (a pickle's __reduce__): the classic malicious checkpoint."""

    def __init__(self, cmd: str):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


class OpenFile:
    """Unpickling it runs `builtins.open(path, 'w')`: creates the file."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (builtins.open, (self.path, "w"))


def plant_malicious(ckpt: Path, name: str, payload) -> None:
    """A valid torch.save zip that unpickles `payload` among the shard's tensors; meta.json resealed, so the
    size and sha256 checks pass and only the allow-list stands between it and code execution."""
    key = "optimizer" if name.startswith("optimizer_") else "model"

    def change(obj: dict) -> None:
        obj[key]["decoder.layers.0.input_layernorm.weight" if key == "model" else "evil"] = payload
    resave(ckpt, name, change)


# ---------------------------------------------------------------- running the CLI
def runner() -> CliRunner:
    """stdout and stderr in one `output` (click < 8.2 needs mix_stderr=True; 8.2+ always mixes)."""
    if "mix_stderr" in inspect.signature(CliRunner.__init__).parameters:
        return CliRunner(mix_stderr=True)
    return CliRunner()


def invoke(*args):
    return runner().invoke(main, [str(a) for a in args])


def error_line(result, table: bool = False) -> str:
    """The single `error:` line of a failed command; with `table` (verify) a report may precede it."""
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        f"exception escaped: {result.exception!r}\n{result.output}"
    assert "Traceback" not in result.output, result.output
    assert result.exit_code == 1, (result.exit_code, result.output)
    lines = [line for line in result.output.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error")]
    if table:
        assert errors == [lines[-1]], result.output
    else:
        assert len(lines) == 1, result.output
    assert lines[-1].startswith("error: "), result.output
    return lines[-1]


def assert_no_out(out: Path) -> None:
    assert not out.exists(), f"{out} was left behind"
    left = sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))
    assert not left, f"temp outputs left beside {out}: {left}"


def tree(path: Path) -> dict[str, bytes]:
    """relative name -> bytes of every file under path (or of path itself when it is a file)."""
    if path.is_file():
        return {".": path.read_bytes()}
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- the good inputs, made once
@dataclass
class Bases:
    root: Path
    base: Path  # save dir: llama TP2 x PP2, optimizer + RNG, seed 7
    other: Path  # the same model and layout, seed 8 (another checkpoint)
    tp1: Path  # seed 7 at TP1 x PP2 (shards of another TP)
    uneven: Path  # base resharded to TP2 x PP2 with layers 1,3
    single: Path  # base resharded to TP1 x PP1
    hf: Path  # base merged to a HuggingFace dir
    single_hf: Path  # single merged to a HuggingFace dir


def make_bases(root: Path) -> Bases:
    """The good inputs every bad-input test damages a copy of."""
    from ckpt_tools.verbs.merge import merge
    from ckpt_tools.verbs.reshard import reshard
    make_ckpt(root / "base", llama())
    make_ckpt(root / "other", llama(), seed=8)
    make_ckpt(root / "tp1", llama(), tp=1)
    reshard(root / "base", root / "uneven", 2, 2, [1, 3], quiet=True)
    reshard(root / "base", root / "single", 1, 1, quiet=True)
    merge(root / "base", root / "hf", quiet=True)
    merge(root / "single", root / "single_hf", quiet=True)
    return Bases(root, *(root / n for n in ("base", "other", "tp1", "uneven", "single", "hf", "single_hf")))


def ckpt_of(save_dir: Path) -> Path:
    return save_dir / (save_dir / fmt.LATEST).read_text().strip()


# ---------------------------------------------------------------- the table of test_bad_input.py
CASES: list = []  # pytest.param(build, table) rows; build(bases, tmp) -> (args, expected substrings, OUT or None)


def case(kind: str, verb: str, table: bool = False):
    """Register `fn(bases, tmp) -> (args, expected substrings, OUT or None)` as one row of the table."""
    def register(fn):
        CASES.append(pytest.param(fn, table, id=f"{verb}:{kind}"))
        return fn
    return register
