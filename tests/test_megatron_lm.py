"""Reading real Megatron-LM checkpoint dirs (DESIGN.md Contract 3): ckpt_tools/forms/megatron_lm.py.

Tiny checkpoints of our format are built here from trainer.model.full_init split by the layout
table (no training), converted to Megatron-LM's layout by tests/megatron_lm_writer.py, and read
back. CPU only, a few seconds.
"""
from __future__ import annotations

import argparse
import json
import pickle
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron_lm_writer import megatron_args, write_megatron_lm

from ckpt_tools import io
from ckpt_tools.errors import ConfigError, FormatError
from ckpt_tools.forms import megatron_spec as margs
from ckpt_tools.forms import megatron_lm as mlm
from ckpt_tools.forms.checkpoint import FORMAT, Meta, model_file
from ckpt_tools.forms.shards import open_checkpoint
from ckpt_tools.model import layout, shard_ops
from ckpt_tools.model.ranks import Rank
from ckpt_tools.model.spec import ModelSpec
from trainer.model import full_init

TP, PP, ITERATION, CONSUMED = 2, 2, 100, 1600


def llama(tie: bool = False) -> ModelSpec:
    return ModelSpec(architecture="llama", num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                     ffn_hidden_size=96, vocab_size=250, max_position_embeddings=128, norm_epsilon=1e-6,
                     rotary_base=500000.0, tie_word_embeddings=tie)


def gpt2(activation: str = "gelu") -> ModelSpec:
    return ModelSpec(architecture="gpt2", num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
                     vocab_size=250, max_position_embeddings=128, tie_word_embeddings=True, activation=activation)


def write_ours(spec: ModelSpec, ckpt_dir: Path, tp: int = TP, pp: int = PP, dtype: str = "float32") -> Path:
    """An our-format checkpoint-N dir: meta.json + pytorch_model_tp_T_pp_P.bin from full_init."""
    padded = spec.padded_vocab_size(tp)
    counts = layout.layers_per_stage(spec.num_layers, pp)
    ckpt_dir.mkdir(parents=True)
    tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    for pp_rank in range(pp):
        shards: list[dict] = [{} for _ in range(tp)]
        for local, global_key in layout.stage_keys(spec, counts, pp_rank):
            if layout.find_rule(global_key, spec, pp).split == layout.EXTRA:
                parts = [None] * tp
            else:
                full = full_init(global_key, spec, padded, seed=7).to(tdtype)
                parts = [p.clone() for p in shard_ops.split(global_key, full, spec, tp, pp)]
            for tp_rank in range(tp):
                shards[tp_rank][local] = parts[tp_rank]
        for tp_rank in range(tp):
            torch.save({"model": shards[tp_rank]}, ckpt_dir / model_file(Rank(tp_rank, pp_rank)))
    meta = {"format": FORMAT, "iteration": ITERATION, "consumed_samples": CONSUMED, "model": spec.to_dict(),
            "parallel": {"tp_size": tp, "pp_size": pp, "dp_size": 1, "layers_per_stage": counts},
            "vocab": {"true": spec.vocab_size, "padded": padded, "divisible_by": spec.make_vocab_size_divisible_by,
                      "padding": "zeros"},
            "dtypes": {"params": dtype, "master": "float32"}, "config": {"seq_length": 64, "lr": 3e-3},
            "files": {}}
    (ckpt_dir / "meta.json").write_text(json.dumps(meta))
    return ckpt_dir


def megatron_dir(tmp_path: Path, spec: ModelSpec, vocab_recorded: bool = True, **kw) -> Path:
    ours = write_ours(spec, tmp_path / "ours" / f"checkpoint-{ITERATION}", **kw)
    return write_megatron_lm(ours, tmp_path / "megatron", vocab_recorded=vocab_recorded)


def resave_args(ckpt: Path, **changes) -> None:
    """Change args in the (tp0, pp0) file, the one read_meta takes args from."""
    path = mlm.model_path(ckpt / f"iter_{ITERATION:07d}", Rank(0, 0), PP)
    state = torch.load(path, weights_only=False)
    for k, v in changes.items():
        setattr(state["args"], k, v)
    torch.save(state, path)


@pytest.fixture
def llama_ckpt(tmp_path) -> Path:
    return megatron_dir(tmp_path, llama())


