"""Which layers the trainer captures as CUDA graphs (trainer/graphs.py `plan`), and the line that says why not:
decided from the model's layer pattern and the run's layout, so it is checked here without a GPU (the captured runs
themselves are proven against the eager ones in tests/test_gpu_graphs.py)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from conftest import torchrun

from ckpt_tools.errors import ConfigError
from ckpt_tools.model.spec import ModelSpec
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
    chosen, line = graphs.plan(stage(fields, counts, pp_rank), True, CUDA, None)
    assert chosen == captured, line
    assert f"{len(captured)} of {counts[pp_rank]} layers captured" in line, line
    assert ("run eagerly" in line) == (len(captured) < counts[pp_rank]), line


def test_tensor_parallel_layers_are_captured():
    """TP > 1 is captured like TP 1 (its collectives inside the graphs; the graphs released before the process group
    goes: trainer/graphs.py)."""
    chosen, line = graphs.plan(stage(LLAMA, [4], tp_size=2), True, CUDA, None)
    assert chosen == [0, 1, 2, 3] and "4 of 4 layers captured" in line, line


@pytest.mark.parametrize("enabled,device,recompute,why", [
    (False, CUDA, None, "cuda_graphs: false"),
    (True, torch.device("cpu"), None, "no CUDA"),
    (True, CUDA, "selective", "selective recompute"),
    (True, CUDA, "full", "full recompute"),
])
def test_no_layer_is_captured_where_graphs_do_not_apply_and_the_line_says_why(enabled, device, recompute, why):
    chosen, line = graphs.plan(stage(LLAMA, [4]), enabled, device, recompute)
    assert chosen == [] and line.startswith("CUDA graphs: off") and why in line, line


@pytest.mark.parametrize("pp,pp_rank,micro_batches,n", [
    (1, 0, 8, 1), (2, 0, 8, 2), (2, 1, 8, 1), (4, 0, 8, 4), (4, 2, 8, 2), (4, 3, 4, 1)])
def test_a_pipeline_stage_captures_a_copy_per_micro_batch_it_keeps_in_flight(pp, pp_rank, micro_batches, n):
    """1F1B (torch.distributed.pipelining's Schedule1F1B) runs PP - rank warm-up forwards on a stage, at most the
    step's micro-batches, before its first backward."""
    assert graphs.copies(pp, pp_rank, micro_batches) == n
    per = LLAMA["num_layers"] // pp
    chosen, line = graphs.plan(stage(LLAMA, [per] * pp, pp_rank), True, CUDA, None)  # PP no longer turns graphs off
    assert chosen == list(range(per)) and f"{per} of {per} layers captured" in line, line


def test_micro_batches_take_the_copies_in_turn_and_a_copy_whose_backward_has_not_run_is_refused():
    """The 1F1B order on the first of two stages: forward 0, forward 1, backward 0, forward 2 (copy 0 again), ...;
    a third forward before backward 0 would overwrite micro-batch 0's activations in copy 0: refused."""
    turns, w = graphs.Turns(2), torch.ones(3, requires_grad=True)
    inputs = [w * float(m + 1) for m in range(4)]  # each micro-batch's input to the captured layers
    assert [turns.take(inputs[0]), turns.take(inputs[1])] == [0, 1]
    with pytest.raises(ConfigError, match="micro-batch 2 would replay copy 0 .* micro-batch 0 it holds"):
        turns.take(inputs[2])
    inputs[0].sum().backward()  # micro-batch 0's backward passes the captured layers' input
    assert turns.take(inputs[2]) == 0
    inputs[1].sum().backward()
    assert turns.take(inputs[3]) == 1
    turns.start_step()  # the next step starts again at copy 0
    assert turns.take(w * 5.0) == 0


@pytest.mark.parametrize("pp,micro_batches", [(2, 2), (3, 5)])
def test_the_copies_suffice_for_torchs_own_1f1b_schedule_and_one_fewer_does_not(pp, micro_batches):
    """torch.distributed.pipelining's Schedule1F1B, as installed, over stand-in stages on CPU
    (tests/pipeline_turns_check.py): with `graphs.copies` copies no forward finds its copy busy, on any stage; with one
    fewer, where a stage has more than one, some do. This pins the formula to the schedule of the torch in use, not to
    a hand-written order."""
    proc = torchrun(pp, ["tests/pipeline_turns_check.py", str(micro_batches)], timeout=120)
    lines = [line[6:] for line in proc.stdout.splitlines() if line.startswith("TURNS ")]
    assert len(lines) == 1, proc.stdout
    ranks = json.loads(lines[0])
    assert [r["rank"] for r in ranks] == list(range(pp)), ranks
    assert [r["copies"] for r in ranks] == [min(micro_batches, pp - k) for k in range(pp)], ranks
    assert all(r["busy"] == 0 for r in ranks), ranks
    assert all(r["busy_with_one_fewer"] > 0 for r in ranks if r["copies"] > 1), ranks
    assert any(r["copies"] > 1 for r in ranks), ranks
