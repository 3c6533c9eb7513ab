"""`ckpt reshard`: ckpt_tools/verbs/reshard.py (`ckpt import` is in test_import.py).

What is shown, each against a reference that the code under test did not make:
- round trips A -> B -> A are byte-identical to A, model and optimizer shards (and the intermediate
  layout equals a join of the source shards written here from DESIGN.md Contract 1, not the table);
- a resharded checkpoint resumes training on the straight run's loss curve (and would not without
  its optimizer state);
- invalid targets are refused with one line, before anything is written; a re-padded vocab keeps every
  real row and says so.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import train
from safetensors.torch import load_file as load_safetensors

from ckpt_tools.forms import checkpoint as fmt
from ckpt_tools import io
from ckpt_tools.cli import main
from ckpt_tools.model.shard_ops import same_bits
from ckpt_tools.verbs.merge import merge
from ckpt_tools.model.ranks import Rank
from ckpt_tools.verbs.reshard import reshard

RESUME_RTOL = 1e-6  # resharded resume vs the straight run, per iteration
DROPPED_OPTIMIZER_RTOL = 1e-4  # a resume without optimizer state must differ by more than this


def run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_line_error(result) -> str:
    assert result.exit_code == 1, result.output
    lines = [l for l in result.output.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def assert_nothing_written(out: Path) -> None:
    assert not out.exists(), sorted(p.name for p in out.iterdir()) if out.is_dir() else out
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")], \
        sorted(p.name for p in out.parent.iterdir())


# ---------------------------------------------------------------- comparing checkpoints
def assert_same_tree(a, b, where: str) -> None:
    """Loaded shard objects equal: dict keys in the same order, tensors bit for bit, other values ==."""
    if isinstance(a, dict):
        assert isinstance(b, dict), where
        assert list(a) == list(b), f"{where}: keys differ or are reordered:\n{list(a)}\n{list(b)}"
        for k in a:
            assert_same_tree(a[k], b[k], f"{where}[{k!r}]")
    elif torch.is_tensor(a):
        assert torch.is_tensor(b), where
        assert same_bits(a, b), f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)} not bit-identical"
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def shard_names(ckpt: Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir() if p.name.startswith(("pytorch_model_", "optimizer_")))


def assert_same_shards(src: Path, other: Path, tp: int, pp: int) -> None:
    """Every model and optimizer shard file of two checkpoints holds the same objects (rng files are
    deliberately the source's rank-0 state on every rank after a reshard: not compared)."""
    expected = sorted(f(Rank(t, p)) for f in (fmt.model_file, fmt.optimizer_file) for t in range(tp) for p in range(pp))
    assert shard_names(src) == expected
    assert shard_names(other) == expected
    for name in expected:
        assert_same_tree(io.load_file(src / name), io.load_file(other / name), name)


def meta(ckpt: Path) -> dict:
    return json.loads((ckpt / fmt.META).read_text())


# An independent join (DESIGN.md Contract 1, written out by name here, not read from ckpt_tools.model.layout).
_ROW = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_DIM0 = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias", "word_embeddings.weight",
         "output_layer.weight")


def reference_join(key: str, shards: list, gated: bool):
    if not torch.is_tensor(shards[0]):  # _extra_state
        return shards[0]
    if key.endswith(_ROW):
        return torch.cat(shards, dim=1)
    if key.endswith(_DIM0):  # grouped QKV: groups dealt to ranks in order, so a plain concatenation
        return torch.cat(shards, dim=0)
    if key.endswith(("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")):
        if not gated:
            return torch.cat(shards, dim=0)
        halves = [s.chunk(2, dim=0) for s in shards]  # rank r holds [gate_r; up_r]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    for s in shards[1:]:  # replicated: norms, positions, row-parallel biases
        assert same_bits(s, shards[0]), key
    return shards[0]


def global_key(local: str, offset: int) -> str:
    parts = local.split(".")
    if local.startswith("decoder.layers."):
        parts[2] = str(int(parts[2]) + offset)
    return ".".join(parts)


def full_tensors(ckpt: Path, optimizer: bool = True) -> dict[str, dict]:
    """{global key: {"model": full, "master"/"exp_avg"/"exp_avg_sq": full, "step": step}} via reference_join (without
    `optimizer`: the model's only)."""
    m = meta(ckpt)
    tp, counts = m["parallel"]["tp_size"], m["parallel"]["layers_per_stage"]
    gated = m["model"]["architecture"] == "llama"
    out: dict[str, dict] = {}
    for p in range(len(counts)):
        models = [io.load_file(ckpt / fmt.model_file(Rank(t, p)))["model"] for t in range(tp)]
        optims = [io.load_file(ckpt / fmt.optimizer_file(Rank(t, p)))["optimizer"] for t in range(tp)] if optimizer \
            else []
        for local in models[0]:
            key = global_key(local, sum(counts[:p]))
            entry = out[key] = {"model": reference_join(key, [s[local] for s in models], gated)}
            if torch.is_tensor(entry["model"]) and optimizer:
                for field in ("master", "exp_avg", "exp_avg_sq"):
                    entry[field] = reference_join(key, [s[local][field] for s in optims], gated)
                entry["step"] = optims[0][local]["step"]
    return out


