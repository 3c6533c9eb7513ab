"""`ckpt merge`'s two sources: the byte ranges read without torch (ckpt_tools.forms.byte_ranges) against the torch
reader they stand in for.

On every checkpoint the byte source takes, the output directory is byte-identical (every file) to the one
read through the torch reader, also where a dtype is converted, hashes are checked or a .bin is written; run
as `ckpt merge` it never imports torch where nothing is converted; on input it does not accept it declines
before anything is written, so the torch reader's one-line errors (and exit codes) stay exactly what they were.

The checkpoints are made here without training, as the trainer writes them: full_init tensors split by the
layout table, saved with io.save_file (torch.save), meta.json through build_meta and commit. Padding rows
of vocab tensors hold values (not zeros), so a merge that keeps or shifts them shows; dim-0 shards are
saved as views of the full tensor, so their bytes sit at a storage offset inside a larger record.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import bad_inputs as bad
import pytest
import torch

from ckpt_tools import durable, io
from ckpt_tools.cli import main
from ckpt_tools.errors import FormatError
from ckpt_tools.forms import byte_ranges
from ckpt_tools.forms import checkpoint as fmt
from ckpt_tools.forms import torchfile
from ckpt_tools.forms.byte_index import Declined
from ckpt_tools.forms.byte_ranges import ByteSource
from ckpt_tools.model import conversions, families, hf, layout, shard_ops
from ckpt_tools.model.ranks import Rank
from ckpt_tools.model.spec import ModelSpec
from ckpt_tools.verbs.merge import BYTES, TENSORS, TORCH_PATH, merge
from trainer.model import full_init

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "fixtures" / "tokenizer"
ITERATION = 12
LLAMA = ModelSpec("llama", num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=96, vocab_size=1000, max_position_embeddings=128)  # GQA; 1000 rows padded
GPT2 = ModelSpec("gpt2", num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, vocab_size=1000,
                 max_position_embeddings=128, tie_word_embeddings=True)
LAYOUTS = [(1, 1), (1, 2), (2, 1), (2, 2)]


def full_tensor(key: str, spec: ModelSpec, padded: int) -> torch.Tensor:
    """The trainer's init, with values in the vocab padding rows (different ones in a tied output copy)."""
    full = full_init(key, spec, padded, seed=5)
    if layout.find_rule(key, spec, 2).split == layout.VOCAB:
        g = torch.Generator().manual_seed(len(key))
        full[spec.vocab_size:] = torch.randn(full[spec.vocab_size:].shape, generator=g)
    return full


def make_checkpoint(save_dir: Path, spec: ModelSpec, tp: int, pp: int, dtype: str = "bfloat16") -> Path:
    """A save dir in our format (model + optimizer shards, tokenizer, meta.json, latest); the checkpoint dir."""
    padded, counts = spec.padded_vocab_size(tp), layout.layers_per_stage(spec.num_layers, pp)
    tmp = save_dir / fmt.temp_name(ITERATION)
    tmp.mkdir(parents=True)
    for p in range(pp):
        model: list[dict] = [{} for _ in range(tp)]
        optim: list[dict] = [{} for _ in range(tp)]
        for local, key in layout.stage_keys(spec, counts, p):
            if layout.find_rule(key, spec, pp).split == layout.EXTRA:
                for t in range(tp):
                    model[t][local] = None
                continue
            master = full_tensor(key, spec, padded)
            params = shard_ops.split(key, master.to(getattr(torch, dtype)), spec, tp, pp)
            masters = shard_ops.split(key, master, spec, tp, pp)
            for t in range(tp):  # .contiguous(): a dim-0 shard stays a view (at an offset of the full storage)
                model[t][local] = params[t].contiguous()
                optim[t][local] = {"master": masters[t].contiguous(), "exp_avg": torch.zeros(masters[t].shape),
                                   "exp_avg_sq": torch.zeros(masters[t].shape), "step": torch.tensor(float(ITERATION))}
        for t in range(tp):
            io.save_file({"model": model[t]}, tmp / fmt.model_file(Rank(t, p)))
            io.save_file({"optimizer": optim[t], "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95)}],
                          "scheduler": {"iteration": ITERATION, "lr": 1e-3}, "scaler": None},
                         tmp / fmt.optimizer_file(Rank(t, p)))
    for f in hf.tokenizer_files(TOKENIZER):
        shutil.copyfile(f, tmp / f.name)
    files = {f.name: fmt.file_record(f) for f in sorted(tmp.iterdir())}
    meta = fmt.build_meta(spec, tp, counts, padded, ITERATION, 0, dtype, 1, {"seq_length": 64}, files)
    return fmt.commit(save_dir, ITERATION, meta)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """(architecture, tied, tp, pp, dtype) -> checkpoint dir, made on first use."""
    root, made = tmp_path_factory.mktemp("fast-merge"), {}

    def get(arch: str, tied: bool, tp: int, pp: int, dtype: str = "bfloat16") -> Path:
        if (arch, tied, tp, pp, dtype) not in made:
            spec = GPT2 if arch == "gpt2" else ModelSpec(**{**LLAMA.to_dict(), "tie_word_embeddings": tied})
            made[arch, tied, tp, pp, dtype] = make_checkpoint(root / f"{arch}-{tied}-{tp}-{pp}-{dtype}", spec, tp, pp,
                                                              dtype)
        return made[arch, tied, tp, pp, dtype]
    return get


