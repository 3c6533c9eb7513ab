"""Megatron-LM as it saves today: checkpoints written by megatron-core 0.19.2 itself (fixtures/megatron_019, made by
`python tests/mcore_newest.py make fixtures/megatron_019`): torch_dist with the common state embedded in the .distcp
files (no common.pt), its GPTModel and its HybridModel (`*-*-`, `*-|*-`, `*E*E`), HybridModel also in the legacy form.
Merged to HF they give megatron-core 0.19.2's own logits, by both paths (tests/test_megatron_lm_saves.py, with the other
Megatron-LM saves); here megatron-core 0.19.2's own loader takes what `ckpt reshard/import --format torch_dist` writes
from them, and the pattern's refusals. The Mamba hybrid (Nemotron-H) saves and Qwen3-Next's byte path are
tests/test_megatron_019_hybrid.py's."""
from __future__ import annotations

import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bad_inputs import SystemCall
from safetensors.torch import load_file
from test_reshard import assert_nothing_written, one_line_error, run

from ckpt_tools.errors import ConfigError
from ckpt_tools.model import hybrid
from ckpt_tools.verbs.merge import merge
from ckpt_tools.verbs.reshard import reshard

TESTS = Path(__file__).resolve().parent
SAVES = TESTS.parent / "fixtures" / "megatron_019"
VOCAB = 127


def same_files(a: Path, b: Path) -> None:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)


def hf_logits(hf: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()(tokens).logits


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_inspect_names_the_pattern():
    result = run("inspect", SAVES / "hybrid_gpt2_pp2" / "torch_dist", "--vocab-size", VOCAB)
    assert result.exit_code == 0, result.output
    assert "HybridModel" in result.output and "'*-|*-'" in result.output, result.output


# ---------------------------------------------------------------- megatron-core 0.19.2 loads what we write
def newest_or_skip():
    sys.path.insert(0, str(TESTS))
    import mcore_newest
    if mcore_newest.location() is None:
        pytest.skip("megatron-core 0.19.2 is not staged (scripts/setup_env.sh stages it into .venv)")
    return mcore_newest


def mcore_019_logits(tmp_path: Path, case: dict, load: Path, tokens: torch.Tensor, tag: str) -> dict:
    """megatron-core 0.19.2 builds the case's model at the case's TP x PP, loads `load` with its own
    dist_checkpointing.load (strict), and runs its forward: {logits, pattern, num_layers}."""
    import json
    mcore_newest = newest_or_skip()
    torch.save(tokens, tmp_path / f"{tag}.tokens.pt")
    cfg = {**case, "load": str(load), "tokens": str(tmp_path / f"{tag}.tokens.pt"), "out": str(tmp_path / f"{tag}.pt")}
    (tmp_path / f"{tag}.json").write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           str(case["tp"] * case["pp"]), mcore_newest.__file__, "load", str(tmp_path / f"{tag}.json")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(tmp_path / f"{tag}.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt_llama_tp2", "gpt_gpt_oss_tp2", "gpt_qwen3_next_tp2",
                                  "gpt_deepseek_v3_tp2"])
