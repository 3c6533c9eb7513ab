"""Megatron-LM's forms as megatron-core itself writes them (tests/mcore_checkpoints.py): torch_dist (the default),
legacy torch with local-spec names and with Transformer Engine names. megatron-core's own forward is the
reference: every form merges to an HF model whose logits are megatron-core's, and to the same bytes.
"""
from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from bad_inputs import SystemCall, assert_no_out, error_line, invoke
from conftest import torchrun

from ckpt_tools.forms import dcp, readers
from ckpt_tools.forms import megatron_lm as mlm
from ckpt_tools.model.ranks import Rank

FORMS = ("torch_dist", "torch", "torch_te")
VOCAB = 250
MODELS = {  # llama: GQA, SwiGLU, RMSNorm, RoPE, untied; gpt2: LayerNorm, biases, learned positions, tied
    "llama": {"architecture": "llama", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
              "num_query_groups": 2, "ffn_hidden_size": 96, "vocab_size": VOCAB, "max_position_embeddings": 128,
              "norm_epsilon": 1e-6, "rotary_base": 500000.0},
    "gpt2": {"architecture": "gpt2", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
             "ffn_hidden_size": 96, "vocab_size": VOCAB, "max_position_embeddings": 128, "tie_word_embeddings": True,
             "activation": "gelu"},
}


@pytest.fixture(scope="session")
def mcore_checkpoints(tmp_path_factory):
    """arch -> a dir with megatron-core's GPTModel at TP2 x PP2, saved in every form, with its own logits
    (made on first use, once per session)."""
    made: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in made:
            out = tmp_path_factory.mktemp(f"mcore-{arch}")
            config = out / "config.json"
            config.write_text(json.dumps({"model": MODELS[arch], "tp": 2, "pp": 2, "iteration": 5}))
            torchrun(4, ["tests/mcore_checkpoints.py", str(config), str(out)], timeout=600)
            made[arch] = out
        return made[arch]
    return get


@pytest.fixture(scope="session", params=sorted(MODELS))
def mcore(request, mcore_checkpoints) -> Path:
    return mcore_checkpoints(request.param)


@pytest.fixture
def llama_dist(mcore_checkpoints, tmp_path) -> Path:
    """A copy of the llama torch_dist save dir, to damage."""
    return Path(shutil.copytree(mcore_checkpoints("llama") / "torch_dist", tmp_path / "src"))


@pytest.fixture(scope="session")
def merged(mcore, tmp_path_factory) -> dict[str, Path]:
    """Each form merged to an HF dir by `ckpt merge`."""
    out = {}
    for form in FORMS:
        hf = tmp_path_factory.mktemp(f"hf-{mcore.name}-{form}") / "hf"
        result = invoke("merge", mcore / form, hf, "--vocab-size", VOCAB, "--quiet")
        assert result.exit_code == 0, result.output
        out[form] = hf
    return out


def hf_logits(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("form", FORMS)
def test_merged_logits_are_megatron_cores(mcore, merged, form):
    tokens, reference = torch.load(mcore / "tokens.pt"), torch.load(mcore / "logits.pt")
    assert reference.shape[-1] == 256  # megatron-core's logits cover the padded vocab; HF's the true one
    assert rel_err(hf_logits(merged[form], tokens), reference[..., :VOCAB]) < 1e-5


def test_every_form_merges_to_the_same_bytes(merged):
    data = {form: (merged[form] / "model.safetensors").read_bytes() for form in FORMS}
    assert data["torch_dist"] == data["torch"] == data["torch_te"]


def test_forms_are_what_megatron_lm_writes(mcore):
    dist = mcore / "torch_dist" / "iter_0000005"
    assert json.loads((dist / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    keys = dcp.read_metadata(dist).tensors
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in keys  # TE names, stacked layers
    assert keys["decoder.layers.mlp.linear_fc1.weight"].shape[0] == 4
    te = torch.load(mlm.model_path(mcore / "torch_te" / "iter_0000005", Rank(0, 0), 2), weights_only=False)["model"]
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te
    assert readers.detect(dist) is readers.DCP and readers.detect(mcore / "torch" / "iter_0000005") is readers.LEGACY


def test_inspect_torch_dist(mcore):
    result = invoke("inspect", mcore / "torch_dist", "--vocab-size", VOCAB, "--tensors")
    assert result.exit_code == 0, result.output
    assert "TP 2 x PP 2" in result.output and "torch_dist checkpoint" in result.output
    assert "pp1 decoder.layers.3.mlp.linear_fc2.weight: 64x96, row" in result.output


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 4)])
def test_reshard_torch_dist_into_our_layout(mcore, merged, tmp_path, tp, pp):
    """torch_dist -> our shards at another layout -> merge: the same bytes as the direct merge."""
    out = tmp_path / "ours"
    result = invoke("reshard", mcore / "torch_dist", out, "--tp", tp, "--pp", pp, "--vocab-size", VOCAB, "--quiet")
    assert result.exit_code == 0, result.output
    again = tmp_path / "hf"
    assert invoke("merge", out, again, "--quiet").exit_code == 0
    assert (again / "model.safetensors").read_bytes() == (merged["torch_dist"] / "model.safetensors").read_bytes()