def without_time(summary: str) -> str:
    return summary.rsplit(",", 1)[0]


def assert_same_as_torch(src: Path, tmp: Path, **options) -> dict[str, bytes]:
    """The byte source takes it (Declined otherwise), and its output equals the torch reader's, file by file."""
    fast, slow = tmp / "fast" / "merged", tmp / "torch" / "merged"  # one name: a .bin archive records its stem
    fast.parent.mkdir(parents=True)
    slow.parent.mkdir()
    if options.get("fmt") in ("safetensors", "torch"):
        suffix = ".safetensors" if options["fmt"] == "safetensors" else ".bin"
        fast, slow = fast.with_suffix(suffix), slow.with_suffix(suffix)
    summary = merge(src, fast, via=BYTES, quiet=True, **options)
    expected = merge(src, slow, via=TENSORS, quiet=True, **options)
    assert without_time(summary.replace(str(fast), str(slow))) == without_time(expected)
    ours, theirs = bad.tree(fast), bad.tree(slow)
    assert ours.keys() == theirs.keys()
    assert [n for n in ours if ours[n] != theirs[n]] == []
    return ours


# ---------------------------------------------------------------- byte-identical output
@pytest.mark.parametrize("out_format", ["hf", "safetensors"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{t}pp{p}" for t, p in LAYOUTS])
def test_llama_output_is_byte_identical(checkpoints, tmp_path, tp, pp, tied, out_format):
    files = assert_same_as_torch(checkpoints("llama", tied, tp, pp), tmp_path, fmt=out_format)
    if out_format == "hf":
        assert {"config.json", "generation_config.json", "tokenizer.json", "model.safetensors"} <= set(files)
        assert json.loads(files["config.json"])["dtype"] == "bfloat16"


@pytest.mark.parametrize("from_master", [False, True], ids=["weights", "masters"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_several_files_and_master_weights(checkpoints, tmp_path, monkeypatch, tied, from_master):
    """The byte path writes two files at once (durable.each_file's threads), the torch reader one at a time: the
    same files."""
    at_once = []
    each_file = durable.each_file
    monkeypatch.setattr(durable, "each_file", lambda calls, write, n: (at_once.append(n), each_file(calls, write, n)))
    files = assert_same_as_torch(checkpoints("llama", tied, 2, 2), tmp_path, max_shard_size=100_000,
                                 from_master=from_master)
    assert at_once == [2, 1]
    index = json.loads(files["model.safetensors.index.json"])
    assert len(set(index["weight_map"].values())) > 3
    assert json.loads(files["config.json"])["dtype"] == ("float32" if from_master else "bfloat16")


@pytest.mark.parametrize("out_format", ["hf", "safetensors"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)], ids=["tp1pp1", "tp2pp2"])
def test_gpt2_transposed_weights_are_byte_identical(checkpoints, tmp_path, tp, pp, out_format):
    assert_same_as_torch(checkpoints("gpt2", True, tp, pp), tmp_path, fmt=out_format)


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 1)], ids=["tp1pp2", "tp2pp1"])
def test_resharded_checkpoint_is_byte_identical(checkpoints, tmp_path, tp, pp):
    """Files of the toolkit's own TorchFileWriter (as reshard writes them: no CRCs, data filled in place)."""
    from ckpt_tools.verbs.reshard import reshard
    reshard(checkpoints("llama", True, 2, 2), tmp_path / "re", tp, pp, quiet=True)
    assert_same_as_torch(tmp_path / "re", tmp_path, from_master=True, max_shard_size=200_000)
    assert_same_as_torch(tmp_path / "re", tmp_path / "st", fmt="safetensors")