def test_megatron_core_019_loads_our_torch_dist_at_another_layout(name, tmp_path):
    """A 0.19 GPTModel save (TP2, embedded common state; Llama, GPT-OSS with sinks, windows, YaRN and biased experts
    at ETP 1, Qwen3-Next with gated DeltaNet layers, gated attention and zero-centred norms, DeepSeek-V3 with
    multi-latent attention and its MoE) resharded by ckpt to
    TP1 x PP2 torch_dist: megatron-core 0.19.2 loads it strictly at TP1 x PP2 and gives the saving model's logits."""
    mcore_newest = newest_or_skip()
    reshard(SAVES / name / "torch_dist", tmp_path / "out", tp=1, pp=2, vocab_size=VOCAB, form="torch_dist", quiet=True)
    reference = torch.load(SAVES / name / "reference.pt", weights_only=True)
    case = {**mcore_newest.CASES[name], "tp": 1, "pp": 2}
    got = mcore_019_logits(tmp_path, case, tmp_path / "out", reference["tokens"], "gpt")
    assert rel_err(got["logits"][..., :VOCAB], reference["logits"][..., :VOCAB]) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("name,tp,pp,via", [
    ("hybrid_llama_tp2", 1, 2, "reshard"),  # the byte path (dist_copy)
    ("hybrid_gpt2_pp2", 2, 1, "reshard-torch"),  # the torch path; tied, LayerNorm, biases, learned positions
    ("hybrid_gpt2_pp2", 1, 2, "reshard"),  # tied at PP2: the last stage's output layer (its extra state) kept
    ("hybrid_mixtral_tp2", 1, 2, "import"),  # HF -> HybridModel: MoE layers' experts on their global axis
    ("hybrid_qwen3_next_tp2", 1, 2, "reshard"),  # 'G' layers: the DeltaNet's parts re-cut, its fused input norm
])
def test_megatron_core_019_hybrid_model_loads_what_we_write(name, tp, pp, via, tmp_path):
    """A HybridModel checkpoint written by `ckpt reshard` (the source's class kept) or `ckpt import --model hybrid`,
    at another TP x PP: megatron-core 0.19.2's HybridModel, built from the pattern the checkpoint records ('|' per
    stage), loads it strictly and gives the saving model's logits."""
    mcore_newest = newest_or_skip()
    src = SAVES / name / "torch_dist"
    out = tmp_path / "out"
    if via == "import":
        merge(src, tmp_path / "hf", vocab_size=VOCAB, quiet=True)
        result = run("import", tmp_path / "hf", out, "--tp", tp, "--pp", pp, "--format", "torch_dist",
                     "--model", "hybrid", "--quiet")
    else:
        result = run("reshard", src, out, "--tp", tp, "--pp", pp, "--format", "torch_dist", "--vocab-size", VOCAB,
                     "--quiet", *(["--no-optimizer"] if via == "reshard" else []))
        if via == "reshard-torch":
            from ckpt_tools.verbs.reshard import reshard as reshard_torch
            shutil.rmtree(out)
            reshard_torch(src, out, tp=tp, pp=pp, vocab_size=VOCAB, form="torch_dist", copy_bytes=False, quiet=True)
    assert result.exit_code == 0, result.output
    reference = torch.load(SAVES / name / "reference.pt", weights_only=True)
    case = {**mcore_newest.CASES[name], "tp": tp, "pp": pp}
    got = mcore_019_logits(tmp_path, case, out, reference["tokens"], name)
    loaded = {"hybrid_mixtral_tp2": "*E|*E", "hybrid_qwen3_next_tp2": "GEGE|GE*E"}  # a '|' per stage
    assert got["pattern"] == loaded.get(name, "*-|*-" if pp == 2 else "*-*-")
    assert rel_err(got["logits"][..., :VOCAB], reference["logits"][..., :VOCAB]) < 1e-5


def test_model_hybrid_refused_where_it_cannot_be_written(tmp_path):
    src = SAVES / "hybrid_llama_tp2" / "torch_dist"
    line = one_line_error(run("reshard", src, tmp_path / "out", "--tp", "1", "--pp", "1", "--format", "torch",
                              "--vocab-size", VOCAB))
    assert "a HybridModel checkpoint is written in Megatron-LM's torch_dist form only" in line and "--model gpt" in line
    assert_nothing_written(tmp_path / "out")
    result = run("reshard", src, tmp_path / "out", "--tp", "1", "--pp", "1", "--format", "torch", "--model", "gpt",
                 "--vocab-size", VOCAB, "--quiet")
    assert result.exit_code == 0, result.output
    line = one_line_error(run("reshard", src, tmp_path / "ours", "--tp", "1", "--pp", "1", "--model", "hybrid",
                              "--vocab-size", VOCAB))
    assert line == ("error: --model hybrid applies to Megatron-LM's forms (--format torch_dist), not to ours, which holds "
                    "GPTModel's keys: drop --model or pass --format torch_dist")