# ---------------------------------------------------------------- layout and reading
def test_writer_layout_matches_megatron_lm(llama_ckpt):
    assert (llama_ckpt / mlm.TRACKER).read_text() == "100"
    iter_dir = llama_ckpt / "iter_0000100"
    assert sorted(p.name for p in iter_dir.iterdir()) == ["mp_rank_00_000", "mp_rank_00_001",
                                                         "mp_rank_01_000", "mp_rank_01_001"]
    assert mlm.model_path(iter_dir, Rank(1, 1), 2) == iter_dir / "mp_rank_01_001" / "model_optim_rng.pt"
    assert mlm.model_path(iter_dir, Rank(3, 0), 1) == iter_dir / "mp_rank_03" / "model_optim_rng.pt"
    assert mlm.is_megatron_lm(llama_ckpt) and mlm.is_megatron_lm(iter_dir)
    assert not mlm.is_megatron_lm(llama_ckpt.parent / "ours" / "checkpoint-100")
    assert not mlm.is_megatron_lm(iter_dir / "mp_rank_00_000")


@pytest.mark.parametrize("name,spec", [("llama_gqa_untied", llama()), ("llama_tied", llama(tie=True)),
                                       ("gpt2", gpt2()), ("gpt2_tanh", gpt2("gelu_tanh"))])
def test_read_meta_gives_spec_and_layout(tmp_path, name, spec):
    ckpt = megatron_dir(tmp_path, spec)
    meta = mlm.read_meta(ckpt)
    assert meta.spec == spec  # every field: architecture, GQA groups, tying, eps, rope base, activation, ...
    assert (meta.tp_size, meta.pp_size, meta.layer_counts) == (2, 2, [2, 2])
    assert meta.padded_vocab == 256 and meta.iteration == ITERATION
    assert meta.source == "megatron-lm" and meta.root == ckpt / "iter_0000100" and meta.dir == meta.root
    assert meta.path == ckpt / "iter_0000100" / "mp_rank_00_000" / "model_optim_rng.pt"
    raw = meta.raw
    assert raw["format"] == "megatron-lm" and raw["model"] == spec.to_dict()
    assert raw["parallel"] == {"tp_size": 2, "pp_size": 2, "dp_size": None, "layers_per_stage": [2, 2]}
    assert raw["vocab"] == {"true": 250, "padded": 256, "divisible_by": 128, "padding": "unknown"}
    assert raw["consumed_samples"] == CONSUMED and raw["checkpoint_version"] == 3.0
    assert raw["dtypes"] == {"params": "float32", "master": "float32"} and raw["files"] == {}


def test_read_meta_from_iter_dir_and_bf16(tmp_path):
    ckpt = megatron_dir(tmp_path, llama(), dtype="bfloat16")
    meta = mlm.read_meta(ckpt / "iter_0000100")
    assert meta.root == ckpt / "iter_0000100" and meta.spec == llama()
    assert meta.raw["dtypes"]["params"] == "bfloat16" and meta.params_dtype == "bfloat16"


def test_tp1_pp1_naming(tmp_path):
    ckpt = megatron_dir(tmp_path, llama(tie=True), tp=1, pp=1)
    assert [p.name for p in (ckpt / "iter_0000100").iterdir()] == ["mp_rank_00"]
    meta = mlm.read_meta(ckpt)
    assert (meta.tp_size, meta.pp_size, meta.layer_counts, meta.padded_vocab) == (1, 1, [4], 256)
    assert meta.path == ckpt / "iter_0000100" / "mp_rank_00" / "model_optim_rng.pt"


def test_files_load_through_allow_list_only(llama_ckpt):
    path = mlm.model_path(llama_ckpt / "iter_0000100", Rank(1, 1), PP)
    registered = torch.serialization.get_safe_globals()  # importing megatron.core registers argparse.Namespace
    torch.serialization.clear_safe_globals()
    try:
        with pytest.raises(pickle.UnpicklingError):  # plain weights_only load refuses the Namespace / numpy state
            torch.load(path, weights_only=True)
        state = io.load_file(path)  # the explicit allow-list (argparse.Namespace, numpy arrays/dtypes) suffices
        assert torch.serialization.get_safe_globals() == []  # and leaves the process's list as it found it
    finally:
        torch.serialization.add_safe_globals(registered)
    assert isinstance(state["args"], argparse.Namespace) and state["args"].params_dtype == torch.float32
    np_state = state["rng_state"][0]["np_rng_state"]
    assert np_state[0] == "MT19937" and isinstance(np_state[1], np.ndarray) and np_state[1].dtype == np.uint32
    assert np_state[1].shape == (624,)
    assert state["rng_state"][0]["cuda_rng_state"] is None and state["rng_state"][0]["rng_tracker_states"] == {}
    assert torch.is_tensor(state["rng_state"][0]["torch_rng_state"])
    assert state["checkpoint_version"] == 3.0 and state["iteration"] == ITERATION
    assert state["opt_param_scheduler"]["num_steps"] == CONSUMED