def test_fp32_checkpoint_and_explicit_dtype(checkpoints, tmp_path):
    src = checkpoints("llama", False, 2, 1, "float32")
    assert_same_as_torch(src, tmp_path / "a", dtype="fp32", from_master=True)
    assert_same_as_torch(src, tmp_path / "b", fmt="safetensors", dtype="fp32")


@pytest.mark.parametrize("options", [{"dtype": "fp32"}, {"dtype": "fp16", "fmt": "safetensors"},
                                     {"from_master": True, "dtype": "bf16"}, {"check_hashes": True},
                                     {"fmt": "hf-bin", "max_shard_size": 200_000}, {"fmt": "torch", "dtype": "fp32"},
                                     {"dtype": "fp32", "max_shard_size": 200_000}],
                         ids=["to-fp32", "to-fp16", "masters-to-bf16", "hashes", "hf-bin", "torch-bin-fp32",
                              "to-fp32-files"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_conversions_hashes_and_bin_files_are_steps_on_the_byte_path(checkpoints, tmp_path, arch, options):
    """A dtype conversion is the last step after the bytes are joined (GPT-2: and transposed); .bin archives take
    file ranges filled in the kernel; --check-hashes runs before. Every file as the torch reader writes it."""
    files = assert_same_as_torch(checkpoints(arch, True, 2, 2), tmp_path, **options)
    if "dtype" in options and options.get("fmt") in (None, "hf"):
        assert json.loads(files["config.json"])["dtype"] == {"fp32": "float32", "bf16": "bfloat16"}[options["dtype"]]


def test_check_hashes_is_a_step_before_the_byte_copy(checkpoints, tmp_path):
    """A file changed after saving, at its recorded size and still well-formed: the byte source takes the files,
    the hash step refuses them (the torch reader's words), nothing is written."""
    ck = shutil.copytree(checkpoints("llama", False, 2, 2), tmp_path / "src")
    path = ck / fmt.model_file(Rank(1, 0))
    info = torchfile.read(path)["model"]["decoder.layers.1.mlp.linear_fc1.weight"]
    with open(path, "r+b") as f:  # flip one byte of a tensor: the pickle and sizes stay as they were
        f.seek(info.offset)
        byte = f.read(1)
        f.seek(info.offset)
        f.write(bytes([byte[0] ^ 0x40]))
    ByteSource.open(ck, None, False).close()
    errors = []
    for via in (BYTES, TENSORS):
        with pytest.raises(FormatError, match="xxh3_128 differs from meta.json") as e:
            merge(ck, tmp_path / f"out-{via}", via=via, quiet=True, check_hashes=True)
        errors.append(str(e.value))
    assert errors[0] == errors[1]
    assert not [p for p in tmp_path.iterdir() if p.name != "src"]


# ---------------------------------------------------------------- where it does not apply
def test_a_vocab_size_other_than_recorded_is_declined(checkpoints, tmp_path):
    src = checkpoints("llama", False, 2, 2)
    with pytest.raises(Declined):
        merge(src, tmp_path / "out", via=BYTES, vocab_size=999, quiet=True)
    assert not list(tmp_path.iterdir())


def test_megatron_lm_dir_takes_the_fast_path_with_the_torch_paths_bytes(tmp_path):
    """A legacy Megatron-LM dir (its files hold an args Namespace and RNG states) is merged torch-free; with
    --from-master-weights it is left to torch, which reads the Megatron-LM optimizer state."""
    from megatron_lm_writer import write_megatron_lm
    ck = bad.make_ckpt(tmp_path / "ours", ModelSpec(**{**LLAMA.to_dict(), "vocab_size": 250}))
    mlm = write_megatron_lm(ck, tmp_path / "mlm")
    assert_same_as_torch(mlm, tmp_path, vocab_size=250)
    with pytest.raises(Declined, match="no optimizer state"):
        ByteSource.open(mlm, 250, True)


def test_a_tied_copy_that_differs_is_left_to_torch(checkpoints, tmp_path):
    """The torch reader merges it with a note; the byte source must not write it silently without one."""
    ck = shutil.copytree(checkpoints("llama", True, 2, 2), tmp_path / "src")
    last = fmt.model_file(Rank(1, 1))
    bad.resave(ck, last, lambda o: o["model"]["output_layer.weight"].__setitem__((3, 5), 1.0))
    with pytest.raises(Declined, match="differs"):
        ByteSource.open(ck, None, False)
    summary = merge(ck, tmp_path / "hf", quiet=True)
    assert "note: the last stage's copy of the tied embedding differs" in summary


def test_strided_shards_are_left_to_torch(checkpoints, tmp_path):
    """A tensor saved as a non-contiguous view: the reader refuses it, and merge still works (through torch)."""
    ck = shutil.copytree(checkpoints("llama", False, 2, 2), tmp_path / "src")
    key = "decoder.layers.0.mlp.linear_fc2.weight"
    bad.resave(ck, fmt.model_file(Rank(0, 0)), lambda o: o["model"].update({key: o["model"][key].t().contiguous().t()}))
    with pytest.raises(torchfile.Unreadable, match="not a contiguous"):
        torchfile.read(ck / fmt.model_file(Rank(0, 0)))
    with pytest.raises(Declined, match="not a contiguous"):
        ByteSource.open(ck, None, False)
    merge(ck, tmp_path / "hf", quiet=True)
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_reader_never_runs_a_pickle(tmp_path):
    marker = tmp_path / "MARKER"
    ck = bad.make_ckpt(tmp_path / "ck", ModelSpec(**{**LLAMA.to_dict(), "vocab_size": 250}))
    bad.plant_malicious(ck, fmt.model_file(Rank(1, 0)), bad.SystemCall(f"touch {marker}"))
    with pytest.raises(torchfile.Unreadable, match="global posix.system"):
        torchfile.read(ck / fmt.model_file(Rank(1, 0)))
    assert not marker.exists()


# ---------------------------------------------------------------- damaged input: the same one-line errors
def _wrong_shape(ck: Path) -> None:
    key = "decoder.layers.0.mlp.linear_fc2.weight"
    bad.resave(ck, fmt.model_file(Rank(0, 1)), lambda o: o["model"].update({key: torch.zeros(64, 47)}))


def _missing_key(ck: Path) -> None:
    bad.resave(ck, fmt.model_file(Rank(0, 1)), lambda o: o["model"].pop("decoder.layers.1.pre_mlp_layernorm.weight"))


def _extra_key(ck: Path) -> None:
    key = "decoder.layers.0.mlp.router.weight"
    bad.resave(ck, fmt.model_file(Rank(1, 1)), lambda o: o["model"].update({key: torch.zeros(4)}))


def _truncated(ck: Path) -> None:
    bad.truncate(ck / fmt.model_file(Rank(1, 0)))


def _truncated_unrecorded(ck: Path) -> None:
    bad.truncate(ck / fmt.model_file(Rank(1, 1)), 0.7)
    bad.reseal(ck, lambda m: m.update(files={}))


def _replicas_differ(ck: Path) -> None:
    key = "decoder.layers.1.input_layernorm.weight"
    bad.resave(ck, fmt.model_file(Rank(1, 0)), lambda o: o["model"][key].__setitem__(0, 2.0))


def _wrong_dtype(ck: Path) -> None:
    key = "decoder.layers.1.self_attention.linear_qkv.weight"
    bad.resave(ck, fmt.model_file(Rank(1, 0)), lambda o: o["model"].update({key: o["model"][key].float()}))


def _missing_master(ck: Path) -> None:
    key = "decoder.layers.0.input_layernorm.weight"
    bad.resave(ck, fmt.optimizer_file(Rank(0, 0)), lambda o: o["optimizer"][key].pop("master"))


DAMAGE = [(_wrong_shape, []), (_missing_key, []), (_extra_key, []), (_truncated, []), (_truncated_unrecorded, []),
          (_replicas_differ, []), (_wrong_dtype, []), (_missing_master, ["--from-master-weights"])]


@pytest.mark.parametrize("damage,extra", DAMAGE, ids=[d.__name__.strip("_") for d, _ in DAMAGE])
def test_damaged_input_gets_the_torch_readers_error(checkpoints, tmp_path, damage, extra):
    ck = shutil.copytree(checkpoints("llama", False, 2, 2), tmp_path / "src")
    damage(ck)
    out = tmp_path / "OUT"
    with pytest.raises(Declined):
        ByteSource.open(ck, None, bool(extra))
    results = [bad.runner().invoke(main, ["merge", str(ck), str(out), "-q", *extra], env=env)
               for env in ({TORCH_PATH: "0"}, {TORCH_PATH: "1"})]
    assert results[0].exit_code == results[1].exit_code == 1
    assert results[0].output == results[1].output
    assert results[0].output.startswith("error: ") and len(results[0].output.splitlines()) == 1, results[0].output
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".OUT")]


