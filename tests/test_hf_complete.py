"""Everything of an HF model survives `ckpt import` -> `ckpt reshard` -> `ckpt merge` (and a Megatron-LM detour):
a real tokenizer (built locally with `tokenizers`: special tokens, a chat template, named templates), the
generation config, and every config.json field, so that transformers' AutoTokenizer + apply_chat_template +
AutoModelForCausalLM + generate behave identically on the original and the merged dir."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import ROOT

from ckpt_tools.verbs.merge import merge
from ckpt_tools.verbs.importer import import_hf
from ckpt_tools.verbs.reshard import reshard

CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOL_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Where is the corpus?"}]


def build_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    specials = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train([str(ROOT / "fixtures" / "corpus.txt")], trainers.BpeTrainer(vocab_size=400, special_tokens=specials))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = {"default": CHAT, "tool_use": TOOL_TEMPLATE}
    return fast


@pytest.fixture(scope="module")
def hf_chat(tmp_path_factory) -> Path:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    path = tmp_path_factory.mktemp("chat") / "hf"
    tok = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=[tok.eos_token_id, 5],
                                               pad_token_id=tok.pad_token_id, max_new_tokens=12, do_sample=False,
                                               repetition_penalty=1.3)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def behaviour(path: Path) -> dict:
    """What a user sees of a model dir: chat formatting, token ids, greedy generation, the configs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    tok = AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    tool = tok.apply_chat_template(MESSAGES, tokenize=False, chat_template="tool_use")
    ids = tok(text, return_tensors="pt").input_ids
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        generated = model.generate(ids, attention_mask=torch.ones_like(ids))[0].tolist()
    config = json.loads((path / "config.json").read_text())
    return {"text": text, "tool": tool, "ids": ids[0].tolist(), "generated": generated,
            "special": (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token, tok.all_special_tokens),
            "generation": GenerationConfig.from_pretrained(path).to_diff_dict(), "config": config}


@pytest.mark.parametrize("route", ["ours", "torch_dist"])
def test_merged_chat_model_behaves_like_the_original(route, hf_chat, tmp_path):
    if route == "ours":
        import_hf(hf_chat, tmp_path / "a", tp=2, pp=2, quiet=True)
        reshard(tmp_path / "a", tmp_path / "b", tp=1, pp=2, quiet=True)
    else:  # through Megatron-LM's form and back
        import_hf(hf_chat, tmp_path / "b", tp=2, pp=2, form="torch_dist", quiet=True)
    merge(tmp_path / "b", tmp_path / "merged", quiet=True)
    want, got = behaviour(hf_chat), behaviour(tmp_path / "merged")
    assert len(want["generated"]) > len(want["ids"])  # generation ran
    for key in ("text", "tool", "ids", "generated", "special", "generation"):
        assert got[key] == want[key], key
    for key, value in want["config"].items():  # every field of the original config.json, same value
        if key != "transformers_version":
            assert got["config"].get(key) == value, key
    assert sorted(p.name for p in (tmp_path / "merged" / "additional_chat_templates").iterdir()) == ["tool_use.jinja"]
    assert not (tmp_path / "merged" / "hf_config.json").exists()


def test_merge_to_one_pytorch_model_bin(hf_chat, tmp_path):
    """`--format torch`: one torch.save state dict with HF names, bit-equal to the HF merge, loadable with
    weights_only=True, and a dir holding it is a transformers model."""
    import shutil

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    import_hf(hf_chat, tmp_path / "shards", tp=2, pp=2, quiet=True)
    merge(tmp_path / "shards", tmp_path / "merged", quiet=True)
    line = merge(tmp_path / "shards", tmp_path / "pytorch_model.bin", fmt="torch", quiet=True)
    assert "pytorch_model.bin" in line
    state = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    want = load_file(tmp_path / "merged" / "model.safetensors")
    assert sorted(state) == sorted(want)
    assert all(state[k].dtype == want[k].dtype and torch.equal(state[k], want[k]) for k in want)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(tmp_path / "pytorch_model.bin", bin_dir / "pytorch_model.bin")
    shutil.copy(tmp_path / "merged" / "config.json", bin_dir / "config.json")
    model = AutoModelForCausalLM.from_pretrained(bin_dir, dtype=torch.float32)
    assert torch.equal(model.model.embed_tokens.weight, want["model.embed_tokens.weight"])


def test_merge_to_an_hf_dir_with_bin_weights(hf_chat, tmp_path):
    """`--format hf-bin`: the HF dir with pytorch_model*.bin (sharded with an index past --max-shard-size)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    import_hf(hf_chat, tmp_path / "shards", tp=2, pp=2, quiet=True)
    merge(tmp_path / "shards", tmp_path / "merged", quiet=True)
    merge(tmp_path / "shards", tmp_path / "bin", fmt="hf-bin", max_shard_size=200_000, quiet=True)
    index = json.loads((tmp_path / "bin" / "pytorch_model.bin.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all(f.startswith("pytorch_model-") and f.endswith(".bin") for f in files)
    want = load_file(tmp_path / "merged" / "model.safetensors")
    got = {k: v for f in files for k, v in torch.load(tmp_path / "bin" / f, weights_only=True).items()}
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "bin", dtype=torch.float32)
    assert torch.equal(model.model.layers[3].mlp.down_proj.weight, want["model.layers.3.mlp.down_proj.weight"])
    assert behaviour(tmp_path / "bin")["generated"] == behaviour(hf_chat)["generated"]