class Evil:  # any global outside the allow-list
    pass


def test_file_needing_other_pickle_code_is_refused(llama_ckpt):
    path = mlm.model_path(llama_ckpt / "iter_0000100", Rank(0, 0), PP)
    state = torch.load(path, weights_only=False)
    state["args"].evil = Evil()
    torch.save(state, path)
    with pytest.raises(FormatError, match="refused to load") as e:
        mlm.read_meta(llama_ckpt)
    assert str(path) in str(e.value) and "Evil" in str(e.value)


def test_model_shards_are_ours_unchanged(llama_ckpt, tmp_path):
    ours = io.load_file(tmp_path / "ours" / "checkpoint-100" / model_file(Rank(1, 1)))["model"]
    theirs = io.load_file(mlm.model_path(llama_ckpt / "iter_0000100", Rank(1, 1), PP))["model"]
    assert list(theirs) == list(ours)
    assert all(torch.equal(theirs[k], v) for k, v in ours.items() if torch.is_tensor(v))


def test_shardset_reads_megatron_dir_like_ours(llama_ckpt, tmp_path):
    from ckpt_tools.forms.shards import open_checkpoint
    a, b = open_checkpoint(tmp_path / "ours" / "checkpoint-100"), open_checkpoint(llama_ckpt)
    assert a.keys() == b.keys()
    for key in ("embedding.word_embeddings.weight", "decoder.layers.3.self_attention.linear_qkv.weight",
                "decoder.layers.1.mlp.linear_fc1.weight", "output_layer.weight"):
        assert torch.equal(a.full(key), b.full(key)), key


def test_release_tracker(llama_ckpt):
    (llama_ckpt / "iter_0000100").rename(llama_ckpt / "release")
    (llama_ckpt / mlm.TRACKER).write_text("release")
    meta = mlm.read_meta(llama_ckpt)
    assert meta.root == llama_ckpt / "release" and meta.path.parent.name == "mp_rank_00_000"
    assert mlm.is_megatron_lm(llama_ckpt / "release")


def test_vocab_size_argument_and_recorded_vocab(tmp_path):
    ckpt = megatron_dir(tmp_path, llama(), vocab_recorded=False)
    meta = mlm.read_meta(ckpt, vocab_size=250)
    assert meta.spec.vocab_size == 250 and meta.raw["vocab"]["true"] == 250 and meta.padded_vocab == 256
    with pytest.raises(ConfigError) as e:
        mlm.read_meta(ckpt)
    msg = str(e.value)
    assert "does not record its true vocab size" in msg and "padded_vocab_size 256" in msg and "--vocab-size" in msg
    with pytest.raises(ConfigError, match="true vocab 300 exceeds padded_vocab_size 256"):
        mlm.read_meta(ckpt, vocab_size=300)


def test_inspect_describes_a_megatron_dir(llama_ckpt):
    from ckpt_tools.verbs.inspect import describe
    text = describe(llama_ckpt)
    needs = next(line for line in text.splitlines() if line.startswith("needs"))
    # a Megatron-LM dir is merged through torch: one estimate for merge, none for a torch-free path
    assert "merge writes" in needs and "torch-free" not in needs and "reshard ~" in needs, text
    assert "TP 2 x PP 2" in text, text


# ---------------------------------------------------------------- errors
def test_missing_rank_dir(llama_ckpt):
    shutil.rmtree(llama_ckpt / "iter_0000100" / "mp_rank_01_001")
    with pytest.raises(FormatError) as e:
        mlm.read_meta(llama_ckpt)
    msg = str(e.value)
    assert "mp_rank_01_001/model_optim_rng.pt: missing" in msg and "TP2 x PP2" in msg
    assert "mp_rank_00_000..mp_rank_01_001" in msg and "\n" not in msg