# ---------------------------------------------------------------- no torch
def run_cli(*args: str, torch_path: bool = False) -> subprocess.CompletedProcess:
    """`python -X importtime -m ckpt_tools.cli ...`: stderr lists every module the command imported."""
    env = {**os.environ, TORCH_PATH: "1" if torch_path else "0"}
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "ckpt_tools.cli", *args], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120, check=False)


def imported(proc: subprocess.CompletedProcess) -> set[str]:
    return {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("args", [[], ["--format", "safetensors", "--from-master-weights", "--max-shard-size", "1MB"]],
                         ids=["hf", "safetensors-masters"])
def test_cli_merge_imports_no_torch(checkpoints, tmp_path, args):
    src = checkpoints("llama", True, 2, 2).parent  # a save dir: `latest` is followed
    fast = run_cli("merge", str(src), str(tmp_path / "fast"), "-q", *args)
    assert fast.returncode == 0, fast.stderr[-2000:]
    assert "ckpt_tools.forms.byte_ranges" in imported(fast)
    assert not {m for m in imported(fast) if m == "torch" or m.startswith("torch.")}
    slow = run_cli("merge", str(src), str(tmp_path / "torch"), "-q", *args, torch_path=True)
    assert slow.returncode == 0 and "torch" in imported(slow)  # the check above can fail
    assert bad.tree(tmp_path / "fast") == bad.tree(tmp_path / "torch")
    summary = fast.stdout.replace(str(tmp_path / "fast"), str(tmp_path / "torch"))
    assert without_time(summary) == without_time(slow.stdout)


def test_scatter_reads_fill_every_view_or_fail(tmp_path, monkeypatch):
    """More views than one preadv takes; reads that return less than asked; a file shorter than the views."""
    path = tmp_path / "data"
    path.write_bytes(bytes(range(256)) * 20)
    files = byte_ranges._Files()
    buf = memoryview(bytearray(3 * byte_ranges.IOV_MAX))
    files.read_into([buf[i:i + 1] for i in range(len(buf))], path, 7)
    assert bytes(buf) == path.read_bytes()[7:7 + len(buf)]
    preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, views, offset: preadv(fd, [views[0][:3]], offset))
    buf = memoryview(bytearray(12))
    files.read_into([buf[0:4], buf[4:5], buf[5:12]], path, 100)
    assert bytes(buf) == path.read_bytes()[100:112]
    with pytest.raises(OSError, match="ended at byte 5120"):
        files.read_into([buf[0:4], buf[4:8], buf[8:12]], path, 5120 - 10)
    assert bytes(buf[:10]) == path.read_bytes()[-10:]
    files.close()


# ---------------------------------------------------------------- the one place that knows the QKV grouping
def test_qkv_head_rows_by_hand():
    spec = ModelSpec("llama", num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                     ffn_hidden_size=32, vocab_size=10, kv_channels=16)  # per group: q0 q1 k v, 16 rows each
    q, k, v = shard_ops.qkv_head_rows(spec)
    assert q == [(0, 32), (64, 96)] and k == [(32, 48), (96, 112)] and v == [(48, 64), (112, 128)]
    full = torch.arange(128 * 3).reshape(128, 3)
    tq, tk, tv = shard_ops.qkv_split_heads(full, spec)
    assert torch.equal(tq, torch.cat([full[0:32], full[64:96]])) and torch.equal(tk[16:], full[96:112])
    assert torch.equal(shard_ops.qkv_join_heads(tq, tk, tv, spec), full)
    assert conversions.hf_shapes(families.QKV, spec, (128, 3)) == [(64, 3), (32, 3), (32, 3)]
    assert conversions.hf_shapes(families.C_ATTN, spec, (128, 64)) == [(64, 128)]
