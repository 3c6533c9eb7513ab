"""Megatron-LM optimizer state, as megatron-core's own optimizers wrote it after 3 real steps on a GPU
(fixtures/megatron_optimizer/, made by tests/mcore_optimizer_checkpoints.py): every form decodes to megatron-core's
own per-parameter state bit for bit, `reshard` carries it into our layout, `merge --from-master-weights` writes its
fp32 masters. The fixtures' reference.pt holds what megatron-core's optimizer object itself held, and its
grad-buffer layout.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from bad_inputs import assert_no_out, error_line, invoke
from safetensors.torch import load_file

from ckpt_tools.forms import megatron_lm as mlm
from ckpt_tools.forms import megatron_optim as mo
from ckpt_tools.forms.shards import open_checkpoint
from ckpt_tools.model import layout
from ckpt_tools.model.ranks import Rank

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "megatron_optimizer"
VOCAB = 120
FIELDS = ("master", "exp_avg", "exp_avg_sq")
FORMS = ["plain/torch", "plain/torch_dist", "dist/torch", "dist/torch_dist", "dist/torch_dist_full",
         "dist_buckets/torch", "dist_buckets/torch_dist"]
IDS = ["plain-legacy", "plain-torch_dist", "distrib_optim.pt", "dp_reshardable", "fully_reshardable",
       "distrib_optim.pt-buckets", "dp_reshardable-buckets"]


def reference(form: str) -> dict:
    return torch.load(FIXTURES / form.split("/")[0] / "reference.pt", weights_only=False)


def assert_state_equals_reference(reader, ref: dict) -> int:
    """Every parameter's master, exp_avg, exp_avg_sq and step equal megatron-core's, bit for bit."""
    compared = 0
    for key in reader.keys():
        if layout.find_rule(key, reader.meta.spec, reader.meta.pp_size).split == layout.EXTRA:
            continue
        for field in FIELDS:
            got, want = reader.full(key, field), ref[key][field]
            assert got.dtype == torch.float32 and torch.equal(got, want), (key, field)
            compared += 1
        assert float(reader.shards(key, "step")[0]) == float(ref[key]["step"]) == 3.0, key
        reader.release()
    return compared


@pytest.mark.parametrize("form", FORMS, ids=IDS)
def test_every_form_decodes_to_megatron_cores_state(form):
    reader = open_checkpoint(FIXTURES / form, VOCAB)
    assert reader.has_optimizer() and reader.unread_optimizer() is None
    assert assert_state_equals_reference(reader, reference(form)) == 15 * 3


@pytest.mark.parametrize("variant", ["dist", "dist_buckets"])
def test_buffer_layout_is_megatron_cores(variant):
    """The grad-buffer layout recomputed from the parameter list and args equals megatron-core's own."""
    path = mlm.model_path(FIXTURES / variant / "torch" / "iter_0000003", Rank(0, 0), 1)
    obj = torch.load(path, weights_only=False, map_location="cpu")
    params = mo.params_of(mlm.model_state(obj), set())
    dp = mo.dp_size_of(obj["args"])
    found = mo.buffer_layout(params, dp, mo.bucket_size_of(obj["args"], 0, dp))
    theirs = reference(variant)["_buffers"]
    assert len(theirs) == 1
    assert {k: list(v) for k, v in found.where.items()} == theirs[0]["params"]
    assert [[a, b] for a, b, _ in found.buckets] == theirs[0]["buckets"]
    assert len(found.buckets) == (6 if variant == "dist_buckets" else 1)


@pytest.mark.parametrize("form", ["plain/torch", "dist/torch_dist", "dist_buckets/torch"],
                         ids=["plain-legacy", "dp_reshardable", "distrib_optim.pt-buckets"])
def test_reshard_carries_the_optimizer_into_our_layout(form, tmp_path):
    out = tmp_path / "ours"
    result = invoke("reshard", FIXTURES / form, out, "--tp", 2, "--pp", 2, "--vocab-size", VOCAB, "--quiet")
    assert result.exit_code == 0 and "model + optimizer" in result.output, result.output
    ours = open_checkpoint(out)
    assert ours.meta.tp_size == 2 and ours.has_optimizer()
    ref = reference(form)
    for key in ours.keys():  # the vocab tensors are re-padded for TP2: compare the true rows
        if layout.find_rule(key, ours.meta.spec, 2).split == layout.EXTRA:
            continue
        for field in FIELDS:
            got, want = ours.full(key, field), ref[key][field]
            rows = VOCAB if layout.find_rule(key, ours.meta.spec, 2).split == layout.VOCAB else want.shape[0]
            assert torch.equal(got[:rows], want[:rows]), (key, field)