def test_verify_torch_dist_against_its_merge(mcore, merged):
    result = invoke("verify", mcore / "torch_dist", merged["torch_dist"], "--vocab-size", VOCAB, "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert re.search(r"(\d+) tensors compared: \1 bit-exact, 0 differ", result.output), result.output
    assert "verify passed" in result.output


# ---------------------------------------------------------------- damaged and hostile torch_dist dirs
def _rewrite_metadata(iter_dir: Path, change) -> None:
    """Edit .metadata with torch's own classes (the test may unpickle what it wrote itself)."""
    path = iter_dir / ".metadata"
    meta = pickle.loads(path.read_bytes())
    change(meta)
    path.write_bytes(pickle.dumps(meta))


def _drop_chunk(meta) -> None:
    entry = meta.state_dict_metadata["decoder.layers.self_attention.linear_qkv.weight"]
    entry.chunks.pop(3)


def _overlap_chunk(meta) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    entry = meta.state_dict_metadata["decoder.layers.mlp.linear_fc2.weight"]
    c = entry.chunks[1]
    entry.chunks[1] = ChunkStorageMetadata(offsets=entry.chunks[0].offsets, sizes=c.sizes)


def _extra_tensor(meta) -> None:
    meta.state_dict_metadata["decoder.layers.mlp.experts.router.weight"] = \
        meta.state_dict_metadata["decoder.final_layernorm.weight"]


def _truncate_distcp(iter_dir: Path) -> None:
    path = max(iter_dir.glob("*.distcp"), key=lambda p: p.stat().st_size)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damage,expected", [
    (lambda d: _rewrite_metadata(d, _drop_chunk), "decoder.layers.self_attention.linear_qkv.weight: chunks cover"),
    (lambda d: _rewrite_metadata(d, _overlap_chunk), "decoder.layers.mlp.linear_fc2.weight: chunks at"),
    (lambda d: _rewrite_metadata(d, _extra_tensor), "decoder.layers.mlp.experts.router.weight"),
    (_truncate_distcp, "the file is truncated"),
    (lambda d: (d / ".metadata").write_bytes(b"\x80\x04garbage"), ".metadata: unreadable"),
    (lambda d: (d / ".metadata").unlink(), ".metadata: missing"),
    (lambda d: (d / "common.pt").unlink(), "common.pt: missing"),
], ids=["missing-chunk", "overlapping-chunk", "unknown-tensor", "truncated-distcp", "corrupt-metadata",
        "no-metadata", "no-common"])
@pytest.mark.parametrize("verb", ["merge", "reshard"])
def test_damaged_torch_dist_is_refused(llama_dist, tmp_path, damage, expected, verb):
    src = llama_dist
    damage(src / "iter_0000005")
    out = tmp_path / "out"
    args = ["--tp", 1, "--pp", 1] if verb == "reshard" else []
    line = error_line(invoke(verb, src, out, "--vocab-size", VOCAB, *args))
    assert expected in line, line
    assert_no_out(out)


@pytest.mark.parametrize("victim", [".metadata", "common.pt"])
def test_malicious_torch_dist_pickle_never_runs(llama_dist, tmp_path, victim):
    src = llama_dist
    marker = tmp_path / "MARKER"
    path = src / "iter_0000005" / victim
    if victim == "common.pt":
        torch.save({"args": SystemCall(f"touch {marker}")}, path)
    else:
        path.write_bytes(pickle.dumps(SystemCall(f"touch {marker}")))
    for verb in (["merge", src, tmp_path / "out"], ["inspect", src]):
        line = error_line(invoke(*verb, "--vocab-size", VOCAB))
        assert str(path) in line and "refused" in line, line
        assert not marker.exists()