def test_extra_rank_dir(llama_ckpt):
    iter_dir = llama_ckpt / "iter_0000100"
    shutil.copytree(iter_dir / "mp_rank_01_001", iter_dir / "mp_rank_02_000")
    with pytest.raises(FormatError) as e:
        mlm.read_meta(llama_ckpt)
    msg = str(e.value)
    assert "mp_rank_02_000: unexpected rank dir" in msg and "TP2 x PP2" in msg and "remove the extra" in msg


def test_pp1_naming_when_args_say_pp2(llama_ckpt):
    iter_dir = llama_ckpt / "iter_0000100"
    (iter_dir / "mp_rank_00_000").rename(iter_dir / "mp_rank_00")
    with pytest.raises(FormatError, match=r"mp_rank_00_000/model_optim_rng.pt: missing"):
        mlm.read_meta(llama_ckpt)


@pytest.mark.parametrize("text,expected", [
    ("garbage\n", "holds 'garbage', expected an iteration number or 'release'"),
    ("", "holds '', expected an iteration number or 'release'"),
    ("200", "names '200' but"),
])
def test_bad_tracker(llama_ckpt, text, expected):
    (llama_ckpt / mlm.TRACKER).write_text(text)
    with pytest.raises(FormatError) as e:
        mlm.read_meta(llama_ckpt)
    assert mlm.TRACKER in str(e.value) and expected in str(e.value)
    if text == "200":
        assert "iter_0000200 does not exist (found: iter_0000100)" in str(e.value)


def test_undecodable_tracker(llama_ckpt):
    (llama_ckpt / mlm.TRACKER).write_bytes(b"\xff\xfe\x00")
    with pytest.raises(FormatError, match="unreadable .*UnicodeDecodeError"):
        mlm.read_meta(llama_ckpt)


def test_not_megatron_dir(tmp_path):
    with pytest.raises(FormatError, match="not a Megatron-LM checkpoint"):
        mlm.read_meta(tmp_path)


def test_dcp_forms_megatron_lm_wrote_are_told_apart(tmp_path):
    """A DCP dir without dist_checkpointing's metadata.json: Megatron-LM's torch_dcp (the model's keys under `model.`)
    and Megatron-FSDP's fsdp_dtensor (`model.module.`) told apart; anything else named as not Megatron-LM's."""
    import torch.distributed.checkpoint as dcp

    from ckpt_tools.forms import dcp as dcp_index
    for prefix, form in (("model.module.", mlm.FSDP_DTENSOR), ("model.", mlm.TORCH_DCP), ("weights.", None)):
        save = tmp_path / prefix.strip(".") / "iter_0000010"
        dcp.save({f"{prefix}embedding.word_embeddings.weight": torch.zeros(4, 2), "args": "a bytes entry"},
                 storage_writer=dcp.FileSystemWriter(str(save)), no_dist=True)
        (save.parent / mlm.TRACKER).write_text("10")
        if form is not None:
            assert mlm.dcp_form(save, dcp_index.read_metadata(save)) == form
            continue
        with pytest.raises(FormatError, match=re.escape("no model.* tensors and args: not a Megatron-LM torch_dcp or "
                                                        "fsdp_dtensor checkpoint")):
            open_checkpoint(save.parent)
    (tmp_path / "damaged" / "iter_0000010").mkdir(parents=True)
    (tmp_path / "damaged" / "iter_0000010" / ".metadata").write_bytes(b"")
    with pytest.raises(FormatError, match="unreadable"):
        open_checkpoint(tmp_path / "damaged" / "iter_0000010")


@pytest.mark.parametrize("changes,expected", [
    ({"squared_relu": True}, "activation (--swiglu, --squared-relu, --quick-geglu)='squared_relu' (needs 'swiglu')"),
    ({"pipeline_model_parallel_layout": "Et|tL"}, "pipeline_model_parallel_layout='Et|tL' (a custom pipeline layout)"),
    ({"rotary_percent": 0.5}, "rotary_percent 0.5 (partial rotary embeddings) is not available for llama"),
    ({"apply_layernorm_1p": True}, "apply_layernorm_1p=True (needs False)"),
    ({"add_qkv_bias": True, "qk_layernorm": True}, "add_qkv_bias=True (needs False)"),  # neither qwen2 nor qwen3
    ({"normalization": "LayerNorm"}, "normalization='LayerNorm'"),
    ({"position_embedding_type": "yarn"}, "position_embedding_type='yarn'"),
])
def test_unsupported_args(llama_ckpt, changes, expected):
    resave_args(llama_ckpt, **changes)
    with pytest.raises(ConfigError) as e:
        mlm.read_meta(llama_ckpt)
    msg = str(e.value)
    assert expected in msg and "\n" not in msg
    if "rotary_percent" in changes:  # read, then refused by the family the other args fit
        assert "the families with it are glm4_moe" in msg, msg
    else:
        assert "supported: llama" in msg and "gpt2" in msg, msg
    assert msg.startswith(str(mlm.model_path(llama_ckpt / "iter_0000100", Rank(0, 0), PP)))