def test_interleaved_rotary_in_a_hybrid_model_is_refused_both_ways(tmp_path):
    """megatron-core 0.19.2's HybridModel applies rotary_interleaved in its attention but builds its rotary tables
    without it (GPTModel passes it): its own save of ERNIE 4.5 (fixtures/megatron_019/hybrid_ernie4_5_tp2, no
    reference kept) computes a rotation no HF model does. Read, it is refused in one line; the same weights saved
    by GPTModel merge to its logits (test_megatron_lm_saves). Written, --model hybrid is refused, --model gpt not."""
    for verb in (["merge", SAVES / "hybrid_ernie4_5_tp2" / "torch_dist", tmp_path / "out"],
                 ["reshard", SAVES / "hybrid_ernie4_5_tp2" / "torch_dist", tmp_path / "out", "--tp", "1", "--pp", "1"]):
        line = one_line_error(run(*verb, "--vocab-size", VOCAB))
        assert "layer pattern '*-*-' with interleaved RoPE (rotary_interleaved) in megatron-core's HybridModel" in line
        assert "as a GPTModel (pretrain_gpt.py)" in line, line
        assert_nothing_written(tmp_path / "out")
    src = SAVES / "gpt_ernie4_5_tp2" / "torch_dist"
    line = one_line_error(run("reshard", src, tmp_path / "out", "--tp", "1", "--pp", "1", "--format", "torch_dist",
                              "--model", "hybrid", "--vocab-size", VOCAB))
    assert "interleaved RoPE (rotary_interleaved) in megatron-core's HybridModel" in line and "pass --model gpt" in line
    assert_nothing_written(tmp_path / "out")
    result = run("reshard", src, tmp_path / "out", "--tp", "1", "--pp", "1", "--format", "torch_dist", "--model",
                 "gpt", "--vocab-size", VOCAB, "--quiet")
    assert result.exit_code == 0, result.output


# ---------------------------------------------------------------- bad input
def _rewrite_common_state(src: Path, dst: Path, payload: bytes) -> Path:
    """A copy whose common_state entry is `payload`, appended to its .distcp file and pointed to by .metadata."""
    shutil.copytree(src, dst)
    iter_dir = next(dst.glob("iter_*"))
    with open(iter_dir / ".metadata", "rb") as f:
        meta = pickle.load(f)  # our own fixture, trusted: the test plants the entry
    index = next(i for i in meta.storage_data if i.fqn == "common_state/shard_0_1")
    info = meta.storage_data[index]
    path = iter_dir / info.relative_path
    info.offset, info.length = path.stat().st_size, len(payload)
    with open(path, "ab") as f:
        f.write(payload)
    with open(iter_dir / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    return iter_dir / info.relative_path


@pytest.mark.parametrize("verb", ["merge", "inspect"])
def test_malicious_common_state_is_refused_and_never_runs(verb, tmp_path):
    import io
    marker = tmp_path / "MARKER"
    buf = io.BytesIO()
    torch.save([SystemCall(f"touch {marker}")], buf)
    path = _rewrite_common_state(SAVES / "gpt_llama_tp2" / "torch_dist", tmp_path / "src", buf.getvalue())
    out = tmp_path / "out"
    args = ["merge", tmp_path / "src", out, "--vocab-size", VOCAB] if verb == "merge" else \
        ["inspect", tmp_path / "src", "--vocab-size", VOCAB]
    line = one_line_error(run(*args))
    assert f"{path}: the common_state/shard_0_1 entry at byte" in line and "refused or unreadable" in line, line
    assert not marker.exists()
    assert_nothing_written(out)


def test_common_state_not_a_list_is_one_line(tmp_path):
    import io
    buf = io.BytesIO()
    torch.save({"args": None}, buf)
    path = _rewrite_common_state(SAVES / "gpt_llama_tp2" / "torch_dist", tmp_path / "src", buf.getvalue())
    line = one_line_error(run("merge", tmp_path / "src", tmp_path / "out", "--vocab-size", VOCAB))
    assert line == (f"error: {path}: the common_state/shard_0_1 entry at byte {path.stat().st_size - len(buf.getvalue())} "
                    f"holds dict, expected megatron-core's one-element list holding the common state dict: restore "
                    f"the checkpoint from the source")
    assert_nothing_written(tmp_path / "out")


def _with_args(src: Path, dst: Path, **changes) -> None:
    """A legacy-form copy whose every rank file's args are changed."""
    shutil.copytree(src, dst)
    for path in dst.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        state = torch.load(path, weights_only=False)
        vars(state["args"]).update(changes)
        torch.save(state, path)


def test_pattern_disagreeing_with_the_keys_is_one_line_naming_both(tmp_path):
    _with_args(SAVES / "hybrid_llama_tp2" / "torch", tmp_path / "src", hybrid_layer_pattern="-*-*")
    line = one_line_error(run("merge", tmp_path / "src", tmp_path / "out", "--vocab-size", VOCAB))
    assert "hybrid_layer_pattern '-*-*'" in line and "'-*'" in line and "expected an attention layer" in line, line
    shutil.copytree(SAVES / "hybrid_llama_tp2" / "torch", tmp_path / "src2")  # every layer index one later
    for path in (tmp_path / "src2").glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        state = torch.load(path, weights_only=False)
        state["model"] = {re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m[1]) + 1}.", k): v
                          for k, v in state["model"].items()}
        torch.save(state, path)
    line = one_line_error(run("merge", tmp_path / "src2", tmp_path / "out", "--vocab-size", VOCAB))
    assert (f"{tmp_path / 'src2' / 'iter_0000007' / 'mp_rank_00' / 'model_optim_rng.pt'}: tensor "
                           f"decoder.layers.1.input_layernorm.weight belongs to an attention block, but the layer pattern "
                           f"makes index 1 an MLP layer") in line, line
    assert_nothing_written(tmp_path / "out")