# ---------------------------------------------------------------- the torch-free merge path
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("fmt", ["hf", "safetensors"])
def test_torch_free_merge_of_every_form_equals_the_torch_path(mcore, tmp_path, form, fmt):
    from test_merge_sources import assert_same_as_torch
    assert_same_as_torch(mcore / form, tmp_path, fmt=fmt, vocab_size=VOCAB)


def test_cli_merge_of_torch_dist_imports_no_torch(mcore_checkpoints, tmp_path):
    from test_merge_sources import imported, run_cli
    fast = run_cli("merge", str(mcore_checkpoints("llama") / "torch_dist"), str(tmp_path / "hf"), "-q",
                   "--vocab-size", str(VOCAB))
    assert fast.returncode == 0, fast.stderr[-2000:]
    assert "ckpt_tools.forms.torch_dist" in imported(fast)
    assert not {m for m in imported(fast) if m == "torch" or m.startswith("torch.")}



def test_transformer_engine_extra_state_as_bytes_is_carried(mcore_checkpoints, tmp_path):
    """Older Transformer Engine versions keep a module's _extra_state as an io.BytesIO: it holds no weights; both
    merge paths take the file and write the model of the local-spec save."""
    import io as _io

    from ckpt_tools.verbs.merge import merge
    from test_merge_sources import assert_same_as_torch
    arch_dir = mcore_checkpoints("llama")
    src = Path(shutil.copytree(arch_dir / "torch_te", tmp_path / "src"))
    for path in src.rglob("model_optim_rng.pt"):
        obj = torch.load(path, weights_only=False)
        obj["model"] = {k: _io.BytesIO(b"fp8 meta") if k.endswith("_extra_state") else v for k, v in obj["model"].items()}
        torch.save(obj, path)
    files = assert_same_as_torch(src, tmp_path, vocab_size=VOCAB)
    direct = tmp_path / "direct"
    merge(arch_dir / "torch", direct, vocab_size=VOCAB, quiet=True)
    assert files["model.safetensors"] == (direct / "model.safetensors").read_bytes()


# ---------------------------------------------------------------- fuzz
FUZZ_SECONDS = float(__import__("os").environ.get("CKPT_FUZZ_SECONDS", "10"))


def _data_ranges(iter_dir: Path) -> dict[str, list[tuple[int, int]]]:
    """file -> the byte ranges that hold tensor data (a flipped byte there changes a value, nothing else)."""
    from ckpt_tools.forms import dcp as _dcp
    out: dict[str, list[tuple[int, int]]] = {}
    for entry in _dcp.read_metadata(iter_dir).tensors.values():
        for c in entry.chunks:
            info = _dcp.chunk_info(iter_dir, c)
            out.setdefault(c.file, []).append((info.offset, info.offset + info.nbytes))
    return out


