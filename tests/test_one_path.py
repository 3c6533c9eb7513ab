"""Reshard and import as one path each (verbs/paths.py): one writer per target form over the source's bytes, or over
the source read through its torch reader (`copy_bytes=False`, and where the byte index declines). Our format written
by copying (verbs/ours_copy.py), a Megatron-LM optimizer's fields made by the form's torch reader, Megatron-FSDP's
fsdp_dtensor by the byte copies, an import cast into rank files: each holds what the source read through torch gives
the same writer. The independent references (megatron-core and Megatron-FSDP loading and resuming from these outputs)
are tests/test_megatron_write.py's, tests/test_gpu.py's and tests/test_megatron_fsdp_dtensor.py's.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import same_objects
from test_megatron_write import hf_dirs, whole_tensors  # noqa: F401 (hf_dirs: a fixture)
from test_megatron_write_bytes import HEAD, in_bf16, same_dist_checkpoints, same_legacy_files

from ckpt_tools.verbs.importer import import_hf
from ckpt_tools.verbs.request import Request
from ckpt_tools.verbs.reshard import reshard


# ------------------------------------------------------------ our format by copying the source's shards
def same_ours(fast, slow) -> None:
    """Two checkpoints of ours: the same files, every shard file's objects equal (tensors bit-exact in dtype and
    shape, the same keys in the same order), the RNG files' too, meta.json equal but for the files' hashes; every file
    of `fast` of the size and content hash its meta.json records."""
    a, b = (next(d.glob("checkpoint-*")) for d in (fast, slow))
    assert a.name == b.name and sorted(f.name for f in a.iterdir()) == sorted(f.name for f in b.iterdir())
    files = sorted(f.name for f in b.glob("*.bin")) + sorted(f.name for f in b.glob("rng_*"))
    assert files
    for name in files:
        same_objects(*(torch.load(d / name, weights_only=False) for d in (a, b)), name)
    ma, mb = (json.loads((d / "meta.json").read_text()) for d in (a, b))
    assert sorted(ma["files"]) == sorted(mb["files"])
    assert {k: v for k, v in ma.items() if k not in ("files", "checksum")} == \
        {k: v for k, v in mb.items() if k not in ("files", "checksum")}
    from ckpt_tools.forms.shards import open_checked
    open_checked(fast, None, True).close()


def _mixtral_ep(tmp_path):
    from bad_inputs import make_ckpt

    from ckpt_tools.model.spec import ModelSpec
    spec = ModelSpec("mixtral", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                     ffn_hidden_size=96, vocab_size=250, max_position_embeddings=128, num_moe_experts=4,
                     make_vocab_size_divisible_by=2)
    return make_ckpt(tmp_path / "src", spec, tp=2, pp=1)


def _tied(tmp_path):
    from bad_inputs import make_ckpt

    from ckpt_tools.model.spec import ModelSpec
    spec = ModelSpec("llama", num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=4,
                     ffn_hidden_size=128, vocab_size=256, max_position_embeddings=128, tie_word_embeddings=True)
    return make_ckpt(tmp_path / "src", spec, tp=1, pp=1)


def _fresh_masters(tmp_path, hf_dirs):
    src = in_bf16(hf_dirs["llama"], tmp_path / "hf", HEAD)
    import_hf(src, tmp_path / "src", tp=2, pp=2, quiet=True)
    return tmp_path / "src"


def _megatron_weights(tmp_path, hf_dirs):
    import_hf(hf_dirs["qwen3"], tmp_path / "src", tp=2, pp=2, form="torch_dist", quiet=True, optimizer=False)
    return tmp_path / "src"


OURS_COPIES = {  # source -> the targets it is resharded to (TP, PP, EP)
    "trained": [(1, 1, 1), (1, 3, 1)],
    "mixtral-ep": [(1, 2, 2), (1, 1, 1)],
    "tied": [(4, 2, 1)],
    "fresh-masters": [(1, 1, 1), (2, 1, 1)],
    "torch_dist-weights": [(1, 1, 1)],
}


@pytest.mark.parametrize("source,target", [(s, t) for s, ts in OURS_COPIES.items() for t in ts],
                         ids=[f"{s}-to-tp{t[0]}pp{t[1]}ep{t[2]}" for s, ts in OURS_COPIES.items() for t in ts])
def test_reshard_into_ours_by_copying_holds_what_the_torch_path_writes(source, target, llama_run, hf_dirs, tmp_path,
                                                                        monkeypatch):
    """`ckpt reshard` into our format without the torch path (verbs/ours_copy.reshard: the source's shards and
    optimizer fields cut to the target's files by the layout table's pieces, copied file to file or gathered in
    memory): our trainer's checkpoint with its optimizer and RNG files (to TP1, to an uneven PP3), an MoE one to
    expert parallelism and to TP1 (which trims its vocab padding, 252 -> 250 rows), a tied embedding to PP2 (the
    output layer's copy and its optimizer fields made from the embedding's), a fresh optimizer whose fp32 masters are
    written, and a Megatron-LM torch_dist of weights alone. Every file holds what the torch path writes, and the
    summary is its."""
    from ckpt_tools.forms.byte_ranges import ByteSource
    src = {"trained": lambda: llama_run[0], "mixtral-ep": lambda: _mixtral_ep(tmp_path),
           "tied": lambda: _tied(tmp_path),
           "fresh-masters": lambda: _fresh_masters(tmp_path, hf_dirs),
           "torch_dist-weights": lambda: _megatron_weights(tmp_path, hf_dirs)}[source]()
    tp, pp, ep = target
    layers = [1, 1, 2] if pp == 3 else None
    slow = reshard(src, tmp_path / "slow", tp=tp, pp=pp, ep=ep, layers=layers, quiet=True, copy_bytes=False)

    def declined(*args, **kwargs):
        raise AssertionError("the byte path declined the job: the source was read through torch")
    monkeypatch.setattr(ByteSource, "through", declined)
    fast = reshard(src, tmp_path / "fast", tp=tp, pp=pp, ep=ep, layers=layers, quiet=True)
    assert fast.replace("fast", "slow").split(", ")[:-2] == slow.split(", ")[:-2]
    same_ours(tmp_path / "fast", tmp_path / "slow")
    if source == "trained":
        assert "model + optimizer" in fast and list((tmp_path / "fast").glob("*/rng_*"))
    if source == "fresh-masters":
        assert "its masters that carry more written" in fast


def test_a_megatron_optimizer_left_behind_is_named_by_the_torch_reader(tmp_path):
    """A Megatron-LM source that holds optimizer state, resharded into our format with --no-optimizer: the byte copy
    declines it before writing anything, and the source is read through its torch reader, which says what is left
    behind; the output is the same weights the byte copy writes."""
    from ckpt_tools.verbs import paths
    src = Path(__file__).parent.parent / "fixtures" / "megatron_optimizer" / "plain" / "torch_dist"
    assert paths.by_bytes(src, tmp_path / "out", Request(1, 1, optimizer=False), vocab_size=120) is None
    assert not (tmp_path / "out").exists()
    line = reshard(src, tmp_path / "out", tp=1, pp=1, vocab_size=120, optimizer=False, quiet=True)
    assert "model only" in line, line
    reshard(src, tmp_path / "with", tp=1, pp=1, vocab_size=120, quiet=True)
    for name in ("pytorch_model_tp_0_pp_0.bin",):
        same_objects(*(torch.load(d / "checkpoint-3" / name, weights_only=True)
                        for d in (tmp_path / "out", tmp_path / "with")), name)


MEGATRON_OPTIMIZERS = [  # (source, target form): the forms' fixtures hold a short schedule that only ours takes
    *((f"megatron_optimizer/{s}", "ours") for s in ("plain/torch", "plain/torch_dist", "dist/torch", "dist/torch_dist",
                                                   "dist/torch_dist_full", "dist_buckets/torch",
                                                   "dist_buckets/torch_dist")),
    *((f"megatron_optimizer_dp/{run}/{s}", form) for run in ("tp2_dp2", "pp2_vpp2_dp2") for s in ("src", "src_legacy")
      for form in ("torch_dist", "ours")),
    ("megatron_torch_dcp/torch_dcp", "torch_dist"), ("megatron_torch_dcp/torch_dcp", "ours")]


@pytest.mark.parametrize("src,form", MEGATRON_OPTIMIZERS,
                         ids=[f"{s.split('/', 1)[1]}-to-{f}" for s, f in MEGATRON_OPTIMIZERS])
def test_a_megatron_optimizer_is_carried_with_its_fields_made_by_torch(src, form, tmp_path, monkeypatch):
    """megatron-core's own saves with their optimizer state (plain and distributed, every form it writes, GPU runs at
    TP2 x DP2 and PP2 x VPP2 x DP2 among them), resharded into torch_dist and our format: the weights copied as bytes,
    each optimizer field made by the form's torch reader, parameter by parameter (ByteSource.made_fields); the job
    never falls back whole to the torch path, and the output holds what the torch path writes (every chunk, every rank
    file's tensors, the step, param groups and schedule)."""
    from ckpt_tools.forms.byte_ranges import ByteSource
    src = Path(__file__).resolve().parent.parent / "fixtures" / src
    tp, pp = (1, 1) if form == "torch_dist" else (2, 2)
    asked = {"form": form} if form != "ours" else {}
    slow = reshard(src, tmp_path / "slow", tp=tp, pp=pp, vocab_size=120, quiet=True, copy_bytes=False, **asked)

    def declined(*args, **kwargs):
        raise AssertionError("the byte path declined the job: the source was read through torch")
    monkeypatch.setattr(ByteSource, "through", declined)
    fast = reshard(src, tmp_path / "fast", tp=tp, pp=pp, vocab_size=120, quiet=True, **asked)
    assert "model + optimizer" in fast and fast.replace("fast", "slow").split(", ")[:-2] == slow.split(", ")[:-2]
    if form == "ours":
        same_ours(tmp_path / "fast", tmp_path / "slow")
        return
    iteration = next(tmp_path.glob("fast/iter_*")).name
    same_dist_checkpoints(tmp_path / "fast" / iteration, tmp_path / "slow" / iteration, tmp_path)


def same_dcp_files(a, b, scratch) -> None:
    """Two torch.distributed.checkpoint dirs holding the same entries (torch's own reader, whole): tensors bit-exact
    in dtype and shape, the other entries (args compared as dicts) equal."""
    x, y = whole_tensors(a, scratch / "a.pt"), whole_tensors(b, scratch / "b.pt")
    assert sorted(x) == sorted(y)
    for name, t in x.items():
        if torch.is_tensor(t):
            assert y[name].dtype == t.dtype and y[name].shape == t.shape and torch.equal(y[name], t), name
        elif hasattr(t, "__dict__"):
            assert vars(t) == vars(y[name]), name
        else:
            assert t == y[name], name


FSDP_SOURCES = ["trained", "megatron_optimizer_dp/tp2_dp2/src", "megatron_optimizer_dp/dp2/src_legacy", "hf"]


@pytest.mark.parametrize("source", FSDP_SOURCES)
def test_fsdp_dtensor_written_by_copying_holds_what_the_torch_path_writes(source, llama_run, hf_dirs, tmp_path,
                                                                           monkeypatch):
    """Megatron-FSDP's fsdp_dtensor is written by the byte copies too (the torch_dist writer's chunks under the
    model's own keys, a SwiGLU fc1 as its halves, the fp32 masters as the model entries when the optimizer is carried):
    our trainer's checkpoint and megatron-core's GPU-saved distributed optimizers with their optimizer state, an HF
    model imported. Every entry (tensors, Adam's steps, param group settings, the schedule, the args) is what the torch
    path writes."""
    from ckpt_tools.forms.byte_ranges import ByteSource
    from ckpt_tools.verbs import hf_copy

    def declined(*args, **kwargs):
        raise AssertionError("the byte path declined the job: the source was read through torch")
    if source == "hf":
        import_hf(hf_dirs["llama"], tmp_path / "slow", tp=1, pp=1, form="fsdp_dtensor", quiet=True, copy_bytes=False)
        monkeypatch.setattr(hf_copy, "start_through", declined)
        import_hf(hf_dirs["llama"], tmp_path / "fast", tp=1, pp=1, form="fsdp_dtensor", quiet=True)
    else:
        src = llama_run[0] if source == "trained" else Path(__file__).resolve().parent.parent / "fixtures" / source
        vocab = None if source == "trained" else 120
        slow = reshard(src, tmp_path / "slow", tp=1, pp=1, vocab_size=vocab, form="fsdp_dtensor", quiet=True,
                       copy_bytes=False)
        monkeypatch.setattr(ByteSource, "through", declined)
        fast = reshard(src, tmp_path / "fast", tp=1, pp=1, vocab_size=vocab, form="fsdp_dtensor", quiet=True)
        assert "model + optimizer" in fast and fast.replace("fast", "slow").split(", ")[:-2] == slow.split(", ")[:-2]
    iteration = next(tmp_path.glob("fast/iter_*")).name if source != "hf" else "release"
    same_dcp_files(tmp_path / "fast" / iteration, tmp_path / "slow" / iteration, tmp_path)


@pytest.mark.parametrize("arch,form", [("llama", "torch"), ("llama", "ours"), ("gpt2", "ours"), ("qwen3_next", "ours")])
def test_an_import_cast_into_rank_files_is_a_byte_copy_of_each_ranks_shard_cast(arch, form, hf_dirs, tmp_path,
                                                                                  monkeypatch):
    """`ckpt import --dtype bfloat16` of an fp32 HF model into the legacy form and our format: every tensor made by
    torch, each rank's shard cast alone (the cast is element by element), written by the byte path; the rank files
    hold what the torch path writes, the fresh optimizer's fp32 masters (which carry more than bf16 weights) too."""
    from ckpt_tools.verbs import hf_copy
    asked = {"form": "torch"} if form == "torch" else {}
    import_hf(hf_dirs[arch], tmp_path / "slow", tp=2, pp=2, quiet=True, copy_bytes=False, dtype=torch.bfloat16,
              **asked)

    def declined(*args, **kwargs):
        raise AssertionError("the byte path declined the job: the source was read through torch")
    monkeypatch.setattr(hf_copy, "start_through", declined)
    import_hf(hf_dirs[arch], tmp_path / "fast", tp=2, pp=2, quiet=True, dtype=torch.bfloat16, **asked)
    if form == "torch":
        same_legacy_files(tmp_path / "fast", tmp_path / "slow", 4)
    else:
        assert list((tmp_path / "slow" / "checkpoint-0").glob("optimizer_*"))  # the fp32 masters written
        same_ours(tmp_path / "fast", tmp_path / "slow")
