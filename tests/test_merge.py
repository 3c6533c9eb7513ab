"""`ckpt merge`: trained shards -> a HuggingFace model whose logits equal the trainer's sharded forward."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import sharded_logits, train
from safetensors import safe_open
from safetensors.torch import load_file

from ckpt_tools import io
from ckpt_tools.cli import main
from ckpt_tools.verbs.merge import merge


def hf_logits(hf_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """Logits from transformers' own model; the load must report no missing/unexpected/mismatched weight."""
    from transformers import AutoModelForCausalLM
    model, info = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        return model.eval()(tokens).logits.float()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def tokens_for(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 1000, (2, 48), generator=torch.Generator().manual_seed(seed))


LAYOUTS = [(1, 1), (1, 2), (2, 1), (2, 2)]


@pytest.mark.parametrize("config,overrides", [
    ("tiny_llama.yaml", {}),  # GQA (4 heads, 2 groups), untied
    ("tiny_gpt2.yaml", {}),  # LayerNorm, biases, learned positions, tied
    ("tiny_llama.yaml", {"tie_word_embeddings": True}),  # tied llama: a PP>1 last stage holds a copy
], ids=["llama", "gpt2", "llama-tied"])
@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{t}pp{p}" for t, p in LAYOUTS])
@pytest.mark.slow  # torchrun trainings and forwards (the fast tier leaves them out)
def test_merged_hf_model_matches_sharded_forward(request, tmp_path, config, overrides, tp, pp):
    if (overrides or "gpt2" in config) and (tp, pp) in ((1, 2), (2, 1)):
        pytest.skip("tied models: TP1PP1 and TP2PP2 cover both tied placements; llama covers TP or PP alone")
    if (tp, pp) == (2, 2) and not overrides:  # the session's TP2 x PP2 runs
        save, _ = request.getfixturevalue("llama_run" if "llama" in config else "gpt2_run")
    else:
        save = tmp_path / "run"
        train(config, save, tp * pp, tp_degree=tp, pp_degree=pp, train_iters=2, num_micro_batches=2, **overrides)
    ckpt = save / (save / "latest").read_text().strip()
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["vocab"]["true"] == 1000 and meta["vocab"]["padded"] % (128 * tp) == 0  # 1000 is not a multiple
    out = tmp_path / "hf"
    merge(save, out, quiet=True)
    weights = load_file(out / "model.safetensors")
    embed = "model.embed_tokens.weight" if "llama" in config else "transformer.wte.weight"
    assert weights[embed].shape[0] == 1000  # padding rows removed
    assert ("lm_head.weight" in weights) == (config == "tiny_llama.yaml" and not overrides)
    tokens = tokens_for()
    ours = sharded_logits(ckpt, tokens, tmp_path, tp, pp)
    theirs = hf_logits(out, tokens)
    assert rel_err(theirs, ours) < 1e-5
    assert (theirs.argmax(-1) == ours.argmax(-1)).float().mean() == 1.0