def test_fuzz_torch_dist(mcore_checkpoints, tmp_path):
    """Random bytes of .metadata, common.pt and the .distcp files flipped: every command answers with its output
    or one error line, never a traceback or a half-written OUT. An output that differs from the undamaged one
    only ever comes from flipped tensor data, or from a flipped value of the args (a Megatron-LM checkpoint has no
    hashes to catch either): printed by `inspect`, or, when it unties the embeddings, named by merge's note that
    the output layer differs from the embedding."""
    import random
    import time

    from safetensors.torch import load_file as load_safetensors
    clean = mcore_checkpoints("llama") / "torch_dist"
    iter_name = "iter_0000005"
    data = _data_ranges(clean / iter_name)
    commands = {"merge": ["merge", "{src}", "{out}", "--format", "safetensors", "-q", "--vocab-size", VOCAB],
                "merge-torch": ["merge", "{src}", "{out}", "--format", "safetensors", "-q", "--vocab-size", VOCAB,
                                "--dtype", "fp32"],
                "inspect": ["inspect", "{src}", "--tensors", "--vocab-size", VOCAB]}
    expected = {}
    for name, args in commands.items():
        out = tmp_path / f"expected-{name}.safetensors"
        result = invoke(*[str(a).format(src=clean, out=out) for a in args])
        assert result.exit_code == 0, result.output
        expected[name] = load_safetensors(out) if name != "inspect" else result.output
    files = sorted(p.name for p in (clean / iter_name).iterdir() if p.is_file())
    outcomes: dict[str, int] = {}
    start, i = time.monotonic(), 0
    while time.monotonic() - start < FUZZ_SECONDS:
        rng = random.Random(f"torch_dist-{i}")
        i += 1
        src = tmp_path / "src"
        shutil.rmtree(src, ignore_errors=True)
        shutil.copytree(clean, src)
        victim = rng.choice(files)
        path = src / iter_name / victim
        raw = bytearray(path.read_bytes())
        spots = [rng.randrange(len(raw)) for _ in range(rng.randint(1, 4))] if raw else []
        for s in spots:
            raw[s] = rng.randrange(256)
        path.write_bytes(bytes(raw))
        in_data = any(a <= s < b for s in spots for a, b in data.get(victim, []))  # a value may change
        name = rng.choice(list(commands))
        out = tmp_path / "out.safetensors"
        result = invoke(*[str(a).format(src=src, out=out) for a in commands[name]])
        why = f"mutation {i - 1} ({victim} at {spots}, {name})"
        assert result.exception is None or isinstance(result.exception, SystemExit), \
            f"{why}: exception escaped: {result.exception!r}"
        assert "Traceback" not in result.output, why
        if result.exit_code == 1:
            assert result.output.startswith("error:") and result.output.count("\n") == 1 and not out.exists(), \
                f"{why}: {result.output}"
            outcomes["error"] = outcomes.get("error", 0) + 1
            continue
        assert result.exit_code == 0, f"{why}: exit {result.exit_code}"
        got = load_safetensors(out) if name != "inspect" else result.output.replace(str(src), str(clean))
        same = got == expected[name] if name == "inspect" else \
            list(got) == list(expected[name]) and all(torch.equal(got[k], expected[name][k]) for k in got)
        if out.exists():
            out.unlink()
        outcomes["same" if same else "changed data"] = outcomes.get("same" if same else "changed data", 0) + 1
        args_changed = victim == "common.pt" and (name == "inspect" or "note:" in result.output)
        assert same or in_data or args_changed, f"{why}: a different output without an error or a note"
    print(f"torch_dist fuzz: {i} mutations: {outcomes}")
    assert i >= 10


def test_a_missing_extra_state_is_no_reason_to_refuse(mcore_checkpoints, tmp_path):
    """`_extra_state` holds no weights: a legacy file without it merges (both paths) and reshards to the model."""
    from ckpt_tools.verbs.merge import merge
    from test_merge_sources import assert_same_as_torch
    arch_dir = mcore_checkpoints("gpt2")
    src = Path(shutil.copytree(arch_dir / "torch", tmp_path / "src"))
    for path in src.rglob("model_optim_rng.pt"):
        obj = torch.load(path, weights_only=False)
        obj["model"] = {k: v for k, v in obj["model"].items() if not k.endswith("_extra_state")}
        torch.save(obj, path)
    files = assert_same_as_torch(src, tmp_path, vocab_size=VOCAB)
    direct = tmp_path / "direct"
    merge(arch_dir / "torch", direct, vocab_size=VOCAB, quiet=True)
    assert files["model.safetensors"] == (direct / "model.safetensors").read_bytes()
    result = invoke("reshard", src, tmp_path / "ours", "--tp", 1, "--pp", 2, "--vocab-size", VOCAB, "--quiet")
    assert result.exit_code == 0, result.output


@pytest.mark.slow  # the benchmark's smoke run, many CLI processes (the fast tier leaves it out)
def test_benchmark_quick_run():
    """benchmarks/megatron_forms.py --quick: megatron-core writes both forms, every command (merge of each, reshard
    into each, import of the HF model into each) runs, merge's memory stays within the target."""
    import subprocess
    import sys
    from conftest import ROOT
    proc = subprocess.run([sys.executable, "benchmarks/megatron_forms.py", "--quick"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("4 ")]
    ops = ["cp -r torch_dist iter dir", "ckpt merge torch_dist", "ckpt reshard -> torch_dist TP1xPP2",
           "ckpt reshard -> torch TP1xPP2", "cp -r torch iter dir", "ckpt merge torch", "cp -r HF dir",
           "ckpt import HF -> torch_dist TP2xPP2", "ckpt import HF -> torch TP2xPP2"]
    assert len(rows) == 9 and all(r.split(None, 1)[1].startswith(op + " ") for r, op in zip(rows, ops)), rows
    assert all(r.rstrip().endswith("yes") for r in rows if "ckpt merge" in r)