@pytest.mark.parametrize("pattern,symbol", [("M-M-", "Mamba-2 layers ('M'), but its Megatron-LM arguments fit no"),
                                            ("MEM-", "'E'"),
                                            ("*-G-", "gated DeltaNet layers ('G'), but its Megatron-LM arguments fit"),
                                            ("*-D-", "'D'"), ("*-*-/*-", "'/'")])
def test_blocks_not_read_yet_are_refused_naming_the_symbol(pattern, symbol, tmp_path):
    _with_args(SAVES / "hybrid_llama_tp2" / "torch", tmp_path / "src", hybrid_layer_pattern=pattern)
    for verb in (["merge", tmp_path / "src", tmp_path / "out"], ["reshard", tmp_path / "src", tmp_path / "out",
                                                                  "--tp", "1", "--pp", "1"]):
        line = one_line_error(run(*verb, "--vocab-size", VOCAB))
        assert f"hybrid_layer_pattern {pattern!r}" in line and symbol in line, line
        assert_nothing_written(tmp_path / "out")


# ---------------------------------------------------------------- the pattern
def test_pattern_places_each_table_layer_at_its_pair():
    p = hybrid.Pattern.parse("*-*-|*-*-")
    assert (p.num_layers, p.num_indices, p.moe, p.stage_counts(2)) == (4, 8, False, [2, 2])
    assert hybrid.Pattern.parse("*E*E*E*E").stage_counts(2) == [2, 2]  # no '|': megatron-core's even split
    expected = {
        "decoder.layers.3.input_layernorm.weight": "decoder.layers.6.input_layernorm.weight",
        "decoder.layers.3.self_attention.linear_qkv.weight": "decoder.layers.6.self_attention.linear_qkv.weight",
        "decoder.layers.3.pre_mlp_layernorm.weight": "decoder.layers.7.pre_mlp_layernorm.weight",
        "decoder.layers.3.mlp.experts.local_experts.2.linear_fc1.weight":
            "decoder.layers.7.mlp.experts.local_experts.2.linear_fc1.weight",
        "decoder.final_layernorm.weight": "decoder.final_norm.weight",
        "embedding.word_embeddings.weight": "embedding.word_embeddings.weight",
    }
    for key, stored in expected.items():
        assert hybrid.to_hybrid(key) == stored and hybrid.from_hybrid(stored) == key
    assert hybrid.Pattern.for_layers([1, 2], "*E*E*E").text == "*E|*E*E"
    assert hybrid.Pattern.for_layers([2, 1], "*-*E*E").text == "*-*E|*E"


