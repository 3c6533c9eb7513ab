"""Quick self-checks of tests/mcore_reference.py (megatron-core GPTModel state_dict layout)."""

from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mcore_reference import mcore_state_dict_layout  # noqa: E402

LLAMA_TINY = dict(
    architecture="llama",
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=96,
    kv_channels=None,
    padded_vocab_size=1024,
    max_position_embeddings=128,
    norm_epsilon=1e-5,
    rotary_base=10000,
    tie_word_embeddings=True,
)

GPT2_TINY = dict(
    architecture="gpt2",
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=4,
    ffn_hidden_size=256,
    kv_channels=None,
    padded_vocab_size=1024,
    max_position_embeddings=128,
    norm_epsilon=1e-5,
    rotary_base=None,
    tie_word_embeddings=True,
)

LAYER_SUFFIXES_LLAMA = [
    "input_layernorm.weight",
    "self_attention.linear_proj.weight",
    "self_attention.linear_proj._extra_state",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv._extra_state",
    "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc1._extra_state",
    "mlp.linear_fc2.weight",
    "mlp.linear_fc2._extra_state",
]


def _layer_indices(entries):
    return sorted(
        {int(k.split(".")[2]) for k, _, _ in entries if k.startswith("decoder.layers.")}
    )


def test_llama_tp2_pp2_layout():
    tp, pp = 2, 2
    cfg = LLAMA_TINY
    layout = mcore_state_dict_layout(cfg, tp=tp, pp=pp)
    assert sorted(layout) == [(0, 0), (0, 1), (1, 0), (1, 1)]

    hidden = cfg["hidden_size"]
    heads, groups = cfg["num_attention_heads"], cfg["num_query_groups"]
    kv = hidden // heads
    qkv_rows = (groups // tp) * (heads // groups + 2) * kv  # = 1 * 4 * 16 = 64
    fc1_rows = 2 * cfg["ffn_hidden_size"] // tp  # = 96
    vocab_local = cfg["padded_vocab_size"] // tp  # = 512

    for (tp_rank, pp_rank), entries in layout.items():
        d = {k: (shape, dtype) for k, shape, dtype in entries}
        assert len(d) == len(entries), "duplicate keys"
        # Layer keys are stage-local and each stage has num_layers/pp layers.
        assert _layer_indices(entries) == list(range(cfg["num_layers"] // pp))
        for i in range(cfg["num_layers"] // pp):
            layer = [k for k, _, _ in entries if k.startswith(f"decoder.layers.{i}.")]
            assert layer == [f"decoder.layers.{i}.{s}" for s in LAYER_SUFFIXES_LLAMA]
            p = f"decoder.layers.{i}."
            assert d[p + "self_attention.linear_qkv.weight"] == ((qkv_rows, hidden), "float32")
            assert d[p + "self_attention.linear_proj.weight"][0] == (hidden, heads * kv // tp)
            assert d[p + "mlp.linear_fc1.weight"][0] == (fc1_rows, hidden)
            assert d[p + "mlp.linear_fc2.weight"][0] == (hidden, cfg["ffn_hidden_size"] // tp)
            assert d[p + "input_layernorm.weight"][0] == (hidden,)
            assert d[p + "mlp.linear_fc1._extra_state"] == (None, None)
        assert not any(k.endswith(".bias") for k in d)

        if pp_rank == 0:
            assert entries[0][0] == "embedding.word_embeddings.weight"
            assert d["embedding.word_embeddings.weight"] == ((vocab_local, hidden), "float32")
            assert not any(k.startswith(("output_layer", "decoder.final_layernorm")) for k in d)
        else:
            assert not any(k.startswith("embedding.") for k in d)
            # Tied embeddings + PP>1: the last stage keeps its own copy as output_layer.weight.
            assert [k for k, _, _ in entries[-3:]] == [
                "decoder.final_layernorm.weight",
                "output_layer.weight",
                "output_layer._extra_state",
            ]
            assert d["output_layer.weight"] == ((vocab_local, hidden), "float32")
        assert "embedding.position_embeddings.weight" not in d


def test_gpt2_tp1_pp1_layout():
    cfg = GPT2_TINY
    layout = mcore_state_dict_layout(cfg, tp=1, pp=1)
    assert list(layout) == [(0, 0)]
    entries = layout[(0, 0)]
    d = {k: shape for k, shape, _ in entries}
    h, v, f = cfg["hidden_size"], cfg["padded_vocab_size"], cfg["ffn_hidden_size"]

    assert [k for k, _, _ in entries[:2]] == [
        "embedding.word_embeddings.weight",
        "embedding.position_embeddings.weight",
    ]
    assert d["embedding.word_embeddings.weight"] == (v, h)
    assert d["embedding.position_embeddings.weight"] == (cfg["max_position_embeddings"], h)
    assert _layer_indices(entries) == [0, 1]
    for i in range(2):
        p = f"decoder.layers.{i}."
        for mod, rows in (
            ("input_layernorm", h),
            ("self_attention.linear_proj", h),
            ("self_attention.linear_qkv", 3 * h),
            ("pre_mlp_layernorm", h),
            ("mlp.linear_fc1", f),
            ("mlp.linear_fc2", h),
        ):
            assert d[p + mod + ".bias"] == (rows,)
        assert d[p + "mlp.linear_fc1.weight"] == (f, h)
    assert d["decoder.final_layernorm.bias"] == (h,)
    # Tied + PP=1: no output_layer.weight, only the (None) extra state, as the last key.
    assert "output_layer.weight" not in d
    assert entries[-1] == ("output_layer._extra_state", None, None)


def test_child_exception_surfaces_as_runtime_error():
    # Passes the parent's pre-checks; the ModelSpec inside the child refuses it while building the config.
    bad = dict(LLAMA_TINY, num_layers=1, norm_epsilon="not-a-float")
    with pytest.raises(RuntimeError) as ei:
        mcore_state_dict_layout(bad, tp=1, pp=1)
    msg = str(ei.value)
    assert "rank 0 raised" in msg and "Traceback" in msg
    assert "ConfigError" in msg and "not-a-float" in msg and "_build_model" in msg


def test_invalid_gqa_rejected_before_spawning():
    # megatron-core itself builds a (meaningless) model for heads % groups != 0.
    with pytest.raises(ValueError, match="multiple"):
        mcore_state_dict_layout(dict(LLAMA_TINY, num_query_groups=3), tp=1, pp=1)


def test_timeout_kills_children():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out"):
        mcore_state_dict_layout(LLAMA_TINY, tp=1, pp=1, timeout_s=0.5)
    assert time.monotonic() - t0 < 15
