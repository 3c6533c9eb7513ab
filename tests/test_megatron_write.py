"""Writing Megatron-LM checkpoints (`ckpt import/reshard --format torch_dist|torch`), proven against megatron-core:

- megatron-core's own GPTModel, built at a TP x PP other than the written one (torch_dist) or at the written one
  (torch), loads our output with its own loader (`dist_checkpointing.load` / `load_state_dict(strict=True)`,
  tests/mcore_load.py) and its forward gives transformers' logits on the HF source (fp32, < 1e-5); our reader is
  not involved;
- round trips are bit-exact: HF -> torch_dist / torch -> HF, and megatron-core's own torch_dist -> ours ->
  torch_dist -> HF;
- a target Megatron-LM cannot take is one line, before anything is written.
"""
from __future__ import annotations

import json

import pytest
import torch
from conftest import torchrun
from safetensors.torch import load_file as load_safetensors
from test_families import hf_model as family_model
from test_import import VOCAB, hf_model
from test_reshard import assert_nothing_written, one_line_error, run

from ckpt_tools import hf, megatron_lm
from ckpt_tools.errors import ConfigError
from ckpt_tools.megatron_args import pipeline_split
from ckpt_tools.merge import merge
from ckpt_tools.reshard import import_hf, reshard


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-write")
    dirs = {}
    for arch in ("llama", "llama_tied", "gpt2"):
        dirs[arch] = root / arch
        hf_model(arch).save_pretrained(dirs[arch], safe_serialization=True)
    for case in ("qwen2_tied", "qwen3"):  # QKV biases; per-head q/k norms with head_dim x heads != hidden
        dirs[case] = root / case
        family_model(case).save_pretrained(dirs[case], safe_serialization=True)
    return dirs


def same_tensors(a, b) -> None:
    x, y = load_safetensors(a / "model.safetensors"), load_safetensors(b / "model.safetensors")
    assert sorted(x) == sorted(y)
    for name, t in x.items():
        assert y[name].dtype == t.dtype and torch.equal(y[name], t), name


# (HF model, form, written TP x PP, TP x PP megatron-core loads it at)
LOADS = [("llama", "torch_dist", (2, 2), (1, 2)), ("gpt2", "torch_dist", (2, 2), (2, 1)),
         ("llama_tied", "torch", (2, 2), (2, 2)), ("qwen2_tied", "torch_dist", (1, 2), (2, 2)),
         ("qwen3", "torch", (2, 1), (2, 1))]


@pytest.mark.slow
@pytest.mark.parametrize("arch,form,written,loaded", LOADS, ids=[f"{a}-{f}-tp{w[0]}pp{w[1]}-as-tp{l[0]}pp{l[1]}"
                                                                 for a, f, w, l in LOADS])
def test_megatron_core_loads_what_we_write(arch, form, written, loaded, hf_dirs, tmp_path):
    from transformers import AutoModelForCausalLM
    src, out = hf_dirs[arch], tmp_path / "megatron"
    line = import_hf(src, out, tp=written[0], pp=written[1], form=form, quiet=True)
    assert f"--ckpt-format {form}" in line
    assert (out / megatron_lm.TRACKER).read_text() == "release"
    spec = hf.spec_from_hf(src / "config.json")
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
    torch.save(tokens, tmp_path / "tokens.pt")
    config = {"model": spec.to_dict(), "padded_vocab": spec.padded_vocab_size(written[0]), "tp": loaded[0],
              "pp": loaded[1], "form": form, "load": str(out), "tokens": str(tmp_path / "tokens.pt"),
              "out": str(tmp_path / "loaded.pt")}
    (tmp_path / "config.json").write_text(json.dumps(config))
    torchrun(loaded[0] * loaded[1], ["tests/mcore_load.py", str(tmp_path / "config.json")], timeout=600)
    result = torch.load(tmp_path / "loaded.pt", weights_only=False)
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()(tokens).logits
    ours = result["logits"][..., :VOCAB]
    assert ((ours - expected).norm() / expected.norm()).item() < 1e-5
    args = result["args"]  # what Megatron-LM's check_checkpoint_args and --use-checkpoint-args read
    assert (args["num_layers"], args["hidden_size"], args["num_attention_heads"]) == (
        spec.num_layers, spec.hidden_size, spec.num_attention_heads)
    assert (args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]) == written
    assert args["padded_vocab_size"] == spec.padded_vocab_size(written[0]) and result["iteration"] == 0
    assert args["untie_embeddings_and_output_weights"] == (not spec.tie_word_embeddings)