def test_experts_in_the_args_of_a_model_no_moe_family_takes_are_refused(llama_ckpt):
    """The args name 8 experts, the rest fits only a dense family: one line naming the count and the MoE families."""
    resave_args(llama_ckpt, num_experts=8)
    with pytest.raises(ConfigError) as e:
        mlm.read_meta(llama_ckpt)
    msg = str(e.value)
    assert "num_moe_experts 8 does not fit llama" in msg and "mixtral, qwen3_moe" in msg and "\n" not in msg


def test_gpt2_untied_is_refused(tmp_path):
    args = megatron_args(Meta.read(write_ours(gpt2(), tmp_path / "checkpoint-100")))
    args.untie_embeddings_and_output_weights = True
    with pytest.raises(ConfigError) as e:
        margs.spec_from_args(args, None)
    msg = str(e.value)
    assert "fit no supported architecture" in msg
    assert "for gpt2: untie_embeddings_and_output_weights=True (needs False)" in msg
    assert ("for llama, mistral, phi3: activation (--swiglu, --squared-relu, --quick-geglu)='gelu' (needs "
            "'swiglu'), normalization='LayerNorm' (needs 'RMSNorm')") in msg


def test_args_of_other_megatron_versions(tmp_path):
    """Newer Megatron-LM names the epsilon layernorm_epsilon; old Namespaces lack newer arguments."""
    args = megatron_args(Meta.read(write_ours(llama(), tmp_path / "checkpoint-100")))
    del args.norm_epsilon, args.rotary_percent, args.num_experts, args.vocab_size
    args.layernorm_epsilon = 1e-6
    spec = margs.spec_from_args(args, 250)
    assert spec == llama()
    args.group_query_attention, args.num_query_groups = False, 1  # MHA: num_query_groups is a dead default
    assert margs.spec_from_args(args, 250).num_query_groups == 4


@pytest.mark.parametrize("num_layers,pp,changes,expected", [
    (4, 2, {}, [2, 2]),
    (4, 2, {"decoder_first_pipeline_num_layers": 1}, [1, 3]),
    (8, 4, {"decoder_first_pipeline_num_layers": 1, "decoder_last_pipeline_num_layers": 1}, [1, 3, 3, 1]),
    (8, 4, {"decoder_last_pipeline_num_layers": 2}, [2, 2, 2, 2]),
    (6, 4, {"account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True},
     [1, 2, 2, 1]),
])
def test_layer_counts(num_layers, pp, changes, expected):
    args = argparse.Namespace(**{"num_layers": num_layers, "decoder_first_pipeline_num_layers": None,
                                 "decoder_last_pipeline_num_layers": None, **changes})
    assert margs._layer_counts(args, pp) == expected


def test_uneven_split_read_from_args(llama_ckpt):
    resave_args(llama_ckpt, decoder_first_pipeline_num_layers=1)
    assert mlm.read_meta(llama_ckpt).layer_counts == [1, 3]
    resave_args(llama_ckpt, decoder_first_pipeline_num_layers=5)
    with pytest.raises(ConfigError, match="do not fit 4 layers on 2 stages"):
        mlm.read_meta(llama_ckpt)


def test_foreign_model_keys(llama_ckpt, tmp_path):
    """A key neither megatron-core's nor a legacy model's: named, with its file, before anything is written."""
    path = mlm.model_path(llama_ckpt / "iter_0000100", Rank(0, 0), PP)
    state = torch.load(path, weights_only=False)
    state["model"]["language_model.encoder.layers.0.self_attention.adapter.weight"] = torch.zeros(2)
    torch.save(state, path)
    out = tmp_path / "out"
    from click.testing import CliRunner

    from ckpt_tools.cli import main
    result = CliRunner().invoke(main, ["merge", str(llama_ckpt), str(out)])
    assert result.exit_code == 1 and "self_attention.adapter.weight" in result.output, result.output
    assert not out.exists()