@pytest.mark.parametrize("form", ["plain/torch_dist", "dist/torch"], ids=["plain-torch_dist", "distrib_optim.pt"])
def test_merge_from_master_weights(form, tmp_path):
    out = tmp_path / "masters.safetensors"
    result = invoke("merge", FIXTURES / form, out, "--format", "safetensors", "--from-master-weights",
                    "--vocab-size", VOCAB, "--quiet")
    assert result.exit_code == 0, result.output
    merged, ref = load_file(out), reference(form)
    assert merged and all(torch.equal(t, ref[k]["master"][: t.shape[0]]) for k, t in merged.items())
    assert merged["embedding.word_embeddings.weight"].shape[0] == VOCAB


def _args_edit(src: Path, change) -> None:
    """Re-save the args of every file that holds them (a run's args that do not describe its buffers)."""
    for path in list(src.rglob("model_optim_rng.pt")) + list(src.rglob("common.pt")):
        obj = torch.load(path, weights_only=False, map_location="cpu")
        change(obj["args"])
        torch.save(obj, path)


def test_buckets_that_the_args_do_not_describe_are_refused(tmp_path):
    """dp_reshardable keeps each bucket apart: args that say one bucket where there were six are refused."""
    src = Path(shutil.copytree(FIXTURES / "dist_buckets/torch_dist", tmp_path / "src"))
    _args_edit(src, lambda a: setattr(a, "overlap_grad_reduce", False))
    out = tmp_path / "out"
    line = error_line(invoke("reshard", src, out, "--tp", 1, "--pp", 1, "--vocab-size", VOCAB))
    assert "has 6 bucket(s)" in line, line
    assert "the optimizer state cannot be mapped" in line, line
    assert_no_out(out)


def _flat_edit(src: Path, change) -> None:
    path = next(src.rglob("distrib_optim.pt"))
    obj = torch.load(path, weights_only=False)
    change(obj[0][(torch.bfloat16, torch.float32)])
    torch.save(obj, path)


@pytest.mark.parametrize("change,expected", [
    (lambda s: s.__setitem__("numel_unpadded", s["numel_unpadded"] - 64), "elements, the model's grad-buffer layout"),
    (lambda s: s["param"].__setitem__(4128, 1.0), "alignment gap"),  # between final_layernorm and linear_fc2
    (lambda s: s["param"].__setitem__(100, s["param"][100] + 1.0), "does not round to the weight"),
    (lambda s: s.__setitem__("exp_avg", s["exp_avg"][:-1]), "expected fp32 of"),
], ids=["numel", "data-in-a-gap", "a-master-moved", "a-field-short"])
def test_a_distrib_optim_file_that_does_not_fit_the_model_is_refused(change, expected, tmp_path):
    src = Path(shutil.copytree(FIXTURES / "dist_buckets/torch", tmp_path / "src"))
    _flat_edit(src, change)
    out = tmp_path / "out"
    line = error_line(invoke("reshard", src, out, "--tp", 1, "--pp", 1, "--vocab-size", VOCAB))
    assert "distrib_optim.pt" in line and expected in line and "cannot be mapped" in line, line
    assert_no_out(out)


@pytest.mark.parametrize("form", ["plain/torch", "dist/torch"], ids=["plain-legacy", "distrib_optim.pt"])
def test_gpu_saved_legacy_files_merge_torch_free(form, tmp_path):
    """Files saved on a GPU hold CUDA storages and masters with Python attributes: the torch-free path reads them
    and writes the torch path's bytes."""
    from test_merge_sources import assert_same_as_torch
    assert_same_as_torch(FIXTURES / form, tmp_path, vocab_size=VOCAB)


def test_the_parameter_order_is_proven_by_the_weights(tmp_path):
    """torch_dist does not say which spec trained the model, and a Transformer Engine layer orders its parameters
    otherwise; args that name the other spec are tried first and disproven by the weights, then the right order is
    taken: still megatron-core's state, bit for bit."""
    src = Path(shutil.copytree(FIXTURES / "dist_buckets/torch_dist", tmp_path / "src"))
    _args_edit(src, lambda a: setattr(a, "transformer_impl", "transformer_engine"))
    assert_state_equals_reference(open_checkpoint(src, VOCAB), reference("dist_buckets/torch_dist"))


