"""The direct-slice reshard path: `shard_ops.reshard_pieces` + `shard_ops.gather` against split(join(...)),
and `ckpt reshard`'s files against files written the old way (join every full tensor, split it, through torch).

Pure CPU, small random tensors (padding rows hold garbage, so dropping or keeping them shows), a few seconds.
"""
from __future__ import annotations

import json

import pytest
import torch
from conftest import same_objects
from torch_target import Target, finish

from ckpt_tools import durable
from ckpt_tools.forms import checkpoint as fmt
from ckpt_tools.forms.shards import OPTIMIZER, OPTIMIZER_FIELDS, open_checked
from ckpt_tools.model import layout, shard_ops
from ckpt_tools.model.layout import target_layout
from ckpt_tools.model.ranks import Rank
from ckpt_tools.model.spec import ModelSpec
from ckpt_tools.verbs.reshard import reshard

TPS = (1, 2, 4, 8)
LLAMA = ModelSpec("llama", num_layers=2, hidden_size=64, num_attention_heads=16, num_query_groups=8,
                  ffn_hidden_size=32, vocab_size=1000, max_position_embeddings=32)
GPT2 = ModelSpec("gpt2", num_layers=2, hidden_size=64, num_attention_heads=8, ffn_hidden_size=32, vocab_size=1000,
                 max_position_embeddings=32, tie_word_embeddings=True)


def random_full(key: str, spec: ModelSpec, padded: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.full_shape(key, spec, padded, 2), generator=g)  # garbage in the padding rows too


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def cases():
    for spec in (LLAMA, GPT2):
        for rule in layout.rules_for(spec, 2):
            if rule.split != layout.EXTRA:
                key = rule.name.format(i=1)
                for src_tp in TPS:
                    for tp in TPS:
                        yield spec, key, src_tp, tp


@pytest.mark.parametrize("spec,key,src_tp,tp", list(cases()))
def test_gather_of_pieces_is_split_of_join(spec: ModelSpec, key: str, src_tp: int, tp: int) -> None:
    padded = spec.padded_vocab_size(max(TPS))
    full = random_full(key, spec, padded, seed=src_tp * 10 + tp)
    src = shard_ops.split(key, full, spec, src_tp, 2)
    want = shard_ops.split(key, shard_ops.join(key, src, spec, 2), spec, tp, 2)
    for r in range(tp):
        got = shard_ops.gather(shard_ops.reshard_pieces(key, spec, src_tp, padded, tp, padded, r, 2), src)
        assert got.shape == want[r].shape and torch.equal(bits(got), bits(want[r])), (key, src_tp, tp, r)


@pytest.mark.parametrize("src_padded,src_tp,padded,tp", [(1002, 2, 1024, 4), (1024, 4, 1002, 2), (1008, 8, 1024, 1),
                                                         (1002, 1, 1008, 8)])
@pytest.mark.parametrize("key", ["embedding.word_embeddings.weight", "output_layer.weight"])
def test_vocab_padding_change_matches_pad_vocab(key: str, src_padded: int, src_tp: int, padded: int, tp: int) -> None:
    full = random_full(key, LLAMA, src_padded, seed=7)
    src = shard_ops.split(key, full, LLAMA, src_tp, 2)
    want = shard_ops.split(key, shard_ops.pad_vocab(key, shard_ops.join(key, src, LLAMA, 2), LLAMA, padded), LLAMA, tp, 2)
    for r in range(tp):
        got = shard_ops.gather(shard_ops.reshard_pieces(key, LLAMA, src_tp, src_padded, tp, padded, r, 2), src)
        assert torch.equal(bits(got), bits(want[r])), r


def test_pieces_by_hand_tp2_to_tp4() -> None:
    """Dim-0 splits: one contiguous piece of one source rank (written without a copy); gated fc1: its gate
    and up runs; row-parallel: a column range (strided, one copy)."""
    P = shard_ops.Piece
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"  # 16 + 2 * 8 heads of 4 rows: 128 rows
    assert shard_ops.reshard_pieces(qkv, LLAMA, 2, 1024, 4, 1024, 1) == [P(0, 0, 32, 64)]
    assert shard_ops.reshard_pieces(qkv, LLAMA, 2, 1024, 4, 1024, 2) == [P(1, 0, 0, 32)]
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"  # source rank 0 holds [gate 0:16; up 0:16]
    assert shard_ops.reshard_pieces(fc1, LLAMA, 2, 1024, 4, 1024, 1) == [P(0, 0, 8, 16), P(0, 0, 24, 32)]
    assert shard_ops.reshard_pieces(fc1, LLAMA, 4, 1024, 2, 1024, 1) == [P(2, 0, 0, 8), P(3, 0, 0, 8),
                                                                      P(2, 0, 8, 16), P(3, 0, 8, 16)]
    fc2 = "decoder.layers.0.mlp.linear_fc2.weight"
    assert shard_ops.reshard_pieces(fc2, LLAMA, 2, 1024, 4, 1024, 3) == [P(1, 1, 8, 16)]
    emb = "embedding.word_embeddings.weight"
    assert shard_ops.reshard_pieces(emb, LLAMA, 2, 1002, 4, 1024, 3) == [P(1, 0, 267, 499), P(None, 0, 1000, 1024)]
    src = shard_ops.split(qkv, random_full(qkv, LLAMA, 1024, 0), LLAMA, 2)
    view = shard_ops.gather(shard_ops.reshard_pieces(qkv, LLAMA, 2, 1024, 4, 1024, 3), src)
    assert view.untyped_storage().data_ptr() == src[1].untyped_storage().data_ptr()  # a view, not a copy


