"""Sequence parallelism, activation recompute and the distributed optimizer change how the trainer
computes, not what: each run follows the plain run's loss curve (fp32, CPU, gloo) and saves the same
on-disk format, which resumes across the features and DP sizes."""
from __future__ import annotations

import json

import pytest

from conftest import assert_same_curve, assert_same_files, torchrun, train

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("tp", [1, 2])
def test_vocab_parallel_loss_equals_megatron_and_torch(tp, tmp_path):
    out = tmp_path / "loss.json"
    torchrun(tp, ["tests/loss_check.py", str(out)])
    for r in json.loads(out.read_text()):
        # both compute in fp32 (the reference in fp64)
        assert abs(r["ours"] - r["torch"]) < 1e-6 * r["torch"] and abs(r["ours"] - r["megatron"]) < 1e-6 * r["torch"], r
        assert r["grad_vs_torch"] < 1e-6 * r["grad_max"] and r["grad_vs_megatron"] < 1e-6 * r["grad_max"], r


def test_sequence_parallel_on_cpu_is_a_one_line_error(tmp_path):
    proc = torchrun(2, ["-m", "trainer", "--config", "fixtures/configs/tiny_llama.yaml", "--set", f"save_dir={tmp_path}/r",
                        "--set", "pp_degree=1", "--set", "sequence_parallelism=true"], check=False)
    assert proc.returncode != 0
    assert "error (rank 0): sequence_parallelism needs CUDA GPUs" in proc.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("granularity", ["selective", "full"])
def test_recompute_gives_the_same_training(granularity, tmp_path):
    plain = train("tiny_llama.yaml", tmp_path / "plain", 1, tp_degree=1, pp_degree=1, train_iters=3)
    recomputed = train("tiny_llama.yaml", tmp_path / "recompute", 1, tp_degree=1, pp_degree=1, train_iters=3,
                       recompute_granularity=granularity)
    assert [(m["loss"], m["grad_norm"]) for m in plain] == [(m["loss"], m["grad_norm"]) for m in recomputed]


def test_distributed_optimizer_follows_the_plain_curve_and_resumes_both_ways(tmp_path):
    """TP2 x DP2 (4 ranks): the sharded optimizer's curve and saved state equal the plain one's; a
    checkpoint of either resumes in the other (also at another DP size) on the same curve."""
    common = dict(pp_degree=1, train_iters=6, save_interval=3)
    plain = train("tiny_llama.yaml", tmp_path / "plain", 4, **common)
    # the sharded run in buckets of 5,000 elements, each reduce-scattered during backward; the plain run in one
    sharded = train("tiny_llama.yaml", tmp_path / "sharded", 4, use_distributed_optimizer=True, ddp_bucket_size=5000,
                    **common)
    assert_same_curve(plain, sharded, 1e-5)  # the fp32 grad norm sums in another order: ~1e-6 apart
    a, b = tmp_path / "plain" / "checkpoint-3", tmp_path / "sharded" / "checkpoint-3"
    assert_same_files(a, b, "optimizer", 2, 1, 1e-6)
    assert_same_files(a, b, "model", 2, 1, 1e-6)
    meta = json.loads((b / "meta.json").read_text())
    assert meta["parallel"]["dp_size"] == 2
    # the sharded checkpoint resumed by the plain optimizer at DP1 (twice the micro-batches) ...
    to_plain = train("tiny_llama.yaml", tmp_path / "to_plain", 2, pp_degree=1, train_iters=6,
                     num_micro_batches=8, load=str(b))
    assert_same_curve(sharded[3:], to_plain, 1e-5)
    # ... and the plain one by the sharded optimizer at DP2
    to_sharded = train("tiny_llama.yaml", tmp_path / "to_sharded", 4, pp_degree=1, train_iters=6,
                       use_distributed_optimizer=True, load=str(a))
    assert_same_curve(plain[3:], to_sharded, 1e-5)