@pytest.mark.parametrize("change,expected", [
    (lambda o: o["optimizer"]["fp32_from_fp16_params"][0].pop(), "fp32 masters for"),
    (lambda o: o["optimizer"].pop("fp32_from_fp16_params"), "the fp32 masters are missing"),
    (lambda o: o["optimizer"]["fp32_from_fp16_params"][0].reverse(), "is not the weight"),
    (lambda o: o["optimizer"]["optimizer"]["param_groups"].reverse(), "fp32 masters for"),
], ids=["a-master-short", "no-masters", "masters-shuffled", "groups-swapped"])
def test_a_plain_optimizer_that_does_not_fit_the_model_is_refused(change, expected, tmp_path):
    src = Path(shutil.copytree(FIXTURES / "plain/torch", tmp_path / "src"))
    path = next(src.rglob("model_optim_rng.pt"))
    obj = torch.load(path, weights_only=False, map_location="cpu")
    change(obj)
    torch.save(obj, path)
    out = tmp_path / "out"
    line = error_line(invoke("reshard", src, out, "--tp", 1, "--pp", 1, "--vocab-size", VOCAB))
    assert expected in line and "model_optim_rng.pt" in line, line
    assert_no_out(out)


DP_FIXTURES = FIXTURES.parent / "megatron_optimizer_dp"


@pytest.mark.parametrize("run,form", [(run, form) for run in ("dp2", "tp2_dp2", "pp2_dp2") for form in ("src", "src_legacy")]
                         + [("pp2_vpp2_dp2", "src"), ("pp2_vpp2_dp2", "src_legacy")],  # an interleaved pipeline
                         ids=lambda x: {"src": "dp_reshardable", "src_legacy": "distrib_optim.pt"}.get(x, x))
def test_data_parallel_runs_optimizer_state_is_megatron_cores_own(run, form, tmp_path):
    """The distributed optimizer's state as megatron-core shards it over DP, saved by real multi-GPU runs
    (`scripts/gpu_dp_resume.sh`: DP2 on 2 GPUs, TP2 x DP2 and PP2 x DP2 on 4; docs/gpu.md) in torch_dist's default
    dp_reshardable form (buckets sharded over the DP ranks) and the legacy form (distrib_optim.pt, gathered over DP):
    resharded by ckpt to TP1 x PP1, every fp32 master and Adam moment is bit for bit what megatron-core itself saved of
    the same optimizer in its fully_reshardable form, read by torch's own DCP reader. (On the GPUs, megatron-core
    resumed from ckpt's torch_dist rewrite of the first on the uninterrupted run's losses.) An interleaved pipeline
    (PP2 x VPP2 x DP2, 4 layers: each model chunk its own grad buffer, `gbuf_idx_<chunk>`, bucketed on the first chunk
    only; in the legacy form each rank file's `model<chunk>` and a distrib_optim.pt of a grad buffer per chunk) reads
    the same way, as PP x VPP model chunks."""
    from mcore_resume import full_tensors, same_as_ours

    from ckpt_tools.verbs.reshard import reshard
    src = DP_FIXTURES / run / form
    meta = open_checkpoint(src, VOCAB).meta  # the legacy reader's stages of an interleaved pipeline: its chunks
    assert (meta.tp_size, meta.pp_size) == {"dp2": (1, 1), "tp2_dp2": (2, 1), "pp2_dp2": (1, 2),
                                            "pp2_vpp2_dp2": (1, 4 if form == "src_legacy" else 2)}[run]
    reshard(src, tmp_path / "ours", tp=1, pp=1, vocab_size=VOCAB, quiet=True)
    reference = full_tensors(DP_FIXTURES / run / "ref_src" / "iter_0000003", tmp_path / "ref.pt")
    result = same_as_ours(tmp_path / "ours", reference, tied=False)
    # 15 tensors (2 layers of 6, the norm, embedding and output layer; 27 with 4 layers) x 3 fields
    assert result["compared"] == (81 if "vpp" in run else 45), result
    assert not result["missing"] and not result["differ"], result
    assert result["step"] == 3.0