# ---------------------------------------------------------------- 1. bit-exact round trips
@pytest.mark.slow
def test_llama_round_trip_through_tp1_pp4_is_bit_exact(llama_run, tmp_path):
    save, _ = llama_run
    source = save / "checkpoint-8"
    mid, back = tmp_path / "tp1pp4", tmp_path / "back"
    reshard(save, mid, tp=1, pp=4, quiet=True)
    reshard(mid, back, tp=2, pp=2, quiet=True)
    assert (mid / "latest").read_text().strip() == (back / "latest").read_text().strip() == "checkpoint-8"

    m = meta(mid / "checkpoint-8")
    assert m["parallel"]["tp_size"] == 1 and m["parallel"]["layers_per_stage"] == [1, 1, 1, 1]
    assert m["iteration"] == 8 and m["consumed_samples"] == meta(source)["consumed_samples"]
    # the intermediate layout is right on its own (a wrong split undone by the same wrong join would
    # still round-trip): its tensors are the source shards joined independently
    expected, found = full_tensors(source), full_tensors(mid / "checkpoint-8")
    assert list(found) == list(expected)
    for key, entry in expected.items():
        assert_same_tree(found[key], entry, key)

    assert_same_shards(source, back / "checkpoint-8", tp=2, pp=2)
    assert meta(back / "checkpoint-8")["parallel"]["layers_per_stage"] == [2, 2]


@pytest.mark.slow
def test_gpt2_through_tp4_pp1_merges_to_the_same_hf_model(gpt2_run, tmp_path):
    save, _ = gpt2_run
    reshard(save, tmp_path / "tp4pp1", tp=4, pp=1, quiet=True)
    assert meta(tmp_path / "tp4pp1" / "checkpoint-6")["parallel"]["tp_size"] == 4
    merge(save, tmp_path / "direct", quiet=True)
    merge(tmp_path / "tp4pp1", tmp_path / "via_tp4", quiet=True)
    direct = load_safetensors(tmp_path / "direct" / "model.safetensors")
    via = load_safetensors(tmp_path / "via_tp4" / "model.safetensors")
    assert sorted(via) == sorted(direct) and len(direct) == 2 + 4 * 12 + 2
    for name, t in direct.items():
        assert via[name].dtype == t.dtype and torch.equal(via[name], t), name


@pytest.mark.slow
def test_uneven_split_round_trip_is_bit_exact(llama_run, tmp_path):
    save, _ = llama_run
    uneven, back = tmp_path / "uneven", tmp_path / "back"
    result = run("reshard", save, uneven, "--tp", "1", "--pp", "2", "--layers-per-stage", "1,3", "-q")
    assert result.exit_code == 0, result.output
    m = meta(uneven / "checkpoint-8")
    assert m["parallel"]["layers_per_stage"] == [1, 3] and m["config"]["layers_per_stage"] == [1, 3]
    first = io.load_file(uneven / "checkpoint-8" / fmt.model_file(Rank(0, 0)))["model"]
    last = io.load_file(uneven / "checkpoint-8" / fmt.model_file(Rank(0, 1)))["model"]
    assert {k.split(".")[2] for k in first if k.startswith("decoder.layers.")} == {"0"}
    assert {k.split(".")[2] for k in last if k.startswith("decoder.layers.")} == {"0", "1", "2"}

    result = run("reshard", uneven, back, "--tp", "2", "--pp", "2", "-q")
    assert result.exit_code == 0, result.output
    assert meta(back / "checkpoint-8")["parallel"]["layers_per_stage"] == [2, 2]
    assert_same_shards(save / "checkpoint-8", back / "checkpoint-8", tp=2, pp=2)


# ---------------------------------------------------------------- 2. resume after reshard
@pytest.fixture(scope="module")
def llama_tp1pp2(llama_run, tmp_path_factory) -> Path:
    """llama_run's checkpoint-4 resharded to TP1 x PP2 (a save dir)."""
    out = tmp_path_factory.mktemp("resharded") / "tp1pp2"
    reshard(llama_run[0] / "checkpoint-4", out, tp=1, pp=2, quiet=True)
    return out


def resume_tp1pp2_dp2(load: Path, save: Path) -> list[dict]:
    """TP1 x PP2 x DP2 with 2 micro-batches: the same global batch of 8 as the TP2 x PP2 x DP1 run."""
    return train("tiny_llama.yaml", save, 4, load=str(load), tp_degree=1, pp_degree=2, num_micro_batches=2,
                 train_iters=8)


def relative_differences(a: list[dict], b: list[dict]) -> list[float]:
    return [abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(a, b)]