def test_hf_dir_is_complete_and_shards_split_by_size(llama_run, tmp_path):
    save, _ = llama_run
    one, many = tmp_path / "one", tmp_path / "many"
    merge(save, one, quiet=True)
    merge(save, many, max_shard_size=300_000, quiet=True)
    config = json.loads((one / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)
    assert (config["intermediate_size"], config["vocab_size"], config["tie_word_embeddings"]) == (96, 1000, False)
    assert config["rope_parameters"]["rope_theta"] == 10000.0 and config["hidden_act"] == "silu"
    assert (one / "tokenizer.json").is_file() and (one / "generation_config.json").is_file()
    index = json.loads((many / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all(f"-of-{len(files):05d}" in f for f in files)
    for f in files:
        assert (many / f).stat().st_size < 300_000 + 70_000  # one tensor may overflow a shard's budget
    merged = {k: v for f in files for k, v in load_file(many / f).items()}
    single = load_file(one / "model.safetensors")
    assert merged.keys() == single.keys() == set(index["weight_map"])
    assert all(torch.equal(merged[k], single[k]) for k in single)
    for path in [one / "model.safetensors"] + [many / f for f in files]:  # each file's data section 64-byte aligned
        with open(path, "rb") as fh:  # (the kernel copies into it at full speed: writers.DATA_ALIGNMENT)
            assert (8 + int.from_bytes(fh.read(8), "little")) % 64 == 0, path
    tokens = tokens_for(1)
    assert torch.equal(hf_logits(many, tokens), hf_logits(one, tokens))


def test_safetensors_format_has_megatron_names_and_config(gpt2_run, tmp_path):
    save, _ = gpt2_run
    out = tmp_path / "model.safetensors"
    hf_dir = tmp_path / "hf"
    merge(save, out, fmt="safetensors", quiet=True)
    merge(save, hf_dir, quiet=True)
    with safe_open(str(out), "pt") as f:
        meta = json.loads(f.metadata()["ckpt_tools"])
        names = list(f.keys())
        emb = f.get_tensor("embedding.word_embeddings.weight")
        fc1 = f.get_tensor("decoder.layers.3.mlp.linear_fc1.weight")
    assert meta["model"]["architecture"] == "gpt2" and meta["source_layout"] == {"tp": 2, "pp": 2}
    assert "output_layer.weight" not in names  # tied: one tensor, as in a TP1 PP1 state dict
    assert not any(n.endswith("_extra_state") for n in names)
    hf = load_file(hf_dir / "model.safetensors")
    assert torch.equal(emb, hf["transformer.wte.weight"]) and emb.shape[0] == 1000
    assert torch.equal(fc1, hf["transformer.h.3.mlp.c_fc.weight"].t())  # HF Conv1D is [in, out]


def test_from_master_weights_are_the_optimizer_fp32_masters(tmp_path):
    save = tmp_path / "run"
    train("tiny_llama.yaml", save, 4, train_iters=2, num_micro_batches=2, dtype="bf16")
    ckpt = save / "checkpoint-2"
    bf16_dir, master_dir = tmp_path / "bf16", tmp_path / "master"
    merge(save, bf16_dir, quiet=True)
    merge(save, master_dir, from_master=True, quiet=True)
    low, high = load_file(bf16_dir / "model.safetensors"), load_file(master_dir / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in low.values()) and all(t.dtype == torch.float32 for t in high.values())
    # Independent of the layout code: read the optimizer shards by hand.
    opt = {(t, p): io.load_file(ckpt / f"optimizer_tp_{t}_pp_{p}.bin")["optimizer"] for t in range(2) for p in range(2)}
    norm = opt[(0, 1)]["decoder.final_layernorm.weight"]["master"]  # replicated, last stage
    assert torch.equal(high["model.norm.weight"], norm) and norm.dtype == torch.float32
    o_proj = torch.cat([opt[(t, 1)]["decoder.layers.1.self_attention.linear_proj.weight"]["master"] for t in range(2)], 1)
    assert torch.equal(high["model.layers.3.self_attn.o_proj.weight"], o_proj)  # stage 1 local layer 1 = layer 3
    down = torch.cat([opt[(t, 0)]["decoder.layers.0.mlp.linear_fc2.weight"]["master"] for t in range(2)], 1)
    assert torch.equal(high["model.layers.0.mlp.down_proj.weight"], down)
    # The bf16 model weights are the masters rounded, and the masters carry more than bf16 holds.
    assert all(torch.equal(high[k].bfloat16(), low[k]) for k in low)
    assert any(not torch.equal(high[k], low[k].float()) for k in low)


def test_merge_refuses_existing_out_and_leaves_nothing_on_failure(llama_run, tmp_path):
    save, _ = llama_run
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    runner = CliRunner()
    res = runner.invoke(main, ["merge", str(save), str(out), "-q"])
    assert res.exit_code == 1 and res.output.startswith("error:") and "--force" in res.output
    assert (out / "keep.txt").read_text() == "mine"
    # A shard that breaks half-way: the error names the file, OUT and temp outputs are absent.
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in (save / "checkpoint-8").iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    shard = broken / "pytorch_model_tp_1_pp_1.bin"
    shard.write_bytes(shard.read_bytes()[:1000])
    res = runner.invoke(main, ["merge", str(broken), str(tmp_path / "hf2"), "-q"])
    assert res.exit_code == 1 and "pytorch_model_tp_1_pp_1.bin" in res.output and len(res.output.splitlines()) == 1
    assert not (tmp_path / "hf2").exists() and not list(tmp_path.glob(".hf2*"))
    res = runner.invoke(main, ["merge", str(save), str(out), "--force", "-q"])
    assert res.exit_code == 0, res.output
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()


def test_megatron_lm_checkpoint_merges_and_reshards_like_ours(llama_run, tmp_path):
    """A checkpoint in Megatron-LM's own layout (Contract 3, args Namespace, numpy RNG) gives the same model."""
    from megatron_lm_writer import write_megatron_lm

    from ckpt_tools.verbs.reshard import reshard
    save, _ = llama_run
    mlm = write_megatron_lm(save / "checkpoint-8", tmp_path / "mlm", vocab_recorded=False)
    assert (mlm / "latest_checkpointed_iteration.txt").is_file()
    res = CliRunner().invoke(main, ["merge", str(mlm), str(tmp_path / "x"), "-q"])
    assert res.exit_code == 1 and "--vocab-size" in res.output and not (tmp_path / "x").exists()
    merge(save, tmp_path / "ours", quiet=True)
    merge(mlm, tmp_path / "theirs", vocab_size=1000, quiet=True)
    ours, theirs = load_file(tmp_path / "ours" / "model.safetensors"), load_file(tmp_path / "theirs" / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    reshard(mlm, tmp_path / "re", tp=1, pp=1, vocab_size=1000, quiet=True)
    merge(tmp_path / "re", tmp_path / "re_hf", quiet=True)
    again = load_file(tmp_path / "re_hf" / "model.safetensors")
    assert all(torch.equal(ours[k], again[k]) for k in ours)
    meta = json.loads((tmp_path / "re" / "checkpoint-8" / "meta.json").read_text())
    assert meta["origin"]["from"]["source"] == "megatron-lm" and meta["parallel"]["tp_size"] == 1