def test_uneven_pipeline_split_of_a_pattern_without_segments_is_megatron_cores():
    """decoder_first/last_pipeline_num_layers count layer indices (megatron-core's select_pipeline_segment)."""
    p = hybrid.Pattern.parse("*-" * 7)
    assert p.stage_counts(3, first=2) == [1, 3, 3] and p.stage_counts(2, first=2, last=None) == [1, 6]
    assert p.stage_counts(3, first=2, last=4) == [1, 4, 2] and p.stage_counts(7) == [1] * 7
    with pytest.raises(ConfigError, match="not whole attention \\+ MLP pairs"):
        p.stage_counts(2, first=3)
    with pytest.raises(ConfigError, match="megatron-core refuses both at once"):
        hybrid.Pattern.parse("*-|*-").stage_counts(2, first=2)


def test_hybrid_args_without_a_pattern_are_refused(tmp_path):
    _with_args(SAVES / "hybrid_llama_tp2" / "torch", tmp_path / "src", hybrid_layer_pattern=None,
               hybrid_attention_ratio=0.5)
    line = one_line_error(run("merge", tmp_path / "src", tmp_path / "out", "--vocab-size", VOCAB))
    assert "a HybridModel's args without a layer pattern (hybrid_attention_ratio set" in line, line
    _with_args(SAVES / "hybrid_llama_tp2" / "torch", tmp_path / "old", hybrid_layer_pattern=None,
               hybrid_override_pattern="*-*-")  # older saves: the deprecated name, read alike
    merge(tmp_path / "old", tmp_path / "hf", vocab_size=VOCAB, quiet=True)
    merge(SAVES / "hybrid_llama_tp2" / "torch", tmp_path / "hf2", vocab_size=VOCAB, quiet=True)
    same_files(tmp_path / "hf", tmp_path / "hf2")


@pytest.mark.parametrize("text,message", [
    ("*-*", "layer indices 2-3 are '*'"),
    ("|*-*-", "pipeline segment 0 is empty"),
    ("*E-*", "layer indices 2-3 are '-*'"),
    ("*|-*-", "pipeline segment '*' splits an attention + MLP pair"),
    ("*-x-", "layer symbol 'x' (not a layer symbol)"),
    ("*-+-", "layer symbol '+' (multi-latent attention blocks"),
])
def test_pattern_refusals(text, message):
    with pytest.raises(ConfigError, match=None) as e:
        hybrid.Pattern.parse(text)
    assert message in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match="split into stages of \\[1, 1, 1, 1\\] indices, not whole"):
        hybrid.Pattern.parse("*-*-").stage_counts(4)


# ---------------------------------------------------------------- no megatron-core in the verbs
def test_the_verbs_import_no_megatron_core(tmp_path):
    """inspect, merge (both paths), reshard (into ours and into torch_dist), import and verify's own process read and
    write HybridModel and GPTModel checkpoints without importing megatron-core: it is the trainer's dependency only
    (verify's forward passes run the trainer in processes of their own)."""
    import os
    src = SAVES / "hybrid_mixtral_tp2" / "torch_dist"
    env = {**os.environ, "CKPT_MERGE_TORCH": "1"}
    commands = [
        ["inspect", src, "--vocab-size", VOCAB, "--tensors"],
        ["merge", src, tmp_path / "hf", "--vocab-size", VOCAB, "--quiet"],
        ["reshard", src, tmp_path / "ours", "--tp", "1", "--pp", "2", "--vocab-size", VOCAB, "--quiet"],
        ["reshard", SAVES / "hybrid_llama_tp2" / "torch", tmp_path / "dist", "--tp", "1", "--pp", "2", "--format",
         "torch_dist", "--vocab-size", VOCAB, "--quiet"],
        ["import", tmp_path / "hf", tmp_path / "imported", "--tp", "2", "--format", "torch_dist", "--model", "hybrid",
         "--quiet"],
        ["verify", tmp_path / "ours", tmp_path / "hf", "--device", "cpu", "--batch", "1", "--seq-len", "8"],
    ]
    for args in commands:
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "ckpt_tools.cli", *map(str, args)],
                              capture_output=True, text=True, env=env, cwd=TESTS.parent, timeout=300)
        assert proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-2000:])
        imported = [line for line in proc.stderr.splitlines() if "| " in line and " megatron" in line]
        assert not imported, (args[0], imported[:3])
        env.pop("CKPT_MERGE_TORCH", None)
