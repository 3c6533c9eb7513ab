"""Rows of the bad-input table (test_bad_input.py) for wrong arguments and for inputs that are not our
checkpoints: target layouts of reshard and import, HF dirs for import, verify's OTHER, a junk dir, and
Megatron-LM dirs. Importing this module registers them."""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

from bad_inputs import OUT, Bases, case, ckpt_of, truncate
from safetensors.torch import load_file as load_safetensors
from safetensors.torch import save_file as save_safetensors


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
    hf = _hf_copy(b, tmp, lambda c: c.update(model_type="mamba"))
    return (["import", hf, tmp / OUT], [f"{hf / 'config.json'}: model_type 'mamba'", "the supported families are llama, mistral"],
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
