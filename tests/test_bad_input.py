"""Bad input, table-driven: every kind of damaged or wrong input gets ONE line `error: ...` naming the
file / tensor / rank with what was expected and found, exit code 1, no traceback, and no OUT (nor a
`.OUT.tmp-*` beside it). A malicious pickle placed as a shard is refused everywhere and never runs.

The inputs are small checkpoints built here without training (`make_ckpt`: full_init tensors split by
the layout table, optimizer and RNG files, meta.json through build_meta / write_meta so it carries
size + sha256 records and its checksum), then damaged one way per case. `reseal` rewrites meta.json's
records and checksum after a damage when the case is about something behind those checks (a shard of
the wrong shape, say, would otherwise be caught first by its recorded size).
"""
from __future__ import annotations

import builtins
import inspect
import json
import os
import random
import shutil
import subprocess
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file as load_safetensors
from safetensors.torch import save_file as save_safetensors

from ckpt_tools import checkpoint as fmt
from ckpt_tools import layout
from ckpt_tools.cli import main
from ckpt_tools.spec import ModelSpec
from trainer.model import full_init

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "fixtures" / "configs"
ITERATION, CONSUMED = 100, 1600
M, O, R = fmt.model_file, fmt.optimizer_file, fmt.rng_file


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
            parts = {f: layout.split(key, v, spec, tp, pp) for f, v in fields.items()}
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


@pytest.fixture(scope="session")
def bases(tmp_path_factory) -> Bases:
    from ckpt_tools.merge import merge
    from ckpt_tools.reshard import reshard
    root = tmp_path_factory.mktemp("bad-input-bases")
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


# ---------------------------------------------------------------- the table
CASES: list = []


def case(kind: str, verb: str, table: bool = False):
    """Register `fn(bases, tmp) -> (args, expected substrings, OUT or None)` as one row of the table."""
    def register(fn):
        CASES.append(pytest.param(fn, table, id=f"{verb}:{kind}"))
        return fn
    return register


OUT = "OUT"


def _copy(b: Bases, tmp: Path, which: str = "base") -> Path:
    return copy_save(getattr(b, which), tmp / "src")