def test_distributed_optimizer_under_pipeline_recompute_and_tied_embeddings_follows_the_plain_curve(tmp_path):
    """PP2 x DP2 (4 ranks), gpt2 (tied embeddings: the last stage's output copy), full recompute: the distributed
    optimizer leaves its weight all-gathers running into the pipeline schedule's forwards; its curve is the plain
    optimizer's."""
    common = dict(tp_degree=1, pp_degree=2, train_iters=3, recompute_granularity="full", ddp_bucket_size=5000)
    plain = train("tiny_gpt2.yaml", tmp_path / "plain", 4, **common)
    sharded = train("tiny_gpt2.yaml", tmp_path / "sharded", 4, use_distributed_optimizer=True, **common)
    assert_same_curve(plain, sharded, 1e-5)


def test_fp32_gradient_accumulation_sums_each_bf16_micro_batch_gradient_in_fp32(tmp_path):
    """bf16 weights, 32 micro-batches: the fp32 buffer holds exactly the fp32 sum of autograd's per-micro-batch
    bf16 gradients, and lies closer to the fp32 model's gradient than bf16 accumulation does."""
    out = tmp_path / "grad.json"
    torchrun(1, ["tests/grad_accum_check.py", str(out)])
    r = json.loads(out.read_text())
    assert r["fp32_buffer_equals_hand_sum"], r
    assert r["rel_error_fp32_accumulation"] < r["rel_error_bf16_accumulation"], r


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gradient_buckets_reduced_during_backward_equal_autograds_sum_over_dp(dtype, tmp_path):
    """DP2, buckets of 3,000 elements, 2 micro-batches: plain and distributed optimizer, overlap on and off. With
    overlap every bucket but the deferred one (norms) is launched before backward returns, and only after the last
    micro-batch's gradient is in; every parameter's reduced gradient equals autograd's, summed over DP by hand. The
    distributed optimizer's weight all-gathers still run after its step, and each is waited for before the next
    forward's first module that uses its weights."""
    out = tmp_path / "overlap.json"
    torchrun(2, ["tests/grad_overlap_check.py", str(out), dtype])
    for rank in json.loads(out.read_text()):
        gathers = rank.pop("param_gather")  # the distributed optimizer's weight all-gathers, watched in a forward
        assert gathers["unwaited_after_step"] == gathers["buckets"] == gathers["waited"], gathers
        assert not gathers["early"], gathers  # no module ran before its weights' all-gathers were waited for
        counts = gathers["waited_as_each_module_starts"]  # each only then: the rest still running
        assert counts == sorted(counts) and counts[0] < counts[-1] == gathers["buckets"], gathers
        for mode, r in rank.items():
            assert r["equal_to_reference"], (mode, r)
            assert r["buckets"] > 10 and r["overlapped_buckets"] == r["buckets"] - 1, (mode, r)
            expected = r["overlapped_buckets"] if mode.endswith("overlap") else 0
            assert r["launched_during_backward"] == expected, (mode, r)


@pytest.mark.parametrize("config", ["tiny_llama.yaml", "tiny_gpt2.yaml"])
def test_bf16_pipeline_with_fp32_accumulation_follows_the_unpipelined_curve(config, tmp_path):
    """PP2's schedule divides `.grad` by the micro-batches; the fp32 buffer must be divided too (a missed
    division shows as a 4x grad norm). gpt2 ties its embeddings: the two stages' copies sum their fp32 buffers."""
    common = dict(dtype="bf16", tp_degree=1, train_iters=3)
    unpipelined = train(config, tmp_path / "pp1", 1, pp_degree=1, **common)
    pipelined = train(config, tmp_path / "pp2", 2, pp_degree=2, **common)
    assert_same_curve(unpipelined, pipelined, 1e-3)


def test_bf16_distributed_optimizer_reduce_scatters_the_fp32_buffer(tmp_path):
    """DP2, bf16 weights: the distributed optimizer (reduce-scatter of the fp32 buffer, padded to DP x chunk)
    follows the plain optimizer (all-reduce of it)."""
    common = dict(dtype="bf16", tp_degree=1, pp_degree=1, train_iters=3)
    plain = train("tiny_llama.yaml", tmp_path / "plain", 2, **common)
    sharded = train("tiny_llama.yaml", tmp_path / "sharded", 2, use_distributed_optimizer=True, **common)
    assert_same_curve(plain, sharded, 1e-3)