# ---------------------------------------------------------------- whole checkpoints, byte for byte
def write_source(save, spec: ModelSpec, tp: int, pp: int, padded: int) -> None:
    """A checkpoint with random bf16 weights and fp32 optimizer state (garbage in the vocab padding)."""
    counts = layout.layers_per_stage(spec.num_layers, pp)
    ckpt = save / fmt.checkpoint_name(3)
    ckpt.mkdir(parents=True)
    target = Target(ckpt, spec, tp, counts, padded, optimizer=True)
    for p in range(pp):
        target.begin_stage(p)
        for i, (local, key) in enumerate(layout.stage_keys(spec, counts, p)):
            if layout.find_rule(key, spec, pp).split == layout.EXTRA:
                target.put(key, None)
                continue
            master = random_full(key, spec, padded, seed=100 * p + i)
            target.put(key, master.to(torch.bfloat16))
            for n, f in enumerate(OPTIMIZER_FIELDS):
                target.put_state(key, f, master * (n + 1))
            target.put_state(key, "step", torch.tensor(3.0))
        target.end_stage({"param_groups": [{"lr": 1e-3}], "scheduler": {"iteration": 3}, "scaler": None})
    meta = fmt.build_meta(spec, tp, counts, padded, 3, 24, "bfloat16", 1, {}, {}, {"op": "test"})
    finish(save, 3, target, meta, None)


def reshard_by_join(src, out, tp: int, pp: int) -> dict:
    """The old reshard: every full tensor joined, then split to all TP ranks of a stage side by side."""
    shards = open_checked(src)
    spec = shards.meta.spec
    counts, padded = target_layout(spec, tp, pp, None, shards.meta.padded_vocab)
    out.mkdir()
    target = Target(out, spec, tp, counts, padded, optimizer=True)
    extras = {k: v for k, v in shards.file(OPTIMIZER, Rank(0, 0)).items() if k != OPTIMIZER}
    for p in range(pp):
        target.begin_stage(p)
        for local, key in layout.stage_keys(spec, counts, p):
            source = shards.source_key(key)
            if layout.find_rule(key, spec, pp).split == layout.EXTRA:
                target.put(key, shards.shards(source)[0])
                continue
            target.put(key, shards.full(source))
            for f in OPTIMIZER_FIELDS:
                target.put_state(key, f, shards.full(source, f))
            target.put_state(key, "step", shards.shards(source, "step")[0])
        target.end_stage(extras)
    return target.records()


@pytest.mark.parametrize("spec,src,dst,src_padded", [
    (LLAMA, (2, 2), (4, 1), 1024),  # the benchmark's case: contiguous pieces, gated and row copies
    (LLAMA, (4, 1), (2, 2), 1024),  # TP down: pieces from two source ranks
    (LLAMA, (2, 2), (4, 2), 1002),  # padded vocab 1002 -> 1024 (rows beyond the true vocab become zeros)
    (LLAMA, (1, 1), (8, 2), 1000),  # PP1 -> PP2: the untied output layer moves; vocab re-padded
    (GPT2, (1, 1), (2, 2), 1024),   # tied: the last stage's output copy comes from the word embedding
    (GPT2, (2, 2), (1, 1), 1024),   # LayerNorm, biases (a row-parallel layer's bias is replicated)
], ids=["llama-tp2pp2-tp4pp1", "llama-tp4-tp2pp2", "llama-repad", "llama-tp1-tp8pp2", "gpt2-tp1-tp2pp2",
        "gpt2-tp2pp2-tp1"])
def test_reshard_files_hold_what_join_then_split_writes(tmp_path, monkeypatch, spec, src, dst, src_padded) -> None:
    write_source(tmp_path / "src", spec, src[0], src[1], src_padded)
    copied, real = [], durable.FileWorker.copy
    monkeypatch.setattr(durable.FileWorker, "copy", lambda self, *a: copied.append(a) or real(self, *a))
    reshard(tmp_path / "src", tmp_path / "new", dst[0], dst[1], quiet=True)
    # a tied output copy that differs from the word embedding (random here) is read through the torch reader, which
    # notes it; every other source's tensors are copied
    assert bool(copied) == (spec is not GPT2 or src[1] == 1), "tensors copied file to file, or not"
    new = json.loads((tmp_path / "new" / "checkpoint-3" / fmt.META).read_text())["files"]
    old = reshard_by_join(tmp_path / "src", tmp_path / "old", dst[0], dst[1])
    shard_names = {n for n in new if not n.startswith("rng_")}
    assert len(shard_names) == 2 * dst[0] * dst[1] and shard_names == set(old)
    for name in shard_names:  # every object equal, tensors bit for bit, in the same order
        a, b = (torch.load(d / name, weights_only=True) for d in (tmp_path / "new" / "checkpoint-3", tmp_path / "old"))
        same_objects(a, b, name)
    open_checked(tmp_path / "new", None, check_hashes=True).close()  # the recorded sizes and hashes are the files'