@case("missing model shard", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    (ck / M(1, 1)).unlink()
    return ["merge", ck, tmp / OUT], [f"{M(1, 1)}: missing shard (TP rank 1, PP rank 1) of a TP2 x PP2", "restore"], tmp / OUT


@case("missing optimizer shard", "reshard")
def _(b, tmp):
    ck = _copy(b, tmp)
    (ck / O(0, 0)).unlink()  # the first one: not taken for "saved without optimizer"
    return (["reshard", ck, tmp / OUT, "--tp", "1", "--pp", "1"],
            [f"{O(0, 0)}: missing shard (TP rank 0, PP rank 0)"], tmp / OUT)


@case("missing rng file recorded in meta.json", "reshard")
def _(b, tmp):
    ck = _copy(b, tmp)
    (ck / R(0, 0)).unlink()
    return (["reshard", ck, tmp / OUT, "--tp", "1", "--pp", "1"],
            [f"{R(0, 0)}: missing, but meta.json records it"], tmp / OUT)


@case("extra shard", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    shutil.copy(ck / M(1, 0), ck / M(2, 0))
    return (["merge", ck, tmp / OUT], [f"{M(2, 0)}: extra shard, not part of a TP2 x PP2 checkpoint", "remove it"],
            tmp / OUT)


@case("shard of another checkpoint (same size), --check-hashes", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    shutil.copy(ckpt_of(b.other) / M(1, 0), ck / M(1, 0))
    return (["merge", ck, tmp / OUT, "--check-hashes"], [f"{M(1, 0)}: sha256 differs from meta.json"], tmp / OUT)


@case("shard of another checkpoint (same size), no hashes: TP replicas differ", "reshard")
def _(b, tmp):
    ck = _copy(b, tmp)
    shutil.copy(ckpt_of(b.other) / M(1, 0), ck / M(1, 0))
    return (["reshard", ck, tmp / OUT, "--tp", "1", "--pp", "1"],
            ["decoder.layers.0.input_layernorm.weight: replicated tensor differs between TP rank 0 and TP rank 1"],
            tmp / OUT)


@case("shard of another checkpoint (other size: mismatched meta)", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    shutil.copy(ckpt_of(b.tp1) / M(0, 1), ck / M(0, 1))
    size = (ck / M(0, 1)).stat().st_size
    recorded = read_meta(ck)["files"][M(0, 1)]["size"]
    return (["merge", ck, tmp / OUT], [f"{M(0, 1)}: {size} bytes, meta.json records {recorded}",
                                       "from another checkpoint"], tmp / OUT)


@case("truncated shard", "reshard")
def _(b, tmp):
    ck = _copy(b, tmp)
    truncate(ck / M(0, 1))
    recorded = read_meta(ck)["files"][M(0, 1)]["size"]
    return (["reshard", ck, tmp / OUT, "--tp", "1", "--pp", "2"],
            [f"{M(0, 1)}: {recorded // 2} bytes, meta.json records {recorded}", "truncated"], tmp / OUT)


@case("truncated shard, no size recorded", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    truncate(ck / M(1, 1), 0.7)
    reseal(ck, lambda m: m.update(files={}))  # a meta.json without records (as older tools write)
    return (["merge", ck, tmp / OUT], [f"{M(1, 1)}: not a readable torch file", "truncated or corrupt"], tmp / OUT)


@case("flipped bytes in tensor data, --check-hashes", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    flip_tensor_bytes(ck / M(0, 1))
    return (["merge", ck, tmp / OUT, "--format", "safetensors", "--check-hashes"],
            [f"{M(0, 1)}: sha256 differs from meta.json"], tmp / OUT)


@case("flipped bytes in optimizer tensor data, --check-hashes", "reshard")
def _(b, tmp):
    ck = _copy(b, tmp)
    flip_tensor_bytes(ck / O(1, 0))
    return (["reshard", ck, tmp / OUT, "--tp", "1", "--pp", "1", "--check-hashes"],
            [f"{O(1, 0)}: sha256 differs from meta.json"], tmp / OUT)


@case("flipped bytes in tensor data", "verify", table=True)
def _(b, tmp):
    ck = _copy(b, tmp, "single")  # TP1 x PP1: its forward passes (which still run) are one process each
    flip_tensor_bytes(ck / M(0, 0))
    return (["verify", ck, "--device", "cpu", "--batch", "1", "--seq-len", "16"],
            ["verify failed: tier 1", f"{M(0, 0)}: sha256 differs"], None)


@case("missing model shard", "verify", table=True)
def _(b, tmp):
    ck = _copy(b, tmp)
    (ck / M(0, 0)).unlink()
    return (["verify", ck, "--device", "cpu"], ["verify failed: tier 1", f"{M(0, 0)}: missing"], None)


@case("tensor of the wrong shape", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    resave(ck, M(0, 1), lambda o: o["model"].update({"decoder.layers.0.mlp.linear_fc2.weight": torch.zeros(64, 47)}))
    return (["merge", ck, tmp / OUT], [(f"{M(0, 1)}: decoder.layers.0.mlp.linear_fc2.weight has shape (64, 47), "
                                        f"the layout table says (64, 48)")], tmp / OUT)


@case("tensor of the wrong dtype", "reshard")
def _(b, tmp):
    ck = _copy(b, tmp)
    key = "decoder.layers.1.self_attention.linear_qkv.weight"
    resave(ck, M(1, 0), lambda o: o["model"].update({key: o["model"][key].to(torch.bfloat16)}))
    return (["reshard", ck, tmp / OUT, "--tp", "1", "--pp", "1"],
            [f"{M(1, 0)}: {key} is torch.bfloat16, meta.json says float32"], tmp / OUT)


@case("shard saved at another TP (shapes wrong)", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    shutil.copy(ckpt_of(b.tp1) / M(0, 0), ck / M(0, 0))
    reseal(ck)
    return (["merge", ck, tmp / OUT], [(f"{M(0, 0)}: embedding.word_embeddings.weight has shape (256, 64), "
                                        f"the layout table says (128, 64)")], tmp / OUT)


@case("inconsistent PP split across files", "reshard")
def _(b, tmp):
    ck = _copy(b, tmp)
    for t in (0, 1):  # stage 1 of a 1,3 split beside stage 0 of a 2,2 split
        shutil.copy(ckpt_of(b.uneven) / M(t, 1), ck / M(t, 1))
    reseal(ck)
    return (["reshard", ck, tmp / OUT, "--tp", "1", "--pp", "1"],
            [f"{M(0, 1)}: unexpected tensor decoder.layers.2.input_layernorm.weight"], tmp / OUT)


@case("meta.json's TP disagrees with the files", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    reseal(ck, lambda m: m["parallel"].update(tp_size=1))
    return (["merge", ck, tmp / OUT], [f"{M(1, 0)}: extra shard, not part of a TP1 x PP2 checkpoint"], tmp / OUT)


@case("unknown tensor key inside a shard", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    resave(ck, M(1, 1), lambda o: o["model"].update({"decoder.layers.0.mlp.router.weight": torch.zeros(4, 64)}))
    return (["merge", ck, tmp / OUT], [f"{M(1, 1)}: unexpected tensor decoder.layers.0.mlp.router.weight"], tmp / OUT)


@case("missing tensor key inside a shard", "reshard")
def _(b, tmp):
    ck = _copy(b, tmp)
    resave(ck, M(0, 1), lambda o: o["model"].pop("decoder.layers.1.pre_mlp_layernorm.weight"))
    return (["reshard", ck, tmp / OUT, "--tp", "2", "--pp", "1"],
            [f"{M(0, 1)}: missing tensor decoder.layers.1.pre_mlp_layernorm.weight", "TP rank 0, PP rank 1"],
            tmp / OUT)


@case("shard that is not a state dict", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    torch.save([1, 2, 3], ck / M(1, 0))
    reseal(ck)
    return (["merge", ck, tmp / OUT], [f"{M(1, 0)}: holds no 'model' state dict"], tmp / OUT)


@case("meta.json edited (checksum mismatch)", "inspect")
def _(b, tmp):
    ck = _copy(b, tmp)
    meta = read_meta(ck)
    meta["iteration"] = 7
    (ck / fmt.META).write_text(json.dumps(meta))
    return ["inspect", ck], [f"{fmt.META}: content does not match its checksum", "restore it"], None


@case("meta.json edited (checksum mismatch)", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    meta = read_meta(ck)
    meta["parallel"]["layers_per_stage"] = [1, 3]
    (ck / fmt.META).write_text(json.dumps(meta))
    return ["merge", ck.parent, tmp / OUT], [f"{fmt.META}: content does not match its checksum"], tmp / OUT


@case("meta.json not JSON", "reshard")
def _(b, tmp):
    ck = _copy(b, tmp)
    (ck / fmt.META).write_text('{"format": "ckpt-tools/1", "iteration": ')
    return (["reshard", ck, tmp / OUT, "--tp", "1", "--pp", "1"], [f"{fmt.META}: malformed meta.json (JSONDecodeError"],
            tmp / OUT)


@case("meta.json lacks fields", "inspect")
def _(b, tmp):
    ck = _copy(b, tmp)
    reseal(ck, lambda m: [m.pop(k) for k in ("parallel", "vocab")])
    return ["inspect", ck], [f"{fmt.META}: meta.json lacks parallel, vocab"], None


@case("meta.json missing (checkpoint dir)", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    (ck / fmt.META).unlink()
    return ["merge", ck, tmp / OUT], [f"{ck}: neither a checkpoint dir (no meta.json)", M(0, 0)], tmp / OUT


@case("meta.json missing (save dir)", "reshard")
def _(b, tmp):
    ck = _copy(b, tmp)
    (ck / fmt.META).unlink()
    return (["reshard", ck.parent, tmp / OUT, "--tp", "1", "--pp", "1"],
            [f"latest names '{ck.name}' but {ck / fmt.META} does not exist"], tmp / OUT)


@case("unsupported architecture in meta.json", "inspect")
def _(b, tmp):
    ck = _copy(b, tmp)
    reseal(ck, lambda m: m["model"].update(architecture="mamba"))
    return ["inspect", ck], [f"{fmt.META}: unknown architecture 'mamba': expected one of llama, gpt2"], None


@case("unsupported architecture in meta.json", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    reseal(ck, lambda m: m["model"].update(architecture="bert"))
    return ["merge", ck, tmp / OUT], [f"{fmt.META}: unknown architecture 'bert'"], tmp / OUT


@case("`latest` names a missing dir", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    (ck.parent / fmt.LATEST).write_text("checkpoint-999\n")
    return (["merge", ck.parent, tmp / OUT], ["latest names 'checkpoint-999' but", "checkpoint-999/meta.json does not exist"],
            tmp / OUT)


@case("--vocab-size disagrees with meta.json", "merge")
def _(b, tmp):
    return (["merge", b.base, tmp / OUT, "--vocab-size", "300"],
            ["records a true vocab of 250, --vocab-size says 300", "drop --vocab-size"], tmp / OUT)


@case("--from-master-weights without optimizer shards", "merge")
def _(b, tmp):
    ck = _copy(b, tmp)
    for t in (0, 1):
        for p in (0, 1):
            (ck / O(t, p)).unlink()
    reseal(ck, lambda m: m.update(files={n: r for n, r in m["files"].items() if not n.startswith("optimizer_")}))
    return (["merge", ck, tmp / OUT, "--from-master-weights"], [f"{ck}: no optimizer shards with fp32 master weights",
                                                                "merge without --from-master-weights"], tmp / OUT)


@case("target TP does not divide the query groups", "reshard")
def _(b, tmp):
    return (["reshard", b.base, tmp / OUT, "--tp", "4", "--pp", "1"],
            ["num_query_groups 2 is not divisible by TP 4", "choose a TP size"], tmp / OUT)


@case("target TP 0", "reshard")
def _(b, tmp):
    return ["reshard", b.base, tmp / OUT, "--tp", "0", "--pp", "1"], ["TP 0 is not a positive number"], tmp / OUT


@case("target PP larger than the layers", "reshard")
def _(b, tmp):
    return (["reshard", b.base, tmp / OUT, "--tp", "1", "--pp", "8"],
            ["PP 8 needs at least one layer per stage but the model has 4 layers", "choose PP <= 4"], tmp / OUT)


@case("bad --layers-per-stage", "reshard")
def _(b, tmp):
    return (["reshard", b.base, tmp / OUT, "--tp", "2", "--pp", "2", "--layers-per-stage", "1,2"],
            ["layers per stage 1,2 do not fit 4 layers on 2 stages", "give 2 positive numbers that sum to 4"], tmp / OUT)


@case("import target TP does not divide the heads", "import")
def _(b, tmp):
    return (["import", b.hf, tmp / OUT, "--tp", "3"], ["num_attention_heads 4 is not divisible by TP 3"], tmp / OUT)


def _hf_copy(b: Bases, tmp: Path, change: Callable[[dict], None] | None = None) -> Path:
    hf = tmp / "hf"
    shutil.copytree(b.hf, hf)
    if change is not None:
        config = json.loads((hf / "config.json").read_text())
        change(config)
        (hf / "config.json").write_text(json.dumps(config))
    return hf


@case("HF dir without config.json", "import")
def _(b, tmp):
    hf = _hf_copy(b, tmp)
    (hf / "config.json").unlink()
    return ["import", hf, tmp / OUT], [f"{hf / 'config.json'}: unreadable config.json", "No such file"], tmp / OUT


@case("unsupported model_type", "import")
def _(b, tmp):
    hf = _hf_copy(b, tmp, lambda c: c.update(model_type="mistral"))
    return (["import", hf, tmp / OUT], [f"{hf / 'config.json'}: model_type 'mistral'", "only plain Llama and GPT-2"],
            tmp / OUT)


@case("weights do not match config.json (shapes)", "import")
def _(b, tmp):
    hf = _hf_copy(b, tmp, lambda c: c.update(intermediate_size=128))
    return (["import", hf, tmp / OUT, "--tp", "2", "--pp", "2"],
            [f"{hf}: tensor shapes do not match a llama model of this config.json",
             "model.layers.0.mlp.gate_proj.weight [96, 64], expected [128, 64]"], tmp / OUT)


@case("weights do not match config.json (layers)", "import")
def _(b, tmp):
    hf = _hf_copy(b, tmp, lambda c: c.update(num_hidden_layers=5))
    return (["import", hf, tmp / OUT], [f"{hf}: tensors do not match", "missing model.layers.4.input_layernorm.weight"],
            tmp / OUT)


@case("config.json lacks a field", "import")
def _(b, tmp):
    hf = _hf_copy(b, tmp, lambda c: c.pop("hidden_size"))
    return ["import", hf, tmp / OUT], [f"{hf / 'config.json'}: lacks 'hidden_size'"], tmp / OUT


@case("truncated safetensors", "import")
def _(b, tmp):
    hf = _hf_copy(b, tmp)
    truncate(hf / "model.safetensors")
    return (["import", hf, tmp / OUT], [f"{hf / 'model.safetensors'}: not a readable safetensors file"], tmp / OUT)


@case("OTHER lacks a tensor", "verify", table=True)
def _(b, tmp):
    hf = tmp / "hf"
    shutil.copytree(b.single_hf, hf)
    tensors = load_safetensors(hf / "model.safetensors")
    del tensors["model.layers.2.mlp.down_proj.weight"]
    save_safetensors(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    return (["verify", b.single, hf, "--device", "cpu", "--batch", "1", "--seq-len", "16"],
            [f"verify failed: tier 1 weights: {hf}: 1 missing (model.layers.2.mlp.down_proj.weight) tensor(s)",
             "merge or reshard SRC again"], None)


@case("OTHER does not exist", "verify")
def _(b, tmp):
    return (["verify", b.base, tmp / "nope", "--device", "cpu"], [f"{tmp / 'nope'}: no such file or directory"], None)


@case("not a checkpoint dir", "inspect")
def _(b, tmp):
    (tmp / "junk").mkdir()
    (tmp / "junk" / "notes.txt").write_text("hello")
    return (["inspect", tmp / "junk"], [f"{tmp / 'junk'}: neither a checkpoint dir (no meta.json) nor a save dir",
                                        "notes.txt"], None)


@case("wrong tensor shape", "inspect --tensors")
def _(b, tmp):
    ck = _copy(b, tmp)
    resave(ck, M(1, 1), lambda o: o["model"].update({"output_layer.weight": torch.zeros(256, 64)}))
    return (["inspect", ck, "--tensors"],
            [f"{M(1, 1)}: output_layer.weight has shape (256, 64), the layout table says (128, 64)"], None)


def _megatron(b: Bases, tmp: Path, vocab_recorded: bool = True) -> Path:
    from megatron_lm_writer import write_megatron_lm
    return write_megatron_lm(ckpt_of(b.base), tmp / "megatron", vocab_recorded=vocab_recorded)


@case("Megatron-LM dir missing an mp_rank dir", "merge")
def _(b, tmp):
    mlm = _megatron(b, tmp)
    shutil.rmtree(mlm / "iter_0000100" / "mp_rank_01_000")
    return (["merge", mlm, tmp / OUT], ["mp_rank_01_000/model_optim_rng.pt: missing (1 of 4 rank files missing)",
                                        "TP2 x PP2 (from args) expects mp_rank_00_000..mp_rank_01_001"], tmp / OUT)


@case("Megatron-LM dir without --vocab-size", "merge")
def _(b, tmp):
    mlm = _megatron(b, tmp, vocab_recorded=False)
    return (["merge", mlm, tmp / OUT], [("mp_rank_00_000/model_optim_rng.pt: the checkpoint does not record its true "
                                         "vocab size (only padded_vocab_size 256): pass --vocab-size")], tmp / OUT)


@case("Megatron-LM tracker naming a missing iteration", "reshard")
def _(b, tmp):
    mlm = _megatron(b, tmp)
    (mlm / "latest_checkpointed_iteration.txt").write_text("200")
    return (["reshard", mlm, tmp / OUT, "--tp", "1", "--pp", "1"],
            ["latest_checkpointed_iteration.txt names '200' but", "iter_0000200 does not exist (found: iter_0000100)"],
            tmp / OUT)


@pytest.mark.parametrize("build,table", CASES)
def test_bad_input(build, table, bases, tmp_path):
    args, expected, out = build(bases, tmp_path)
    line = error_line(invoke(*args), table=table)
    for text in expected:
        assert text in line, f"{text!r} not in {line!r}"
    if out is not None:
        assert_no_out(out)


def test_table_covers_enough_kinds():
    kinds = {p.id.split(":", 1)[1] for p in CASES}
    verbs = {p.id.split(":", 1)[0].split()[0] for p in CASES}
    assert len(kinds) >= 20, sorted(kinds)
    assert verbs >= {"merge", "reshard", "import", "verify", "inspect"}, verbs


@pytest.mark.parametrize("verb", ["merge", "reshard"])
def test_existing_out_is_never_touched_without_force(verb, bases, tmp_path):
    out = tmp_path / OUT
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    before = tree(out)
    args = ["merge", bases.base, out] if verb == "merge" else ["reshard", bases.base, out, "--tp", "1", "--pp", "1"]
    line = error_line(invoke(*args))
    assert f"{out}: already exists" in line and "--force" in line
    assert tree(out) == before
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(f".{OUT}.")]


def test_debug_shows_the_traceback(bases, tmp_path):
    ck = copy_save(bases.base, tmp_path / "src")
    (ck / M(1, 1)).unlink()
    result = invoke("--debug", "merge", ck, tmp_path / OUT)
    assert result.exit_code == 1 and result.exception is not None and not isinstance(result.exception, SystemExit)
    assert "missing shard" in str(result.exception)
    assert_no_out(tmp_path / OUT)


# ---------------------------------------------------------------- malicious pickles
@pytest.fixture(params=["os.system", "builtins.open"])
def malicious(request, bases, tmp_path):
    """A copy of the base checkpoint whose pytorch_model_tp_1_pp_0.bin would create MARKER when unpickled."""
    marker = tmp_path / "MARKER"
    ck = copy_save(bases.base, tmp_path / "src")
    payload = SystemCall(f"touch {marker}") if request.param == "os.system" else OpenFile(str(marker))
    plant_malicious(ck, M(1, 0), payload)
    assert fmt.check_files(fmt.Meta.read(ck)) == []  # sizes and hashes agree: only the allow-list is left
    return ck, marker, request.param


def _refused(line: str, ck: Path, global_name: str) -> None:
    assert f"{ck / M(1, 0)}: refused to load" in line and "allow-list" in line and "--trust-pickle" in line, line
    assert global_name.split(".")[-1] in line, line


@pytest.mark.parametrize("args,table", [
    (["merge", "{ck}", "{out}"], False),
    (["merge", "{ck}", "{out}", "--format", "safetensors", "--check-hashes"], False),
    (["reshard", "{ck}", "{out}", "--tp", "1", "--pp", "1"], False),
    (["verify", "{ck}", "--device", "cpu"], True),
    (["inspect", "{ck}", "--tensors"], False),
], ids=["merge", "merge-safetensors", "reshard", "verify", "inspect-tensors"])
def test_malicious_pickle_is_refused(args, table, malicious, tmp_path):
    ck, marker, global_name = malicious
    out = tmp_path / OUT
    line = error_line(invoke(*[a.format(ck=ck, out=out) for a in args]), table=table)
    _refused(line, ck, global_name)
    assert not marker.exists(), "the pickle ran code"
    assert_no_out(out)


def test_malicious_optimizer_shard_is_refused_by_reshard(bases, tmp_path):
    marker = tmp_path / "MARKER"
    ck = copy_save(bases.base, tmp_path / "src")
    plant_malicious(ck, O(1, 1), OpenFile(str(marker)))
    line = error_line(invoke("reshard", ck, tmp_path / OUT, "--tp", "1", "--pp", "1"))
    assert f"{ck / O(1, 1)}: refused to load" in line and "--trust-pickle" in line
    assert not marker.exists()
    assert_no_out(tmp_path / OUT)


# ---------------------------------------------------------------- trainer resume (torchrun, as `ckpt train` runs it)
TRAINER_SPEC = llama(vocab_size=1000, norm_epsilon=1e-5, rotary_base=10000.0)  # = fixtures/configs/tiny_llama.yaml


@pytest.fixture(scope="session")
def trainer_base(tmp_path_factory) -> Path:
    """tiny_llama's model at TP1 x PP1 (the trainer's tokenizer has 1000 tokens): a save dir to resume from."""
    save = tmp_path_factory.mktemp("bad-input-trainer") / "base"
    make_ckpt(save, TRAINER_SPEC, tp=1, pp=1)
    return save


def resume(load: Path, tmp: Path) -> subprocess.CompletedProcess:
    """The command `ckpt train --config tiny_llama.yaml --tp 1 --pp 1 --set load=...` launches (torchrun,
    one rank), with train_iters = the checkpoint's iteration: it resumes and stops."""
    from trainer.launch import launch_command
    sets = [f"load={load}", f"save_dir={tmp / 'save'}", f"data_cache_dir={tmp.parent / 'data-cache'}",
            "tp_degree=1", "pp_degree=1", "num_micro_batches=1", f"train_iters={ITERATION}"]
    cmd = launch_command(str(CONFIGS / "tiny_llama.yaml"), sets, dp=1)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT, check=False)


def trainer_error(proc: subprocess.CompletedProcess) -> str:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("error (rank")]
    assert errors, output
    return errors[0]


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["malicious", "truncated", "wrong shape"])
def test_trainer_resume_refuses(damage, trainer_base, tmp_path):
    ck = copy_save(trainer_base, tmp_path / "src")
    marker = tmp_path / "MARKER"
    if damage == "malicious":
        plant_malicious(ck, M(0, 0), SystemCall(f"touch {marker}"))
        expected = [f"{ck / M(0, 0)}: refused to load", "allow-list", "--trust-pickle"]
    elif damage == "truncated":
        truncate(ck / M(0, 0))
        recorded = read_meta(ck)["files"][M(0, 0)]["size"]
        expected = [f"{ck / M(0, 0)}: {recorded // 2} bytes, meta.json records {recorded}"]
    else:
        resave(ck, O(0, 0), lambda o: o["optimizer"]["decoder.layers.1.mlp.linear_fc2.weight"].update(
            master=torch.zeros(64, 95)))
        expected = [(f"{ck / O(0, 0)}: decoder.layers.1.mlp.linear_fc2.weight state has shape (64, 95), "
                     f"expected (64, 96)")]
    line = trainer_error(resume(ck.parent, tmp_path))
    for text in expected:
        assert text in line, line
    assert not marker.exists()
    assert not (tmp_path / "save" / "latest").exists()