@pytest.mark.parametrize("form", ["torch_dist", "torch"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_hf_to_megatron_to_hf_is_bit_exact(arch, form, hf_dirs, tmp_path):
    import_hf(hf_dirs[arch], tmp_path / "megatron", tp=2, pp=2, form=form, quiet=True)
    merge(tmp_path / "megatron", tmp_path / "back", quiet=True)
    same_tensors(hf_dirs[arch], tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == \
        json.loads((hf_dirs[arch] / "config.json").read_text())["model_type"]


@pytest.mark.slow
def test_megatron_to_ours_to_megatron_is_bit_exact(tmp_path):
    """megatron-core's own torch_dist save (TP2 x PP2) -> ours at TP1 x PP2 -> torch_dist at TP2 x PP1: the same
    tensors as merging megatron-core's save directly."""
    model = {"architecture": "llama", "num_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
             "num_query_groups": 2, "ffn_hidden_size": 96, "vocab_size": VOCAB, "max_position_embeddings": 128}
    (tmp_path / "config.json").write_text(json.dumps({"model": model, "tp": 2, "pp": 2, "iteration": 5,
                                                      "forward": False}))
    torchrun(4, ["tests/mcore_checkpoints.py", str(tmp_path / "config.json"), str(tmp_path)], timeout=600)
    reshard(tmp_path / "torch_dist", tmp_path / "ours", tp=1, pp=2, vocab_size=VOCAB, quiet=True)
    line = reshard(tmp_path / "ours", tmp_path / "again", tp=2, pp=1, form="torch_dist", quiet=True, optimizer=False)
    assert "weights only" in line
    merge(tmp_path / "torch_dist", tmp_path / "direct", vocab_size=VOCAB, quiet=True)
    merge(tmp_path / "again", tmp_path / "round", quiet=True)
    same_tensors(tmp_path / "direct", tmp_path / "round")


@pytest.mark.parametrize("args,expected", [
    (["--tp", "3"], "not divisible by TP 3"),
    (["--pp", "5"], "PP 5 needs at least one layer per stage but the model has 4"),
])
def test_a_target_the_model_cannot_take_is_refused_before_writing(args, expected, hf_dirs, tmp_path):
    out = tmp_path / "out"
    line = one_line_error(run("import", hf_dirs["llama"], out, *args, "--format", "torch_dist", "-q"))
    assert expected in line, line
    assert_nothing_written(out)


def test_optimizer_state_is_not_dropped_silently(llama_run, tmp_path):
    out = tmp_path / "out"
    line = one_line_error(run("reshard", llama_run[0], out, "--tp", "1", "--pp", "1", "--format", "torch", "-q"))
    assert "holds optimizer state" in line and "--no-optimizer" in line, line
    assert_nothing_written(out)


def test_layer_splits_megatron_lm_can_express():
    assert pipeline_split([2, 2, 2]) == {"decoder_first_pipeline_num_layers": None,
                                         "decoder_last_pipeline_num_layers": None}
    assert pipeline_split([1, 3]) == {"decoder_first_pipeline_num_layers": 1, "decoder_last_pipeline_num_layers": 3}
    assert pipeline_split([1, 2, 2, 3]) == {"decoder_first_pipeline_num_layers": 1,
                                            "decoder_last_pipeline_num_layers": 3}
    with pytest.raises(ConfigError, match="the middle ones must be equal"):
        pipeline_split([2, 1, 3, 2])


@pytest.mark.slow
def test_verify_takes_the_written_checkpoint(hf_dirs, tmp_path):
    from ckpt_tools import verify
    import_hf(hf_dirs["llama_tied"], tmp_path / "megatron", tp=2, pp=1, form="torch_dist", quiet=True)
    tiers, _ = verify.run(tmp_path / "megatron", hf_dirs["llama_tied"], seq=32, batch=2)
    assert all(t.ok for t in tiers), [(t.name, t.reason) for t in tiers]
