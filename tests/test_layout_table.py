"""Tests for ckpt_tools/model/layout.py, the table itself: one-line errors for what does not divide or is
unknown, the table's coverage of megatron-core's keys, stage keys (even and uneven), vocab padding,
and shard_shape against split. Expected values are written by hand (see test_layout.py)."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter

import pytest
import torch
from layout_cases import (
    SMALL_GPT2,
    SPECS,
    deepseek,
    TPS,
    all_cases,
    assert_bitwise,
    gpt2,
    gpt_oss,
    layer0,
    llama,
    nemotron_h,
    qwen3_next,
    random_full,
)

from ckpt_tools.errors import ConfigError, LayoutError
from ckpt_tools.model import families, layout, shard_ops
from ckpt_tools.model.spec import ModelSpec


# ---------------------------------------------------------------- 4. errors
def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, f"message is not one line: {msg!r}"
    return msg


@pytest.mark.parametrize("key,spec_kwargs,expected", [
    # qkv rows 16 are divisible by 4: only the query-group check can catch it
    ("decoder.layers.1.self_attention.linear_qkv.weight",
     dict(num_attention_heads=4, num_query_groups=2, hidden_size=8), "num_query_groups 2"),
    # fc1 rows 12 are divisible by 4, ffn 6 is not
    ("decoder.layers.0.mlp.linear_fc1.weight", dict(ffn_hidden_size=6), "ffn_hidden_size 6"),
])
def test_tp_not_dividing_groups_or_ffn(key: str, spec_kwargs: dict, expected: str) -> None:
    spec = llama(**spec_kwargs)
    full = torch.zeros(layout.full_shape(key, spec, 1024))
    assert full.shape[0] % 4 == 0
    for call in (lambda: shard_ops.split(key, full, spec, 4), lambda: layout.shard_shape(key, spec, 1024, 4)):
        with pytest.raises(LayoutError) as e:
            call()
        msg = one_line(e)
        assert key in msg and expected in msg and "TP 4" in msg and "choose" in msg, msg


def test_plain_dim_not_divisible() -> None:
    key = "decoder.layers.0.self_attention.linear_proj.weight"
    with pytest.raises(LayoutError) as e:
        shard_ops.split(key, torch.zeros(4, 6), SMALL_GPT2, 4)
    msg = one_line(e)
    assert key in msg and "TP 4" in msg and "dim 1" in msg, msg


def test_check_tp() -> None:
    llama(num_attention_heads=8, num_query_groups=4, ffn_hidden_size=32).check_tp(4)  # fine: no raise
    with pytest.raises(ConfigError) as e:
        llama(num_attention_heads=8, num_query_groups=4, ffn_hidden_size=36).check_tp(8)
    msg = one_line(e)
    assert "num_query_groups 4 is not divisible by TP 8" in msg, msg
    assert "ffn_hidden_size 36 is not divisible by TP 8" in msg, msg
    assert "num_attention_heads" not in msg, msg  # 8 heads do divide
    assert "choose a TP" in msg, msg


def test_layers_per_stage() -> None:
    assert layout.layers_per_stage(4, 1) == [4]
    assert layout.layers_per_stage(4, 2) == [2, 2]
    assert layout.layers_per_stage(4, 4) == [1, 1, 1, 1]
    assert layout.layers_per_stage(4, 2, [1, 3]) == [1, 3]
    with pytest.raises(ConfigError) as e:
        layout.layers_per_stage(2, 4)
    msg = one_line(e)
    assert "PP 4" in msg and "2 layers" in msg and "PP <= 2" in msg, msg
    with pytest.raises(ConfigError) as e:
        layout.layers_per_stage(5, 2)
    msg = one_line(e)
    assert "5" in msg and "PP 2" in msg and "explicit" in msg, msg
    for bad in ([1, 2], [0, 4], [4], [1, 1, 2], [-1, 5]):
        with pytest.raises(ConfigError) as e:
            layout.layers_per_stage(4, 2, bad)
        msg = one_line(e)
        assert "4 layers" in msg and "2 stages" in msg and "give 2 positive numbers that sum to 4" in msg, msg


@pytest.mark.parametrize("key", ["decoder.layers.0.self_attention.q_proj.weight", "model.embed_tokens.weight",
                                 "decoder.layers.x.input_layernorm.weight", "output_layer.bias"])
def test_unknown_key(key: str) -> None:
    for call in (lambda: layout.find_rule(key, SPECS["llama_untied"]),
                 lambda: shard_ops.split(key, torch.zeros(2), SPECS["llama_untied"], 1),
                 lambda: layout.full_shape(key, SPECS["llama_untied"], 1024)):
        with pytest.raises(LayoutError) as e:
            call()
        msg = one_line(e)
        assert "unknown tensor key" in msg and key in msg, msg


@pytest.mark.parametrize("spec_name,key,pp", [
    ("llama_untied", "decoder.layers.0.input_layernorm.bias", 1),
    ("llama_untied", "decoder.final_layernorm.bias", 1),
    ("llama_untied", "decoder.layers.2.self_attention.linear_proj.bias", 1),
    ("llama_untied", "decoder.layers.0.mlp.linear_fc1.bias", 1),
    ("llama_untied", "embedding.position_embeddings.weight", 1),
    ("llama_tied", "output_layer.weight", 1),
    ("gpt2", "output_layer.weight", 1),
])
def test_key_not_expected_for_arch(spec_name: str, key: str, pp: int) -> None:
    with pytest.raises(LayoutError) as e:
        layout.find_rule(key, SPECS[spec_name], pp)
    msg = one_line(e)
    assert key in msg and "not expected" in msg, msg


def test_kind_selected_by_arch() -> None:
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    assert layout.find_rule(fc1, SPECS["llama_untied"]).split == layout.GATED
    assert layout.find_rule(fc1, SPECS["gpt2"]).split == layout.COLUMN
    assert layout.find_rule("output_layer.weight", SPECS["gpt2"], 2).split == layout.VOCAB
    # a global (non-zero) layer index resolves to the same row
    assert layout.find_rule("decoder.layers.17.mlp.linear_fc2.weight", SPECS["gpt2"]).split == layout.ROW


# ---------------------------------------------------------------- 5. table coverage
COVERAGE = {
    "llama_untied_pp1": (llama(tie=False), 1),
    "llama_untied_pp2": (llama(tie=False), 2),
    "llama_tied_pp1": (llama(tie=True), 1),
    "llama_tied_pp2": (llama(tie=True), 2),
    "gpt2_pp1": (gpt2(), 1),
    "gpt2_pp2": (gpt2(), 2),
    "qwen3_pp2": (llama(architecture="qwen3"), 2),
    "mixtral_pp2": (llama(architecture="mixtral", num_moe_experts=4), 2),
    "olmoe_pp2": (llama(architecture="olmoe", num_moe_experts=4), 2),  # q/k norms over all heads, split over TP
    "qwen2_moe_pp2": (llama(architecture="qwen2_moe", num_moe_experts=4, moe_shared_expert_intermediate_size=48), 2),
    "deepseek_v3_pp2": (deepseek(), 2),  # MLA; layer 0 dense, layers 1-3 MoE
    "deepseek_v3_plain_q_pp1": (deepseek(q_lora_rank=None), 1),  # one query projection
    "gpt_oss_pp2": (gpt_oss(), 2),  # sinks, biased router and experts
    "nemotron_h_pp2": (nemotron_h(), 2),  # a block per layer: Mamba-2, attention, MLP
    "qwen3_next_pp2": (qwen3_next(), 2),  # gated DeltaNet or gated attention, then MoE with a shared expert
    "ernie4_5_biased_pp2": (llama(architecture="ernie4_5", add_bias_linear=True, tie=True), 2),  # a gated fc1 bias
}
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def present_matches(key: str, spec: ModelSpec, pp: int) -> list[layout.Rule]:
    m = _LAYER_RE.match(key)
    pattern = re.sub(r"\.local_experts\.\d+\.", ".local_experts.{e}.", f"decoder.layers.{{i}}.{m.group(2)}") if m else key
    return [r for r in layout.rules_for(spec, pp) if r.name == pattern]


_BLOCKS = {"*": layout.ATTENTION, "+": layout.MLA, "-": layout.DENSE, "E": layout.MOE, "M": layout.MAMBA,
           "G": layout.GDN}


def _holds(spec: ModelSpec, i: int, block) -> bool:
    """Whether global layer i holds a row of `block` (None: every layer; a tuple: any of them), by its symbols."""
    if block is None:
        return True
    held = {_BLOCKS[c] for c in spec.layer_symbols(i)}
    if layout.MOE in held and spec.moe_shared_expert_intermediate_size is not None:
        held.add(layout.SHARED)
    return bool(held & set(block if isinstance(block, tuple) else (block,)))


DENSE_FIRST = {"deepseek_v3_pp2": 1, "deepseek_v3_plain_q_pp1": 1}  # their pattern +-+E+E+E: layer 0 dense


def test_table_coverage() -> None:
    used: set[int] = set()
    for name, (spec, pp) in COVERAGE.items():
        counts = layout.layers_per_stage(spec.num_layers, pp)
        global_layers: Counter = Counter()
        blocks: dict[str, str | None] = {}  # a layer key's suffix -> its row's block
        for stage in range(pp):
            pairs = layout.stage_keys(spec, counts, stage)
            locals_ = [k for k, _ in pairs]
            assert len(set(locals_)) == len(locals_), f"{name} stage {stage}: duplicate keys"
            local_idx = set()
            for local, glob in pairs:
                matches = present_matches(local, spec, pp)
                assert len(matches) == 1, f"{name}: {local} matches {len(matches)} present rules"
                assert layout.find_rule(local, spec, pp) is matches[0], local
                used.add(id(matches[0]))
                m, g = _LAYER_RE.match(local), _LAYER_RE.match(glob)
                if m:
                    local_idx.add(int(m.group(1)))
                    assert g and g.group(2) == m.group(2), (local, glob)
                    global_layers[(int(g.group(1)), m.group(2))] += 1
                    blocks[m.group(2)] = matches[0].block
                else:
                    assert local == glob, (local, glob)
                if local.startswith("embedding."):
                    assert stage == 0, f"{name}: {local} on stage {stage}"
                if local.startswith(("decoder.final_layernorm", "output_layer")):
                    assert stage == pp - 1, f"{name}: {local} on stage {stage}"
            assert local_idx == set(range(counts[stage])), f"{name} stage {stage}: local layers {sorted(local_idx)}"
            first = [k for k in locals_ if k.startswith("embedding.word_embeddings")]
            last = [k for k in locals_ if k == "decoder.final_layernorm.weight"]
            assert bool(first) == (stage == 0), f"{name} stage {stage}: word embeddings"
            assert bool(last) == (stage == pp - 1), f"{name} stage {stage}: final norm"
            out_w = "output_layer.weight" in locals_
            if stage == pp - 1:
                expect = not spec.tie_word_embeddings or pp > 1
                assert out_w == expect, f"{name}: output_layer.weight present={out_w}, expected {expect}"
                assert "output_layer._extra_state" in locals_, name
            else:
                assert not out_w, name
        suffixes = {s for _, s in global_layers}
        for s in suffixes:
            idx = sorted(i for i, t in global_layers if t == s)
            want = [i for i in range(spec.num_layers) if _holds(spec, i, blocks[s])]
            if name in DENSE_FIRST and blocks[s] in (layout.DENSE, layout.MOE):  # the pattern splits them
                assert 0 < len(want) < spec.num_layers, (name, s, want)
            assert idx == want, f"{name}: {s} global layers {idx}, expected {want}"
        assert all(c == 1 for c in global_layers.values()), f"{name}: a global layer key repeats"
    # the multi-token prediction layers' rows are the decoder's (test_mtp_layers_are_the_last_decoder_layers)
    unused = [(r.name, r.split) for r in layout.TABLE if id(r) not in used and r.stage != layout.MTP_STAGE]
    assert unused == UNREACHABLE, f"rules never used by any spec: {unused} (known unreachable: {UNREACHABLE})"


# Every row is used by some family (the gated fc1 bias, add_bias_linear with a gated MLP: ERNIE 4.5's use_bias).
UNREACHABLE: list[tuple[str, str]] = []


def test_unreachable_rows_are_unreachable_for_every_spec() -> None:
    reachable = set()
    for family in families.all_families():
        for tie in family.allowed("tie_word_embeddings"):
            moe = {"num_moe_experts": 4} if family.moe else {}
            if family.shared_experts:
                moe["moe_shared_expert_intermediate_size"] = 48
            specs = [gpt2()] if family.name == "gpt2" else [deepseek(tie_word_embeddings=tie, q_lora_rank=q) for q in (
                32, None)] if family.name == "deepseek_v3" else [gpt_oss()] if family.name == "gpt_oss" else \
                [nemotron_h(tie_word_embeddings=tie)] if family.name == "nemotron_h" else \
                [qwen3_next(tie_word_embeddings=tie)] if family.name == "qwen3_next" else \
                [llama(architecture=family.name, tie=tie, add_bias_linear=bias, **moe)
                 for bias in family.allowed("add_bias_linear")]
            for spec in specs:
                for pp in (1, 2):
                    reachable |= {(r.name, r.split) for r in layout.rules_for(spec, pp)}
    assert [(r.name, r.split) for r in layout.TABLE
            if (r.name, r.split) not in reachable and r.stage != layout.MTP_STAGE] == UNREACHABLE


@pytest.mark.parametrize("spec", [deepseek(mtp_num_layers=2), deepseek(q_lora_rank=None, mtp_num_layers=1),
                                  llama(architecture="glm4_moe", num_moe_experts=4, moe_shared_expert_intermediate_size=48,
                                        add_qkv_bias=True, qk_layernorm=True, mtp_num_layers=1)],
                         ids=["deepseek_v3", "deepseek_v3_plain_q", "glm4_moe"])
@pytest.mark.parametrize("pp,ep", [(1, 1), (2, 2)])
def test_mtp_layers_are_the_last_decoder_layers(spec: ModelSpec, pp: int, ep: int) -> None:
    """Each multi-token prediction layer (on the last stage, between the final norm and the output layer, in
    megatron-core's order: enorm, hnorm, eh_proj, the transformer layer, final_layernorm) holds the rows of the decoder's
    last layer under `transformer_layer.`, split as they are, and the model's keys without it are the same model's
    without MTP."""
    counts = layout.layers_per_stage(spec.num_layers, pp)
    plain = dataclasses.replace(spec, mtp_num_layers=None)
    for e in range(ep):
        last = [g for _, g in layout.stage_keys(spec, counts, pp - 1, e if ep > 1 else None, ep)]
        assert [g for g in last if not g.startswith("mtp.")] == \
            [g for _, g in layout.stage_keys(plain, counts, pp - 1, e if ep > 1 else None, ep)]
        assert all(not g.startswith("mtp.") for s in range(pp - 1)
                   for _, g in layout.stage_keys(spec, counts, s, e if ep > 1 else None, ep))
        mtp = [g for g in last if g.startswith("mtp.")]
        assert last[last.index("decoder.final_layernorm.weight") + 1] == mtp[0] == "mtp.layers.0.enorm.weight"
        assert last[last.index(mtp[-1]) + 1] == "output_layer.weight"
        prefix = f"decoder.layers.{spec.num_layers - 1}."
        decoder = [g[len(prefix):] for g in last if g.startswith(prefix)]
        for m in range(spec.mtp_num_layers):
            depth = [g[len(f"mtp.layers.{m}."):] for g in mtp if g.startswith(f"mtp.layers.{m}.")]
            assert depth[:4] == ["enorm.weight", "hnorm.weight", "eh_proj.weight", "eh_proj._extra_state"]
            assert depth[-1] == "final_layernorm.weight"
            assert [k.removeprefix("transformer_layer.") for k in depth[4:-1]] == decoder
            for k in decoder:
                row, twin = layout.find_rule(prefix + k, spec, pp), layout.find_rule(f"mtp.layers.{m}.transformer_layer.{k}",
                                                                                     spec, pp)
                assert (twin.split, twin.block, twin.buffer, twin.dtype) == (row.split, row.block, row.buffer, row.dtype)
                assert layout.full_shape(f"mtp.layers.{m}.transformer_layer.{k}", spec, 1024, pp) == \
                    layout.full_shape(prefix + k, spec, 1024, pp)
    assert layout.find_rule("mtp.layers.0.eh_proj.weight", spec).split == layout.COLUMN
    assert layout.full_shape("mtp.layers.0.eh_proj.weight", spec, 1024) == (spec.hidden_size, 2 * spec.hidden_size)
    with pytest.raises(LayoutError, match="not expected"):
        layout.find_rule("mtp.layers.0.enorm.weight", plain)


@pytest.mark.parametrize("tp", TPS)
def test_gated_bias_row_roundtrip_and_rows(tp: int) -> None:
    spec = ModelSpec(architecture="ernie4_5", num_layers=1, hidden_size=64, num_attention_heads=8,
                     ffn_hidden_size=32, vocab_size=1000, add_bias_linear=True)  # ERNIE 4.5's use_bias
    key = "decoder.layers.0.mlp.linear_fc1.bias"
    rule = layout.find_rule(key, spec)
    assert (rule.name, rule.split) == ("decoder.layers.{i}.mlp.linear_fc1.bias", "gated")
    full = random_full(layout.full_shape(key, spec, 1024), torch.bfloat16, seed=tp)
    assert full.shape == (64,)
    shards = shard_ops.split(key, full, spec, tp)
    c = 32 // tp
    for r, s in enumerate(shards):
        exp = torch.cat([full[r * c:(r + 1) * c], full[32 + r * c:32 + (r + 1) * c]])
        assert_bitwise(s, exp, f"gated bias rank {r}")
        assert tuple(s.shape) == layout.shard_shape(key, spec, 1024, tp)
    assert_bitwise(shard_ops.join(key, shards, spec), full, "gated bias roundtrip")


def test_stage_keys_exact_order_llama_untied_one_layer() -> None:
    """Hand-written from DESIGN.md Contract 1 / megatron-core registration order (linear_proj first)."""
    spec = llama(num_layers=1)
    L = "decoder.layers.0."
    expected = [
        "embedding.word_embeddings.weight",
        L + "input_layernorm.weight",
        L + "self_attention.linear_proj.weight", L + "self_attention.linear_proj._extra_state",
        L + "self_attention.linear_qkv.weight", L + "self_attention.linear_qkv._extra_state",
        L + "pre_mlp_layernorm.weight",
        L + "mlp.linear_fc1.weight", L + "mlp.linear_fc1._extra_state",
        L + "mlp.linear_fc2.weight", L + "mlp.linear_fc2._extra_state",
        "decoder.final_layernorm.weight",
        "output_layer.weight", "output_layer._extra_state",
    ]
    assert [k for k, _ in layout.stage_keys(spec, [1], 0)] == expected


def test_stage_keys_exact_order_gpt2_one_layer_tied() -> None:
    spec = gpt2(num_layers=1)
    L = "decoder.layers.0."
    expected = [
        "embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
        L + "input_layernorm.weight", L + "input_layernorm.bias",
        L + "self_attention.linear_proj.weight", L + "self_attention.linear_proj.bias",
        L + "self_attention.linear_proj._extra_state",
        L + "self_attention.linear_qkv.weight", L + "self_attention.linear_qkv.bias",
        L + "self_attention.linear_qkv._extra_state",
        L + "pre_mlp_layernorm.weight", L + "pre_mlp_layernorm.bias",
        L + "mlp.linear_fc1.weight", L + "mlp.linear_fc1.bias", L + "mlp.linear_fc1._extra_state",
        L + "mlp.linear_fc2.weight", L + "mlp.linear_fc2.bias", L + "mlp.linear_fc2._extra_state",
        "decoder.final_layernorm.weight", "decoder.final_layernorm.bias",
        "output_layer._extra_state",  # tied at PP=1: no output_layer.weight
    ]
    assert [k for k, _ in layout.stage_keys(spec, [1], 0)] == expected


# ---------------------------------------------------------------- 6. uneven explicit split
def test_stage_keys_uneven_split_rebases_layers() -> None:
    spec = llama(num_layers=4)
    counts = layout.layers_per_stage(4, 2, [1, 3])
    s0 = layout.stage_keys(spec, counts, 0)
    s1 = layout.stage_keys(spec, counts, 1)
    fc2 = "mlp.linear_fc2.weight"
    assert [p for p in s0 if p[0].endswith(fc2)] == [(f"decoder.layers.0.{fc2}", f"decoder.layers.0.{fc2}")]
    assert [p for p in s1 if p[0].endswith(fc2)] == [
        (f"decoder.layers.0.{fc2}", f"decoder.layers.1.{fc2}"),
        (f"decoder.layers.1.{fc2}", f"decoder.layers.2.{fc2}"),
        (f"decoder.layers.2.{fc2}", f"decoder.layers.3.{fc2}"),
    ]
    for local, glob in s1:
        li, gi = layout.layer_index(local), layout.layer_index(glob)
        if li is not None:
            assert gi == 1 + li, (local, glob)
            assert layout.with_layer_index(glob, li) == local
            assert layout.with_layer_index(local, gi) == glob
    assert s0[0][0] == "embedding.word_embeddings.weight"
    assert not any(k.startswith("embedding.") for k, _ in s1)
    assert s1[-2:] == [("output_layer.weight",) * 2, ("output_layer._extra_state",) * 2]
    assert not any(k.startswith(("output_layer", "decoder.final")) for k, _ in s0)


# ---------------------------------------------------------------- 7. vocab padding
def test_pad_and_trim_vocab() -> None:
    spec = llama(vocab_size=10, hidden_size=8, num_attention_heads=2, num_query_groups=2)
    key = "embedding.word_embeddings.weight"
    true = random_full((10, 8), torch.bfloat16, seed=7)
    padded = shard_ops.pad_vocab(key, true, spec, 16)
    assert padded.shape == (16, 8) and padded.dtype == torch.bfloat16
    assert_bitwise(padded[:10], true, "true rows kept")
    assert torch.equal(padded[10:].view(torch.int16), torch.zeros(6, 8, dtype=torch.int16)), "padding is +0.0"
    # re-padding a padded tensor with garbage padding: garbage is not carried
    garbage = torch.cat([true, torch.full((6, 8), 7.0, dtype=torch.bfloat16)])
    repadded = shard_ops.pad_vocab("output_layer.weight", garbage, spec, 32)
    assert repadded.shape == (32, 8)
    assert_bitwise(repadded[:10], true, "true rows kept (re-pad)")
    assert not repadded[10:].any()
    trimmed = shard_ops.trim_vocab(key, garbage, spec)
    assert_bitwise(trimmed, true, "trim drops padding")
    assert_bitwise(shard_ops.trim_vocab(key, padded, spec), true, "trim(pad(x))")
    with pytest.raises(LayoutError) as e:
        shard_ops.trim_vocab(key, padded, llama(vocab_size=20, hidden_size=8, num_attention_heads=2, num_query_groups=2))
    msg = one_line(e)
    assert key in msg and "16" in msg and "20" in msg, msg
    with pytest.raises(LayoutError):
        shard_ops.pad_vocab("decoder.final_layernorm.weight", torch.zeros(8), spec, 16)
    with pytest.raises(LayoutError):
        shard_ops.trim_vocab("decoder.layers.0.mlp.linear_fc1.weight", torch.zeros(8, 8), spec)


def test_pad_vocab_refuses_fewer_rows_than_true_vocab() -> None:
    """trim_vocab refuses a tensor with fewer rows than the true vocab; pad_vocab does too (no zero-filled real rows)."""
    spec = llama(vocab_size=10, hidden_size=8, num_attention_heads=2, num_query_groups=2)
    with pytest.raises(LayoutError, match="cannot pad 6 rows to 16 for a true vocab of 10"):
        shard_ops.pad_vocab("embedding.word_embeddings.weight", torch.ones(6, 8), spec, 16)
    with pytest.raises(LayoutError, match="cannot pad 12 rows to 8"):
        shard_ops.pad_vocab("embedding.word_embeddings.weight", torch.ones(12, 8), spec, 8)


@pytest.mark.parametrize("vocab,tp,expected", [
    (1000, 1, 1024), (1000, 2, 1024), (1000, 4, 1024), (1000, 8, 1024), (1000, 16, 2048),
    (50257, 1, 50304), (1024, 8, 1024), (1025, 1, 1152),
])
def test_padded_vocab_size(vocab: int, tp: int, expected: int) -> None:
    assert llama(vocab_size=vocab).padded_vocab_size(tp) == expected


# ---------------------------------------------------------------- 8. shard_shape agrees with split
@pytest.mark.parametrize("spec,pp,tp", list(all_cases()))
def test_shard_shape_matches_split(spec: ModelSpec, pp: int, tp: int) -> None:
    padded = spec.padded_vocab_size(tp)
    for rule in layout.rules_for(spec, pp):
        key = layer0(rule)
        ss = layout.shard_shape(key, spec, padded, tp, pp)
        if rule.split == layout.EXTRA:
            assert ss is None, key
            continue
        full = torch.empty(layout.full_shape(key, spec, padded, pp))
        for r, s in enumerate(shard_ops.split(key, full, spec, tp, pp)):
            assert tuple(s.shape) == ss, f"{key} rank {r} TP {tp}: split {tuple(s.shape)} vs shard_shape {ss}"
