"""Our trainer's state dict == megatron-core GPTModel's (local spec), rank by rank, in order.

The reference is megatron-core itself, built on CPU in separate processes (mcore_reference.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import torchrun
from ckpt_tools.model.spec import ModelSpec
from mcore_reference import mcore_state_dict_layout

pytestmark = pytest.mark.slow

LLAMA = dict(architecture="llama", num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
             ffn_hidden_size=96, vocab_size=1000, max_position_embeddings=128)
GPT2 = dict(architecture="gpt2", num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
            vocab_size=1000, max_position_embeddings=128, tie_word_embeddings=True)
CASES = [("llama", LLAMA, tp, pp) for tp in (1, 2) for pp in (1, 2)]
CASES += [("llama_tied", {**LLAMA, "tie_word_embeddings": True}, tp, pp) for tp, pp in ((1, 1), (1, 2))]
CASES += [("gpt2", GPT2, tp, pp) for tp, pp in ((1, 1), (2, 2))]
CASES += [("qwen2_tied", {**LLAMA, "architecture": "qwen2", "tie_word_embeddings": True}, 2, 2),
          ("qwen3", {**LLAMA, "architecture": "qwen3", "kv_channels": 24}, 2, 1),
          ("mixtral", {**LLAMA, "architecture": "mixtral", "num_moe_experts": 4}, 2, 2),
          ("qwen3_moe", {**LLAMA, "architecture": "qwen3_moe", "num_moe_experts": 4, "moe_ffn_hidden_size": 32}, 2, 1),
          ("qwen2_moe", {**LLAMA, "architecture": "qwen2_moe", "num_moe_experts": 4, "moe_ffn_hidden_size": 32,
                         "moe_shared_expert_intermediate_size": 48}, 2, 2)]


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("layout")
    cases = [{"name": f"{n}-tp{tp}-pp{pp}", "spec": spec, "tp": tp, "pp": pp} for n, spec, tp, pp in CASES]
    (tmp / "cases.json").write_text(json.dumps(cases))
    torchrun(4, [str(Path(__file__).with_name("our_layout_dump.py")), str(tmp / "cases.json"), str(tmp / "out.json")])
    return json.loads((tmp / "out.json").read_text())


@pytest.mark.parametrize("name,spec,tp,pp", CASES, ids=[f"{c[0]}-tp{c[2]}-pp{c[3]}" for c in CASES])
def test_state_dict_equals_megatron_core(ours, name, spec, tp, pp):
    s = ModelSpec.from_dict(spec)
    reference = mcore_state_dict_layout({**s.to_dict(), "padded_vocab_size": s.padded_vocab_size(tp)}, tp, pp)
    mine = ours[f"{name}-tp{tp}-pp{pp}"]
    assert sorted(mine) == sorted(f"{t},{p}" for t, p in reference)
    for (t, p), entries in reference.items():
        expected = [(k, tuple(shape) if shape is not None else None, dtype) for k, shape, dtype in entries]
        got = [(k, tuple(shape) if shape is not None else None, dtype) for k, shape, dtype in mine[f"{t},{p}"]]
        assert got == expected, f"tp_rank {t} pp_rank {p}"
