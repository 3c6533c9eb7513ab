"""GPU-only: the layers captured as CUDA graphs (trainer/graphs.py) and the weight gradients accumulated inside their
GEMM (trainer/wgrad.py) train the same run as the eager layers: fp32 to the last bit on one GPU and under TP and DP,
bf16 to the last bit for graphs and within its noise for the fused accumulation (fp32 sums of products that eager
rounds to bf16 first)."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_same_curve, assert_same_files, train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _needs_gpus(n: int):
    return pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} CUDA GPUs")


def _exact(a: list[dict], b: list[dict], layers: int = 4, micro_batches: int = 2) -> None:
    """`a` ran its layers as graphs (all `layers` of them, counted over the pipeline's stages; these models have no MoE
    or mixer layers: replayed in each of the micro-batches of every step), `b` eagerly; the same losses and grad
    norms."""
    assert a[0]["graphed_layers"] == layers and b[0]["graphed_layers"] == 0, (a[0], b[0])
    assert a[-1]["graph_replays"] == layers * micro_batches * a[-1]["iteration"] and b[-1]["graph_replays"] == 0, \
        (a[-1], b[-1])
    assert [(m["loss"], m["grad_norm"]) for m in a] == [(m["loss"], m["grad_norm"]) for m in b], (a, b)


def test_the_fused_weight_gradient_gemm_accumulates_in_place():
    """megatron-core's wgrad_gemm_accum_fp32 contract (APEX's kernel), met by torch's GEMM: main_grad += g^T x,
    in main_grad's own storage, the products summed in fp32."""
    from trainer import wgrad
    torch.manual_seed(0)
    x = torch.randn(2, 512, 384, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(2, 512, 256, device="cuda", dtype=torch.bfloat16)
    for dtype in (torch.float32, torch.bfloat16):
        main = torch.randn(256, 384, device="cuda", dtype=dtype)
        expected = main.double() + g.reshape(-1, 256).double().t() @ x.reshape(-1, 384).double()
        ptr = main.data_ptr()
        wgrad.TORCH_WGRAD.wgrad_gemm_accum_fp32(x, g, main)
        assert main.data_ptr() == ptr and main.dtype == dtype
        err = ((main.double() - expected).norm() / expected.norm()).item()
        print(dtype, err)
        assert err < (1e-6 if dtype == torch.float32 else 1e-2), (dtype, err)


@pytest.mark.parametrize("config", ["tiny_llama.yaml", "tiny_gpt2.yaml"])
def test_graphs_train_the_eager_run_to_the_last_bit(config, tmp_path):
    """One GPU, fp32, two micro-batches a step (each layer's graphs replayed twice a step): graphs on and off give the
    same losses, grad norms, weights and optimizer state."""
    common = dict(tp_degree=1, pp_degree=1, train_iters=5, num_micro_batches=2)
    on = train(config, tmp_path / "on", 1, **common)
    off = train(config, tmp_path / "off", 1, cuda_graphs=False, **common)
    print(f"\n{config} graphs {[m['loss'] for m in on]}\n{config} eager  {[m['loss'] for m in off]}")
    _exact(on, off)
    for kind in ("model", "optimizer"):
        assert_same_files(tmp_path / "on" / "checkpoint-5", tmp_path / "off" / "checkpoint-5", kind, 1, 1, 0.0)


def test_graphs_in_bf16_and_the_fused_accumulation_within_its_noise(tmp_path):
    """bf16 with fp32 masters: graphs change nothing; the fused accumulation (fp32 wgrad) stays within bf16's noise
    of the unfused one (wgrad rounded to bf16, then added), and the fp32 run is the referee of both."""
    common = dict(tp_degree=1, pp_degree=1, train_iters=6, num_micro_batches=2)
    on = train("tiny_llama.yaml", tmp_path / "on", 1, dtype="bf16", **common)
    off = train("tiny_llama.yaml", tmp_path / "off", 1, dtype="bf16", cuda_graphs=False, **common)
    unfused = train("tiny_llama.yaml", tmp_path / "unfused", 1, dtype="bf16", gradient_accumulation_fusion=False,
                    **common)
    fp32 = train("tiny_llama.yaml", tmp_path / "fp32", 1, **common)
    for name, run in (("graphs", on), ("eager", off), ("unfused", unfused), ("fp32", fp32)):
        print(f"\n{name:8s} {[round(m['loss'], 6) for m in run]}")
    _exact(on, off)
    assert [m["loss"] for m in on] != [m["loss"] for m in unfused]  # the fused path ran: its sums are not eager's
    assert_same_curve(fp32, on, 2e-2)
    assert_same_curve(fp32, unfused, 2e-2)
    fused_gap = max(abs(a["loss"] - b["loss"]) for a, b in zip(on, fp32))
    unfused_gap = max(abs(a["loss"] - b["loss"]) for a, b in zip(unfused, fp32))
    print(f"largest loss gap to fp32: fused {fused_gap:.2e}, unfused {unfused_gap:.2e}")


@_needs_gpus(2)
@pytest.mark.parametrize("distributed", [False, True], ids=["dp2", "dp2-distopt"])
def test_graphs_train_the_eager_run_on_two_gpus(distributed, tmp_path):
    """DP2, plain and with the distributed optimizer: the buckets reduced by the hooks the graphed backward feeds,
    the new weights gathered before each layer's graph: graphs on and off train the same run, fp32, to the last bit."""
    common = dict(tp_degree=1, pp_degree=1, train_iters=4, num_micro_batches=2, use_distributed_optimizer=distributed)
    on = train("tiny_llama.yaml", tmp_path / "on", 2, **common)
    off = train("tiny_llama.yaml", tmp_path / "off", 2, cuda_graphs=False, **common)
    print(f"\ndistributed={distributed} graphs {[m['loss'] for m in on]}\neager {[m['loss'] for m in off]}")
    _exact(on, off)
    assert_same_files(tmp_path / "on" / "checkpoint-4", tmp_path / "off" / "checkpoint-4", "model", 1, 1, 0.0)


@_needs_gpus(2)
@pytest.mark.parametrize("tp,pp,sequence_parallel", [(2, 1, False), (2, 1, True), (1, 2, False)],
                         ids=["tp2", "tp2-sp", "pp2"])
def test_graphs_train_the_eager_run_on_two_gpus_under_model_parallelism(tp, pp, sequence_parallel, tmp_path):
    """TP2, with and without sequence parallelism: the layers' all-reduces (or the gathers and reduce-scatters) are
    NCCL kernels inside the graphs. PP2 under 1F1B, 4 micro-batches a step: the first stage keeps 2 in flight and
    replays 2 copies of its graphs in turn. Graphs on and off train the same run, fp32, to the last bit."""
    micro_batches = 4 if pp > 1 else 2
    common = dict(tp_degree=tp, pp_degree=pp, train_iters=4, num_micro_batches=micro_batches,
                  sequence_parallelism=sequence_parallel)
    on = train("tiny_llama.yaml", tmp_path / "on", 2, **common)
    off = train("tiny_llama.yaml", tmp_path / "off", 2, cuda_graphs=False, **common)
    print(f"\ntp={tp} pp={pp} sp={sequence_parallel} graphs {[m['loss'] for m in on]}\neager {[m['loss'] for m in off]}")
    _exact(on, off, micro_batches=micro_batches)  # all 4 layers, both stages' (the counts are summed over PP)
    for kind in ("model", "optimizer"):
        assert_same_files(tmp_path / "on" / "checkpoint-4", tmp_path / "off" / "checkpoint-4", kind, tp, pp, 0.0)


def test_compiled_layers_train_the_eager_curve(tmp_path):
    """torch.compile'd layers (captured as graphs, the fused accumulation's matmuls left out of the compiled graphs)
    follow the eager layers' fp32 curve within the reordering of compiled elementwise code."""
    common = dict(tp_degree=1, pp_degree=1, train_iters=5, num_micro_batches=2)
    compiled = train("tiny_llama.yaml", tmp_path / "compiled", 1, compile=True, **common)
    eager = train("tiny_llama.yaml", tmp_path / "eager", 1, **common)
    print(f"\ncompiled {[m['loss'] for m in compiled]}\neager    {[m['loss'] for m in eager]}")
    assert compiled[0]["graphed_layers"] == 4 and compiled[-1]["graph_replays"] == 4 * 2 * 5
    assert_same_curve(eager, compiled, 1e-5)