@pytest.mark.slow
def test_resume_after_reshard_to_tp1_pp2_dp2_follows_the_straight_run(llama_run, llama_tp1pp2, tmp_path):
    _, straight = llama_run
    resumed = resume_tp1pp2_dp2(llama_tp1pp2, tmp_path / "resumed")
    assert [m["iteration"] for m in resumed] == [5, 6, 7, 8]
    rel = relative_differences(resumed, straight[4:])
    print(f"\nresharded resume vs straight run, relative loss differences (iterations 5..8): {rel}")
    assert max(rel) <= RESUME_RTOL, (rel, resumed, straight[4:])
    m = meta(tmp_path / "resumed" / "checkpoint-8")
    assert m["parallel"] == {"tp_size": 1, "pp_size": 2, "dp_size": 2, "layers_per_stage": [2, 2]}
    assert m["consumed_samples"] == 8 * 8


@pytest.mark.slow
def test_resume_without_the_optimizer_state_would_be_caught(llama_run, llama_tp1pp2, tmp_path):
    """The same resume with the optimizer files removed leaves the straight run's curve: the test above
    can tell a reshard that drops optimizer state."""
    _, straight = llama_run
    dropped = tmp_path / "dropped"
    shutil.copytree(llama_tp1pp2, dropped)
    ckpt = dropped / "checkpoint-4"
    m = meta(ckpt)
    names = [n for n in m["files"] if n.startswith("optimizer_")]
    assert names == [fmt.optimizer_file(Rank(0, 0)), fmt.optimizer_file(Rank(0, 1))]
    for name in names:
        (ckpt / name).unlink()
        del m["files"][name]
    fmt.write_meta(ckpt / fmt.META, m)  # a deliberate edit: sealed again
    resumed = resume_tp1pp2_dp2(dropped, tmp_path / "resumed")
    assert [m["iteration"] for m in resumed] == [5, 6, 7, 8]
    rel = relative_differences(resumed, straight[4:])
    print(f"\nresume without optimizer state vs straight run, relative loss differences: {rel}")
    assert max(rel) > DROPPED_OPTIMIZER_RTOL, rel


# ---------------------------------------------------------------- 3. invalid targets
BAD_TARGETS = [
    (["--tp", "4", "--pp", "2"], ("num_query_groups 2", "TP 4")),
    (["--tp", "3", "--pp", "2"], ("num_attention_heads 4", "TP 3")),
    (["--tp", "1", "--pp", "5"], ("PP 5", "4 layers")),
    (["--tp", "1", "--pp", "2", "--layers-per-stage", "1,2"], ("1,2", "4 layers", "2 stages")),
    (["--tp", "1", "--pp", "2", "--layers-per-stage", "1,1,2"], ("1,1,2", "4 layers", "2 stages")),
]


@pytest.mark.slow
@pytest.mark.parametrize("args,expected", BAD_TARGETS)
def test_reshard_refuses_an_invalid_target_before_writing(args, expected, llama_run, tmp_path):
    out = tmp_path / "out"
    line = one_line_error(run("reshard", llama_run[0], out, *args, "-q"))
    for text in expected:
        assert text in line, line
    assert_nothing_written(out)


def test_padded_vocab_is_repadded_when_the_new_tp_does_not_divide_it(tmp_path):
    """Padded 1001 rows (divisible_by 1) at TP1 -> TP2 needs 1002: real rows kept, the new row zero, said so."""
    from test_megatron_lm import write_ours

    from ckpt_tools.model.spec import ModelSpec
    spec = ModelSpec(architecture="llama", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                     ffn_hidden_size=96, vocab_size=1001, make_vocab_size_divisible_by=1)
    src = write_ours(spec, tmp_path / "src" / "checkpoint-100", tp=1, pp=1)
    res = CliRunner().invoke(main, ["reshard", str(src), str(tmp_path / "tp2"), "--tp", "2", "--pp", "1", "-q"])
    assert res.exit_code == 0, res.output
    assert "padded vocab 1001 -> 1002" in res.output and "zeros" in res.output
    meta = json.loads((tmp_path / "tp2" / "checkpoint-100" / "meta.json").read_text())
    assert meta["vocab"]["padded"] == 1002
    before = io.load_file(src / "pytorch_model_tp_0_pp_0.bin")["model"]["embedding.word_embeddings.weight"]
    after = torch.cat([io.load_file(tmp_path / "tp2" / "checkpoint-100" / f"pytorch_model_tp_{t}_pp_0.bin")["model"]
                       ["embedding.word_embeddings.weight"] for t in range(2)])
    assert after.shape[0] == 1002 and torch.equal(after[:1001], before) and not after[1001:].any()
    merge(src, tmp_path / "a", quiet=True)
    merge(tmp_path / "tp2", tmp_path / "b", quiet=True)
    a, b = load_safetensors(tmp_path / "a" / "model.safetensors"), load_safetensors(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
