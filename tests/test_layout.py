"""Tests for ckpt_tools/model/layout.py (the layout table, DESIGN.md Contract 1) and ModelSpec helpers.

Expected values are written by hand from DESIGN.md Contract 1 and the layout docstring wherever
possible (explicit rows, explicit key lists, explicit padded vocab sizes), or computed with index
arithmetic that does not call the code under test. Round trips compare bit patterns (an integer
view of the tensor), not values, and check the dtype.

Pure CPU, no distributed, runs in a few seconds.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from layout_cases import (
    DTYPES,
    SMALL_GPT2,
    SPECS,
    all_cases,
    assert_bitwise,
    layer0,
    random_full,
)

from ckpt_tools.errors import LayoutError
from ckpt_tools.model import layout, shard_ops
from ckpt_tools.model.spec import ModelSpec


# ---------------------------------------------------------------- 1. join(split(x)) == x bitwise
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("spec,pp,tp", list(all_cases()))
def test_split_join_roundtrip_bitwise(spec: ModelSpec, pp: int, tp: int, dtype: torch.dtype) -> None:
    padded = spec.padded_vocab_size(tp)
    rules = layout.rules_for(spec, pp)
    assert rules, "no rules for spec"
    for n, rule in enumerate(rules):
        key = layer0(rule)
        shape = layout.full_shape(key, spec, padded, pp)
        if rule.split == layout.EXTRA:
            assert shape is None, key
            for value in (None, b"\x00extra-state"):
                shards = shard_ops.split(key, value, spec, tp, pp)
                assert len(shards) == tp and all(s is value for s in shards), key
                assert shard_ops.join(key, shards, spec, pp) is value, key
            continue
        full = random_full(shape, dtype, seed=1000 * tp + n)
        shards = shard_ops.split(key, full, spec, tp, pp)
        assert len(shards) == tp, f"{key}: {len(shards)} shards at TP {tp}"
        for r, s in enumerate(shards):
            assert s.dtype == dtype, f"{key} rank {r}: dtype {s.dtype}"
        if rule.split != layout.REPLICATED:
            assert sum(s.numel() for s in shards) == full.numel(), f"{key}: shards do not partition the tensor"
        back = shard_ops.join(key, shards, spec, pp)
        assert_bitwise(back, full, f"{key} tp={tp} pp={pp} {dtype}")


# ---------------------------------------------------------------- split against index arithmetic
def expected_rows(rule: layout.Rule, spec: ModelSpec, full_rows: int, tp: int, r: int) -> list[int]:
    """The full-tensor rows (dim 0) that rank r holds, from the docstring, without calling layout."""
    if rule.split == layout.QKV:  # whole query groups, each [q heads; gate heads (gated attention); k; v]
        hpg = spec.num_attention_heads // spec.num_query_groups
        gs = ((2 * hpg if spec.attention_output_gate else hpg) + 2) * spec.kv_channels
        per = spec.num_query_groups // tp
        return list(range(r * per * gs, (r + 1) * per * gs))
    if rule.split == layout.GATED:
        f = full_rows // 2
        c = f // tp
        return list(range(r * c, (r + 1) * c)) + list(range(f + r * c, f + (r + 1) * c))
    if rule.split == layout.BLOCKED and ".mixer." in rule.name:  # MambaMixer: in_proj [z; x; B; C; dt], conv1d [x; B; C]
        inner, gn = spec.mamba_num_heads * spec.mamba_head_dim, spec.mamba_num_groups * spec.mamba_state_dim
        parts = [inner, inner, gn, gn, spec.mamba_num_heads] if "in_proj" in rule.name else [inner, gn, gn]
    elif rule.split == layout.BLOCKED:  # GatedDeltaNet: in_proj [q; k; v; z; b; a], conv1d [q; k; v]
        qk = spec.linear_num_key_heads * spec.linear_key_head_dim
        v, nv = spec.linear_num_value_heads * spec.linear_value_head_dim, spec.linear_num_value_heads
        parts = [qk, qk, v, v, nv, nv] if "in_proj" in rule.name else [qk, qk, v]
    if rule.split == layout.BLOCKED:
        assert sum(parts) == full_rows, rule.name
        out, start = [], 0
        for p in parts:
            out += list(range(start + r * p // tp, start + (r + 1) * p // tp))
            start += p
        return out
    c = full_rows // tp
    return list(range(r * c, (r + 1) * c))


@pytest.mark.parametrize("spec,pp,tp", list(all_cases()))
def test_split_matches_index_arithmetic(spec: ModelSpec, pp: int, tp: int) -> None:
    padded = spec.padded_vocab_size(tp)
    for n, rule in enumerate(layout.rules_for(spec, pp)):
        if rule.split == layout.EXTRA:
            continue
        key = layer0(rule)
        full = random_full(rule.shape(spec, padded), torch.float32, seed=n)
        shards = shard_ops.split(key, full, spec, tp, pp)
        for r, s in enumerate(shards):
            if rule.split == layout.REPLICATED:
                exp = full
            elif rule.split == layout.ROW:
                c = full.shape[1] // tp
                exp = full[:, r * c:(r + 1) * c]
            else:
                idx = torch.tensor(expected_rows(rule, spec, full.shape[0], tp, r))
                exp = full.index_select(0, idx)
            assert_bitwise(s, exp, f"{key} ({rule.split}) rank {r} of TP {tp}")


# ---------------------------------------------------------------- 2. hand-written expected rows
QKV_SPEC = ModelSpec(architecture="llama", num_layers=1, hidden_size=1, num_attention_heads=4,
                     num_query_groups=2, kv_channels=1, ffn_hidden_size=4, vocab_size=8)
QKV_W = "decoder.layers.0.self_attention.linear_qkv.weight"
FC1_W = "decoder.layers.0.mlp.linear_fc1.weight"
# q0=10 q1=11 q2=12 q3=13, k0=20 k1=21, v0=30 v1=31; group 0 = [q0,q1,k0,v0], group 1 = [q2,q3,k1,v1]
QKV_FULL = torch.tensor([[10.], [11.], [20.], [30.], [12.], [13.], [21.], [31.]])


def rows(t: torch.Tensor) -> list:
    return t.tolist()


def test_qkv_split_hand_rows_tp2() -> None:
    shards = shard_ops.split(QKV_W, QKV_FULL, QKV_SPEC, 2)
    assert rows(shards[0]) == [[10.], [11.], [20.], [30.]], "rank 0 must hold query group 0 = [q0,q1,k0,v0]"
    assert rows(shards[1]) == [[12.], [13.], [21.], [31.]], "rank 1 must hold query group 1 = [q2,q3,k1,v1]"
    assert rows(shard_ops.join(QKV_W, shards, QKV_SPEC)) == rows(QKV_FULL)


def test_qkv_split_hand_rows_tp1_is_whole() -> None:
    (only,) = shard_ops.split(QKV_W, QKV_FULL, QKV_SPEC, 1)
    assert rows(only) == rows(QKV_FULL)


def test_qkv_bias_hand_rows_tp2() -> None:
    spec = ModelSpec(architecture="gpt2", num_layers=1, hidden_size=2, num_attention_heads=2,
                     kv_channels=1, ffn_hidden_size=2, vocab_size=8, tie_word_embeddings=True)
    # MHA, 2 groups of [q_g, k_g, v_g]: q0=10 k0=20 v0=30 | q1=11 k1=21 v1=31
    full = torch.tensor([10., 20., 30., 11., 21., 31.])
    shards = shard_ops.split("decoder.layers.0.self_attention.linear_qkv.bias", full, spec, 2)
    assert rows(shards[0]) == [10., 20., 30.] and rows(shards[1]) == [11., 21., 31.]


def test_qkv_split_heads_hand_values() -> None:
    q, k, v = shard_ops.qkv_split_heads(QKV_FULL, QKV_SPEC)
    assert rows(q) == [[10.], [11.], [12.], [13.]], "q must be heads q0..q3 in order"
    assert rows(k) == [[20.], [21.]], "k must be [k0, k1]"
    assert rows(v) == [[30.], [31.]], "v must be [v0, v1]"
    joined = shard_ops.qkv_join_heads(q, k, v, QKV_SPEC)
    assert_bitwise(joined, QKV_FULL, "qkv_join_heads(qkv_split_heads(x))")


def test_qkv_split_heads_hand_values_multi_row_heads_and_bias() -> None:
    # kv_channels 2, 2 heads, 2 groups (MHA), hidden 3: head rows labelled q<h><row>, k<g><row>, v<g><row>
    spec = ModelSpec(architecture="llama", num_layers=1, hidden_size=3, num_attention_heads=2,
                     num_query_groups=2, kv_channels=2, ffn_hidden_size=2, vocab_size=8)
    q00, q01, k00, k01, v00, v01 = 100., 101., 200., 201., 300., 301.
    q10, q11, k10, k11, v10, v11 = 110., 111., 210., 211., 310., 311.
    bias = torch.tensor([q00, q01, k00, k01, v00, v01, q10, q11, k10, k11, v10, v11])
    q, k, v = shard_ops.qkv_split_heads(bias, spec)
    assert rows(q) == [q00, q01, q10, q11]
    assert rows(k) == [k00, k01, k10, k11]
    assert rows(v) == [v00, v01, v10, v11]
    assert_bitwise(shard_ops.qkv_join_heads(q, k, v, spec), bias, "bias qkv_join_heads")
    weight = torch.stack([bias, bias + 0.5, bias + 0.25], dim=1)  # (12, 3): column c = bias + offset
    q, k, v = shard_ops.qkv_split_heads(weight, spec)
    assert q.shape == (4, 3) and k.shape == (4, 3) and v.shape == (4, 3)
    assert rows(q[:, 1]) == [q00 + 0.5, q01 + 0.5, q10 + 0.5, q11 + 0.5]
    assert rows(v[:, 2]) == [v00 + 0.25, v01 + 0.25, v10 + 0.25, v11 + 0.25]
    assert_bitwise(shard_ops.qkv_join_heads(q, k, v, spec), weight, "weight qkv_join_heads")


def test_gated_fc1_hand_rows() -> None:
    g = [100., 101., 102., 103.]
    u = [200., 201., 202., 203.]
    full = torch.tensor([[x] for x in g + u])  # [g0,g1,g2,g3,u0,u1,u2,u3], hidden 1
    shards = shard_ops.split(FC1_W, full, QKV_SPEC, 2)
    assert rows(shards[0]) == [[100.], [101.], [200.], [201.]], "rank 0 must hold [g0,g1,u0,u1] in this order"
    assert rows(shards[1]) == [[102.], [103.], [202.], [203.]], "rank 1 must hold [g2,g3,u2,u3] in this order"
    shards4 = shard_ops.split(FC1_W, full, QKV_SPEC, 4)
    assert [rows(s) for s in shards4] == [[[100.], [200.]], [[101.], [201.]], [[102.], [202.]], [[103.], [203.]]]
    assert rows(shard_ops.join(FC1_W, shards, QKV_SPEC)) == rows(full)
    # join from hand-written shards, not from split's output
    hand = [torch.tensor([[100.], [101.], [200.], [201.]]), torch.tensor([[102.], [103.], [202.], [203.]])]
    assert rows(shard_ops.join(FC1_W, hand, QKV_SPEC)) == [[x] for x in g + u]


GRID = torch.tensor([[0., 1., 2., 3.], [10., 11., 12., 13.], [20., 21., 22., 23.], [30., 31., 32., 33.]])


def test_row_parallel_splits_dim1_by_hand() -> None:
    for key in ("decoder.layers.0.self_attention.linear_proj.weight", "decoder.layers.0.mlp.linear_fc2.weight"):
        s0, s1 = shard_ops.split(key, GRID, SMALL_GPT2, 2)
        assert rows(s0) == [[0., 1.], [10., 11.], [20., 21.], [30., 31.]], key
        assert rows(s1) == [[2., 3.], [12., 13.], [22., 23.], [32., 33.]], key
        assert rows(shard_ops.join(key, [s0, s1], SMALL_GPT2)) == rows(GRID), key


def test_column_and_vocab_split_dim0_by_hand() -> None:
    for key in ("decoder.layers.0.mlp.linear_fc1.weight",  # gpt2: not gated -> column
                "embedding.word_embeddings.weight"):
        s0, s1 = shard_ops.split(key, GRID, SMALL_GPT2, 2)
        assert rows(s0) == [[0., 1., 2., 3.], [10., 11., 12., 13.]], key
        assert rows(s1) == [[20., 21., 22., 23.], [30., 31., 32., 33.]], key
    b0, b1 = shard_ops.split("decoder.layers.0.mlp.linear_fc1.bias", torch.tensor([0., 1., 2., 3.]), SMALL_GPT2, 2)
    assert rows(b0) == [0., 1.] and rows(b1) == [2., 3.]
    v = shard_ops.split("output_layer.weight", GRID, SMALL_GPT2, 4, pp_size=2)
    assert [rows(x) for x in v] == [[r] for r in rows(GRID)]


def test_replicated_same_values_every_rank() -> None:
    vec = torch.tensor([1.5, -2., 3., 0.25])
    for key in ("decoder.layers.0.input_layernorm.weight", "decoder.layers.0.input_layernorm.bias",
                "decoder.layers.0.self_attention.linear_proj.bias",  # row-parallel bias: replicated
                "decoder.layers.0.mlp.linear_fc2.bias", "decoder.final_layernorm.bias"):
        shards = shard_ops.split(key, vec, SMALL_GPT2, 4)
        assert len(shards) == 4
        for r, s in enumerate(shards):
            assert rows(s) == [1.5, -2., 3., 0.25], f"{key} rank {r}"
    pos = GRID[:2]
    for s in shard_ops.split("embedding.position_embeddings.weight", pos, SMALL_GPT2, 2):
        assert rows(s) == [[0., 1., 2., 3.], [10., 11., 12., 13.]]


# ---------------------------------------------------------------- 3. replicated consistency
def test_replicated_join_differing_shards_names_key_and_rank() -> None:
    key = "decoder.layers.3.pre_mlp_layernorm.weight"
    a = torch.ones(4)
    b = a.clone()
    b[2] = 1.0000001
    shards = [a, a.clone(), b, a.clone()]
    with pytest.raises(LayoutError) as e:
        shard_ops.join(key, shards, SMALL_GPT2)
    msg = str(e.value)
    assert key in msg and "TP rank 2" in msg and "\n" not in msg, msg
    # a different shape is also a difference
    with pytest.raises(LayoutError, match="TP rank 1"):
        shard_ops.join(key, [a, torch.ones(5)], SMALL_GPT2)
    out = shard_ops.join(key, shards, SMALL_GPT2, check_replicas=False)
    assert_bitwise(out, a, "check_replicas=False returns rank 0's copy")


def test_replicated_join_accepts_identical_nan_replicas() -> None:
    """Replicas that agree bit for bit (here: the same NaN) must join; a diverged run is still mergeable."""
    key = "decoder.layers.0.input_layernorm.weight"
    a = torch.tensor([1.0, float("nan"), 2.0])
    try:
        out = shard_ops.join(key, [a, a.clone()], SMALL_GPT2)
    except LayoutError as e:
        pytest.fail("BUG in shard_ops.join: bit-identical replicated shards containing NaN are rejected as "
                    f"inconsistent (torch.equal treats NaN != NaN); it should compare bit patterns: {e}")
    assert_bitwise(out, a, "NaN replica join")


# ---------------------------------------------------------------- the tied output layer, a declared alias
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_tied_output_layer_is_a_declared_alias_held_as_a_copy_only_at_pp_above_1(tied: bool) -> None:
    spec = dataclasses.replace(SPECS["llama_tied" if tied else "llama_untied"], num_layers=4)
    emb, out = "embedding.word_embeddings.weight", "output_layer.weight"
    assert layout.aliases(spec) == ({out: emb} if tied else {})
    assert layout.alias_of(out, spec) == (emb if tied else None) and layout.alias_of(emb, spec) is None
    for pp in (1, 2, 4):
        held = [k for r in range(pp) for _, k in layout.stage_keys(spec, [spec.num_layers // pp] * pp, r)]
        assert held.count(out) == (0 if tied and pp == 1 else 1), (pp, held[-3:])  # megatron-core: a copy at PP > 1
        copies = [layout.tied_copies(spec, pp, r) for r in range(pp)]
        assert copies == ([set()] * pp if not tied or pp == 1 else [{emb}] + [set()] * (pp - 2) + [{out}])
    if tied:
        with pytest.raises(LayoutError, match="not expected for this model"):
            layout.find_rule(out, spec, 1)
    assert layout.source_key(out, {emb}) == emb and layout.source_key(out, {emb, out}) == out
