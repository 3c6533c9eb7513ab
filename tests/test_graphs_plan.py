"""Which layers the trainer captures as CUDA graphs (trainer/graphs.py `plan`), and the line that says why not:
decided from the model's layer pattern and the run's layout, so it is checked here without a GPU (the captured runs
themselves are proven against the eager ones in tests/test_gpu_graphs.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ckpt_tools.spec import ModelSpec
from trainer import graphs

CUDA = torch.device("cuda", 0)
LLAMA = dict(architecture="llama", num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2,
             ffn_hidden_size=96, vocab_size=127, max_position_embeddings=16)
NEMOTRON_H = dict(LLAMA, architecture="nemotron_h", kv_channels=16, layer_pattern="M*M-", mamba_num_heads=8,
                  mamba_head_dim=16, mamba_state_dim=16, mamba_num_groups=2)
DEEPSEEK_V3 = dict(LLAMA, architecture="deepseek_v3", num_layers=2, num_query_groups=4, norm_epsilon=1e-6,
                   q_lora_rank=24, kv_lora_rank=16, qk_head_dim=12, qk_pos_emb_head_dim=8, v_head_dim=12, num_moe_experts=4,
                   moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32,
                   layer_pattern="+-+E")


def stage(fields: dict, counts: list[int], pp_rank: int = 0, tp_size: int = 1):
    spec = ModelSpec(**fields)
    layers = SimpleNamespace(layers=[None] * counts[pp_rank])
    return SimpleNamespace(spec=spec, layer_counts=counts, pp_rank=pp_rank, tp_size=tp_size, decoder=layers)


@pytest.mark.parametrize("fields,counts,pp_rank,captured", [
    (LLAMA, [4], 0, [0, 1, 2, 3]),
    (DEEPSEEK_V3, [2], 0, [0]),  # its second layer's MLP is MoE: routed tokens, data-dependent shapes
    (NEMOTRON_H, [4], 0, [1, 3]),  # the Mamba-2 mixers run eagerly, attention and MLP are captured
], ids=["llama", "deepseek-moe", "nemotron-h"])
def test_the_layers_captured_follow_the_pattern(fields, counts, pp_rank, captured):
    chosen, line = graphs.plan(stage(fields, counts, pp_rank), True, CUDA, 1, None)
    assert chosen == captured, line
    assert f"{len(captured)} of {counts[pp_rank]} layers captured" in line, line
    assert ("run eagerly" in line) == (len(captured) < counts[pp_rank]), line


def test_tensor_parallel_layers_are_captured():
    """TP > 1 is captured like TP 1 (its collectives inside the graphs; the graphs released before the process group
    goes: trainer/graphs.py)."""
    chosen, line = graphs.plan(stage(LLAMA, [4], tp_size=2), True, CUDA, 1, None)
    assert chosen == [0, 1, 2, 3] and "4 of 4 layers captured" in line, line


@pytest.mark.parametrize("enabled,device,tp,pp,recompute,why", [
    (False, CUDA, 1, 1, None, "cuda_graphs: false"),
    (True, torch.device("cpu"), 1, 1, None, "no CUDA"),
    (True, CUDA, 1, 2, None, "pipeline parallelism"),
    (True, CUDA, 1, 1, "selective", "selective recompute"),
    (True, CUDA, 1, 1, "full", "full recompute"),
])
def test_no_layer_is_captured_where_graphs_do_not_apply_and_the_line_says_why(enabled, device, tp, pp, recompute,
                                                                               why):
    chosen, line = graphs.plan(stage(LLAMA, [4], tp_size=tp), enabled, device, pp, recompute)
    assert chosen == [] and line.startswith("CUDA graphs: off") and why in line, line
