"""GPU-only: megatron-core's real GPTModel forward (CUDA) on the trainer's weights equals the
trainer's forward. Skipped without CUDA; run on a GPU machine (see docs/gpu.md)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import torchrun

pytestmark = pytest.mark.gpu
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "ernie4_5"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_megatron_core_forward_equals_trainer(tp, arch, dtype, tmp_path):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    out = tmp_path / "report.json"
    torchrun(tp, [str(Path(__file__).with_name("gpu_mcore_forward.py")), str(out), arch, dtype])
    for r in json.loads(out.read_text()):
        print(r)
        assert r["rel_l2"] < TOLERANCE[dtype], r
        assert r["top1_agreement_local_shard"] > (0.999 if dtype == "fp32" else 0.97), r


def _needs_gpus(n: int):
    return pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} CUDA GPUs")


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1-1gpu", "tp2-2gpus"])
def gpu_llama(request, tmp_path_factory):
    """tiny llama trained on GPUs (NCCL) at TP1 or TP2, bf16 weights with fp32 masters, and its HF merge."""
    from conftest import train

    from ckpt_tools.verbs.merge import merge
    tp = request.param
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} CUDA GPUs")
    save = tmp_path_factory.mktemp(f"gpu_tp{tp}") / "run"
    train("tiny_llama.yaml", save, tp, tp_degree=tp, pp_degree=1, dtype="bf16", train_iters=10, num_micro_batches=2)
    merge(save, save.parent / "hf", quiet=True)
    return tp, save, save.parent / "hf"


@_needs_gpus(1)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_verify_on_gpus_against_the_hf_merge(gpu_llama, dtype, tmp_path):
    import h5py
    from click.testing import CliRunner

    from ckpt_tools.cli import main
    tp, save, hf = gpu_llama
    report = tmp_path / "r.h5"
    res = CliRunner().invoke(main, ["verify", str(save), str(hf), "--device", "cuda", "--dtype", dtype,
                                    "--report", str(report)])
    print(res.output)
    assert res.exit_code == 0, res.output
    with h5py.File(report) as f:
        assert f["settings"].attrs["device"] == "cuda" and f["settings"].attrs["tp"] == tp
        t3 = dict(f["tier3"].attrs)
        print({k: t3[k] for k in ("rel_l2", "max_abs", "kl_mean", "top1", "top5")})
        assert t3["rel_l2"] < (1e-5 if dtype == "fp32" else 3e-2)


@_needs_gpus(2)
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_megatron_core_gptmodel_agrees_with_trainer_and_hf_merge(arch, tmp_path):
    """The real megatron-core GPTModel (CUDA) loaded from a checkpoint, the trainer's sharded model on
    the same checkpoint, and transformers on its HF merge: three implementations, one set of logits."""
    from conftest import sharded_logits, train
    from transformers import AutoModelForCausalLM

    from ckpt_tools.verbs.merge import merge
    save = tmp_path / "run"
    train(f"tiny_{arch}.yaml", save, 2, tp_degree=2, pp_degree=1, train_iters=4, num_micro_batches=2)
    ckpt = save / "checkpoint-4"
    merge(save, tmp_path / "hf", quiet=True)
    tokens = torch.randint(0, 1000, (2, 96), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, tmp_path / "tokens.pt")
    report, mcore_out = tmp_path / "report.json", tmp_path / "mcore_logits.pt"
    torchrun(2, [str(Path(__file__).with_name("gpu_mcore_forward.py")), str(report), arch, "fp32", str(ckpt),
                 str(tmp_path / "tokens.pt"), str(mcore_out)])
    mcore = torch.load(mcore_out)
    trainer = sharded_logits(ckpt, tokens, tmp_path, 2, 1)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        hf = model(tokens.cuda()).logits.float().cpu()
    pairs = {"mcore-trainer": (mcore, trainer), "mcore-hf": (mcore, hf), "trainer-hf": (trainer, hf)}
    for name, (a, b) in pairs.items():
        rel = float((a - b).norm() / b.norm())
        top1 = float((a.argmax(-1) == b.argmax(-1)).float().mean())
        print(f"{arch} {name}: rel L2 {rel:.2e}, max abs {float((a - b).abs().max()):.2e}, top-1 {top1:.2%}")
        assert rel < 1e-5 and top1 > 0.999, name


@_needs_gpus(2)
@pytest.mark.parametrize("config", ["tiny_llama.yaml", "tiny_gpt2.yaml"])
def test_sequence_parallel_follows_the_plain_curve(config, tmp_path):
    """TP2 (fp32, NCCL) with and without SP: norms (and GPT-2's row-parallel biases) see half the sequence
    and get their gradients summed over TP; everything else is the same computation."""
    from conftest import assert_same_curve, assert_same_files, train
    plain = train(config, tmp_path / "plain", 2, pp_degree=1, train_iters=4)
    sp = train(config, tmp_path / "sp", 2, pp_degree=1, train_iters=4, sequence_parallelism=True)
    print(f"\nSP vs plain, {config}: losses {[m['loss'] for m in sp]} vs {[m['loss'] for m in plain]}")
    assert_same_curve(plain, sp, 1e-4)
    assert_same_files(tmp_path / "plain" / "checkpoint-4", tmp_path / "sp" / "checkpoint-4", "model", 2, 1, 1e-4)


@_needs_gpus(2)
def test_gradient_buckets_reduced_during_backward_on_gpus(tmp_path):
    """DP2 on NCCL: buckets all-reduced or reduce-scattered while backward runs hold autograd's gradients summed over
    DP, and a short training run follows the same curve with the reduction overlapped or after backward."""
    from conftest import assert_same_curve, train
    for dtype in ("fp32", "bf16"):
        out = tmp_path / f"overlap_{dtype}.json"
        torchrun(2, ["tests/grad_overlap_check.py", str(out), dtype])
        for rank in json.loads(out.read_text()):
            gathers = rank.pop("param_gather")  # the weight all-gathers, watched in the next forward
            counts = gathers["waited_as_each_module_starts"]
            assert gathers["unwaited_after_step"] == gathers["buckets"] == gathers["waited"], gathers
            assert not gathers["early"] and counts[0] < counts[-1] == gathers["buckets"], gathers
            for mode, r in rank.items():
                print(dtype, mode, r)
                assert r["max_rel_l2"] < 1e-6, (dtype, mode, r)
                assert r["launched_during_backward"] == (r["overlapped_buckets"] if mode.endswith("overlap") else 0)
    common = dict(pp_degree=1, tp_degree=1, train_iters=4, ddp_bucket_size=5000)
    for distributed in (False, True):
        runs = [train("tiny_llama.yaml", tmp_path / f"d{distributed}o{overlap}", 2, overlap_grad_reduce=overlap,
                      use_distributed_optimizer=distributed, **common) for overlap in (False, True)]
        assert_same_curve(*runs, 1e-5)


@_needs_gpus(1)
def test_triton_adamw_equals_the_reference_update():
    """trainer.kernels.adamw (CUDA) against trainer.optim._adamw (torch ops, tested against torch's AdamW)."""
    from trainer import kernels
    from trainer.optim import _adamw
    gen = torch.Generator(device="cuda").manual_seed(0)
    n, decay_end = 1_000_003, 600_001
    start = torch.randn(n, device="cuda", generator=gen)
    a = [start.clone(), torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")]
    b = [t.clone() for t in a]
    wa, wb = (torch.zeros(n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for step in range(1, 5):
        grad = (torch.randn(n, device="cuda", generator=gen) * step).bfloat16()
        scale = torch.tensor(0.5 if step % 2 else 1.0, device="cuda")
        _adamw(*a, grad, wa, decay_end, 3e-3, step, scale, 0.9, 0.95, 1e-8, 0.1)
        kernels.adamw(*b, grad, wb, decay_end, 3e-3, step, scale, 0.9, 0.95, 1e-8, 0.1)
        for x, y in zip(a, b):
            assert torch.allclose(x, y, rtol=1e-5, atol=1e-7), (step, (x - y).abs().max().item())
        assert (wa.float() - wb.float()).abs().max().item() <= 2 ** -7 * wa.float().abs().max().item()
    print(f"\ntriton AdamW vs reference after 4 steps: max |master diff| {(a[0] - b[0]).abs().max().item():.2e}")



@_needs_gpus(1)
def test_megatron_core_resumes_from_our_torch_dist_optimizer_state(tmp_path):
    """megatron-core's DistributedOptimizer loads what `ckpt reshard --format torch_dist` writes (from its own
    dp_reshardable save, and from our trainer's checkpoint): the state is bit-identical, and training goes on
    exactly as the run that was never stopped; an HF import starts at transformers' loss (tests/mcore_resume.py)."""
    from conftest import train
    save = tmp_path / "ours"
    train("tiny_llama.yaml", save, 1, tp_degree=1, pp_degree=1, train_iters=3, num_micro_batches=2)
    torchrun(1, [str(Path(__file__).with_name("mcore_resume.py")), str(tmp_path / "out"), str(save)])
    tmp_path = tmp_path / "out"
    r = json.loads((tmp_path / "resume.json").read_text())
    assert r["optimizer"]["compared"] == 27 and not r["optimizer"]["missing"] and not r["optimizer"]["differ"], r
    assert r["resumed"] == r["reference"] == r["resumed_from_megatron_cores_own"], r
    assert abs(r["fresh_optimizer"][1] - r["reference"][1]) > 1e-2, r  # the control: the state matters
    assert r["ours"]["compared"] > 0 and not r["ours"]["missing"] and not r["ours"]["differ"], r
    assert abs(r["imported_loss"] - r["hf_loss"]) < 1e-4 * r["hf_loss"], r  # HF -> torch_dist: transformers' loss
    assert r["imported_training"][-1] < r["imported_training"][0], r


@pytest.mark.parametrize("tp,pp,vpp", [pytest.param(1, 1, 1, marks=_needs_gpus(2), id="dp2-2gpus"),
                                       pytest.param(2, 1, 1, marks=_needs_gpus(4), id="tp2xdp2-4gpus"),
                                       pytest.param(1, 2, 1, marks=_needs_gpus(4), id="pp2xdp2-4gpus"),
                                       pytest.param(1, 2, 2, marks=_needs_gpus(4), id="pp2xvpp2xdp2-4gpus")])
def test_megatron_core_resumes_data_parallel_runs_from_our_torch_dist_rewrite(tp, pp, vpp, tmp_path):
    """megatron-core's distributed optimizer at DP2 (and TP2 x DP2, PP2 x DP2 through its 1F1B schedule, PP2 x VPP2 x
    DP2 through its interleaved one): its dp_reshardable save, its buckets sharded over the data-parallel ranks,
    resharded by ckpt to another TP x PP (TP2 x PP2; TP1 x PP2; TP2 x PP1) and loaded back by megatron-core at the
    run's layout: the state bit-identical to its own fully_reshardable save, the losses the uninterrupted run's
    (tests/mcore_resume.py; the saves are fixtures/megatron_optimizer_dp)."""
    import os
    os.environ.update(MCORE_RESUME_TP=str(tp), MCORE_RESUME_PP=str(pp), MCORE_RESUME_VPP=str(vpp))
    try:
        torchrun(2 * tp * pp, [str(Path(__file__).with_name("mcore_resume.py")), str(tmp_path / "out")])
    finally:
        del os.environ["MCORE_RESUME_TP"], os.environ["MCORE_RESUME_PP"], os.environ["MCORE_RESUME_VPP"]
    r = json.loads((tmp_path / "out" / "resume.json").read_text())
    assert r["layout"] == {"tp": tp, "pp": pp, "dp": 2}, r
    assert r["optimizer"]["compared"] > 0 and not r["optimizer"]["missing"] and not r["optimizer"]["differ"], r
    assert not r["model"]["all"]["missing"] and not r["model"]["all"]["differ"], r
    assert r["resumed"] == r["reference"] == r["resumed_from_megatron_cores_own"], r
    assert abs(r["fresh_optimizer"][1] - r["reference"][1]) > 1e-2, r  # the control: the state matters


@_needs_gpus(1)
def test_megatron_core_hybrid_model_resumes_from_our_torch_dist_optimizer_state(tmp_path):
    """megatron-core 0.19's HybridModel (`*-*-`) with its DistributedOptimizer: its dp_reshardable save resharded by
    `ckpt reshard --format torch_dist` to TP2 x PP2 (a HybridModel's checkpoint still) loads into a fresh HybridModel
    with the optimizer state bit-identical to its own fully_reshardable save, and training goes on exactly as the run
    that was never stopped (tests/mcore_resume.py, MCORE_RESUME_MODEL=hybrid)."""
    import os

    import megatron.core
    if tuple(int(x) for x in megatron.core.__version__.split(".")[:2]) < (0, 19):
        pytest.skip(f"HybridModel is megatron-core 0.19's; this is {megatron.core.__version__}")
    os.environ["MCORE_RESUME_MODEL"] = "hybrid"
    try:
        torchrun(1, [str(Path(__file__).with_name("mcore_resume.py")), str(tmp_path / "out")])
    finally:
        del os.environ["MCORE_RESUME_MODEL"]
    r = json.loads((tmp_path / "out" / "resume.json").read_text())
    assert r["dst_pattern"] == "*-|*-", r  # TP2 x PP2: a segment per stage
    assert r["optimizer"]["compared"] > 0 and not r["optimizer"]["missing"] and not r["optimizer"]["differ"], r
    assert not r["model"]["all"]["missing"] and not r["model"]["all"]["differ"], r
    assert r["resumed"] == r["reference"] == r["resumed_from_megatron_cores_own"], r
    assert abs(r["fresh_optimizer"][1] - r["reference"][1]) > 1e-2, r  # the control: the state matters


@_needs_gpus(2)
def test_moe_expert_parallel_training_on_gpus(tmp_path):
    """Mixtral-shaped MoE on 2 GPUs (NCCL): EP2 over DP2 (experts split, tokens gathered and outputs
    reduce-scattered) trains the curve of every expert on every rank, in fp32 and bf16, and its EP2 checkpoint
    merges to a transformers Mixtral whose logits verify against the checkpoint."""
    from click.testing import CliRunner
    from conftest import train

    from ckpt_tools.cli import main
    from ckpt_tools.verbs.merge import merge
    moe = {"architecture": "mixtral", "num_moe_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01,
           "tp_degree": 1, "pp_degree": 1, "train_iters": 6, "num_micro_batches": 2}
    for dtype, tol in (("fp32", 1e-5), ("bf16", 2e-2)):
        ep2 = train("tiny_llama.yaml", tmp_path / f"ep2_{dtype}" / "save", 2, ep_degree=2, dtype=dtype, **moe)
        ep1 = train("tiny_llama.yaml", tmp_path / f"ep1_{dtype}" / "save", 2, ep_degree=1, dtype=dtype, **moe)
        print(dtype, [(a["loss"], b["loss"]) for a, b in zip(ep1, ep2)])
        assert ep1[-1]["loss"] < ep1[0]["loss"]
        assert all(abs(a["loss"] - b["loss"]) <= tol * abs(a["loss"]) for a, b in zip(ep1, ep2))
    save = tmp_path / "ep2_fp32" / "save"
    merge(save, tmp_path / "hf", quiet=True)
    res = CliRunner().invoke(main, ["verify", str(save), str(tmp_path / "hf"), "--device", "cuda"])
    print(res.output)
    assert res.exit_code == 0, res.output


@_needs_gpus(1)
def test_megatron_cores_moe_layer_trains_the_trainers_moe_curve_on_gpu(tmp_path):
    """`moe_layer: megatron_core` on a GPU (megatron-core's MoELayer, nothing patched but the router's reference to
    Transformer Engine's GEMM): the curve of the trainer's own MoE layer from the same weights, fp32 and bf16."""
    from conftest import train
    moe = {"architecture": "mixtral", "num_moe_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01,
           "tp_degree": 1, "pp_degree": 1, "train_iters": 6, "num_micro_batches": 2}
    for dtype, tol in (("fp32", 1e-5), ("bf16", 2e-2)):
        theirs = train("tiny_llama.yaml", tmp_path / f"mcore_{dtype}" / "save", 1, moe_layer="megatron_core",
                       dtype=dtype, **moe)
        ours = train("tiny_llama.yaml", tmp_path / f"ours_{dtype}" / "save", 1, dtype=dtype, **moe)
        print(dtype, [(a["loss"], b["loss"]) for a, b in zip(ours, theirs)])
        assert theirs[-1]["loss"] < theirs[0]["loss"]
        assert all(abs(a["loss"] - b["loss"]) <= tol * abs(a["loss"]) for a, b in zip(ours, theirs))


@_needs_gpus(2)
def test_megatron_cores_moe_layer_under_tensor_and_sequence_parallelism_on_gpus(tmp_path):
    """megatron-core's MoE layer at TP2 with sequence parallelism (each TP rank routes its part of the sequence, the
    router's gradients summed over TP) trains the TP1 curve."""
    from conftest import train
    moe = {"architecture": "mixtral", "num_moe_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01,
           "pp_degree": 1, "train_iters": 6, "num_micro_batches": 2, "moe_layer": "megatron_core", "dtype": "fp32"}
    tp2 = train("tiny_llama.yaml", tmp_path / "tp2" / "save", 2, tp_degree=2, sequence_parallelism=True, **moe)
    tp1 = train("tiny_llama.yaml", tmp_path / "tp1" / "save", 1, tp_degree=1, **moe)
    print([(a["loss"], b["loss"]) for a, b in zip(tp1, tp2)])
    assert all(abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]) for a, b in zip(tp1, tp2))


@_needs_gpus(1)
def test_grouped_expert_gemm_equals_the_expert_loop_on_gpu():
    """The trainer's grouped expert GEMM (torch._grouped_mm, bf16 on the GPU) against one matmul per expert in
    fp32: outputs, input gradients and each expert's weight gradient, an expert with no tokens getting zeros."""
    from trainer.moe import _GroupedLinear
    gen = torch.Generator().manual_seed(0)
    counts = [7, 0, 13, 4]
    x = torch.randn(sum(counts), 64, generator=gen).cuda().bfloat16().requires_grad_()
    weights = [torch.randn(128, 64, generator=gen).cuda().bfloat16().requires_grad_() for _ in counts]
    grad = torch.randn(sum(counts), 128, generator=gen).cuda().bfloat16()
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    y = _GroupedLinear.apply(x, offs, *weights)
    y.backward(grad)
    ends = [0, *offs.tolist()]
    xf, gf = x.detach().float(), grad.float()
    want = torch.cat([xf[a:b] @ w.detach().float().t() for a, b, w in zip(ends, ends[1:], weights)])
    want_dx = torch.cat([gf[a:b] @ w.detach().float() for a, b, w in zip(ends, ends[1:], weights)])
    rel = lambda a, b: ((a.float() - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(y, want) < 1e-2 and rel(x.grad, want_dx) < 1e-2
    for (a, b), w in zip(zip(ends, ends[1:]), weights):
        want_dw = gf[a:b].t() @ xf[a:b]
        assert (not w.grad.any()) if a == b else rel(w.grad, want_dw) < 1e-2
