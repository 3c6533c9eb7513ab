"""Checkpoints as Megatron-LM's own training code writes them, not as our fixture scripts assemble them:
- legacy models (`--use-legacy-models`: `language_model.*`, `query_key_value`, `dense_h_to_4h`, ...), saved by
  Megatron-LM's own legacy GPTModel (fixtures/megatron_legacy, tests/legacy_megatron_checkpoints.py, Megatron-LM
  core_v0.16.1, the last release with that code);
- megatron-core GPTModels saved by Megatron-LM's own `save_checkpoint` in both forms (fixtures/megatron_save,
  tests/megatron_lm_save.py): with the rng_state, rerun state and content metadata it adds itself;
- megatron-core 0.19.2's GPTModel and HybridModel with Transformer Engine's layers, saved on a GPU
  (fixtures/megatron_te): what a Megatron-LM run saves by default.
Merged to HF, transformers' forward gives the saving model's own logits; every path and layout gives the same bytes.
Their args hold what real Megatron-LM args hold beside plain values (AttnBackend, ModelType, signal.Signals), read
inertly.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_reshard import assert_nothing_written, one_line_error, run

from ckpt_tools.verbs.merge import TENSORS, merge
from ckpt_tools.verbs.reshard import reshard

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "megatron_legacy"
SAVES = Path(__file__).resolve().parent.parent / "fixtures" / "megatron_save"
NEWEST = Path(__file__).resolve().parent.parent / "fixtures" / "megatron_019"
# Llama-style (RMSNorm, rope, SwiGLU, GQA, untied) at TP2; GPT-2-style (tied) at PP2; save_checkpoint's two forms;
# megatron-core 0.19.2's own saves (tests/mcore_newest.py: GPTModel and HybridModel, the common state embedded);
# an interleaved pipeline's (megatron-core 0.16.1's model chunks, `model0`/`model1` per legacy file)
VPP = Path(__file__).resolve().parent.parent / "fixtures" / "megatron_vpp"  # tests/mcore_vpp.py: PP2 x VPP2
# (a save without megatron-core's logits, the Mamba hybrid's, whose forward needs GPU kernels, is proven against
# megatron-core's own shards instead: tests/test_megatron_019_hybrid.py)
# megatron-core 0.19.2's saves of its Transformer Engine models on a GPU (tests/mcore_te.py, tests/gpu_te.sh): fused
# norms, every linear's and norm's `_extra_state` (FP8 scales and amax histories in the fp8 case), the legacy files'
# tensors on the GPU
TE = Path(__file__).resolve().parent.parent / "fixtures" / "megatron_te"
CASES = [FIXTURES / "llama_tp2", FIXTURES / "gpt_pp2", SAVES / "torch_dist", SAVES / "torch"] + sorted(
    form for model in [*NEWEST.iterdir(), VPP, *TE.iterdir()] for form in (model / "torch_dist", model / "torch")
    if form.is_dir() and (model / "reference.pt").is_file())
VOCAB = 127


def same_files(a: Path, b: Path) -> None:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)


IDS = [f"{'te-' if c.parent.parent == TE else ''}{c.parent.name}-{c.name}" for c in CASES]  # megatron_te's prefixed


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_megatron_lm_saves_merge_to_their_own_logits(case, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM
    if case.parent.parent == NEWEST and case.name == "torch_dist":
        assert not list(case.glob("iter_*/common.pt"))  # megatron-core 0.19 embeds the common state
    merge(case, tmp_path / "hf", vocab_size=VOCAB, quiet=True)
    reference = torch.load(case / "reference.pt" if (case / "reference.pt").is_file() else case.parent / "reference.pt",
                           weights_only=True)
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()(
            reference["tokens"]).logits
    expected = reference["logits"][..., :VOCAB]
    # Transformer Engine's fp32 forward on the GPU is itself 2.8e-5 (GPT-2) to 2.0e-4 (relative) from the same
    # weights' float64 forward (measured; transformers' fp32 forward 2e-7): its saves are held to 1e-3 here. Their
    # weights are exact:
    # megatron-core's Transformer Engine model loads the merged-and-imported weights on the GPU and gives the saved
    # model's logits with no difference (tests/gpu_te.sh, docs/format.md)
    tolerance = 1e-3 if case.parent.parent == TE else 1e-5
    assert ((logits - expected).norm() / expected.norm()).item() < tolerance
    monkeypatch.setenv("CKPT_MERGE_TORCH", "1")  # the torch path gives the torch-free path's bytes
    merge(case, tmp_path / "torch", vocab_size=VOCAB, quiet=True)
    same_files(tmp_path / "hf", tmp_path / "torch")
    monkeypatch.delenv("CKPT_MERGE_TORCH")
    reshard(case, tmp_path / "ours", tp=1, pp=1, vocab_size=VOCAB, quiet=True)  # and via our format
    merge(tmp_path / "ours", tmp_path / "again", quiet=True)
    same_files(tmp_path / "hf", tmp_path / "again")


def _as_version(src: Path, dst: Path, version: float, heads: int, head_dim: int) -> Path:
    """A copy whose fused QKV rows are in the order an older checkpoint_version saved them, per TP rank (the
    inverse of what Megatron-LM's fix_query_key_value_ordering undoes): 0 [3, np, hn], 1.0 [np, hn, 3]."""
    shutil.copytree(src, dst)
    for path in sorted(dst.glob("iter_*/mp_rank_*/model_optim_rng.pt")):
        state = torch.load(path, weights_only=False)
        state["checkpoint_version"] = version
        encoder = state["model"]["language_model"]["encoder"]
        for name in [n for n in encoder if n.endswith(("query_key_value.weight", "query_key_value.bias"))]:
            t = encoder[name]
            rows = t.reshape((heads, 3, head_dim) + tuple(t.shape[1:]))
            old = rows.transpose(0, 1) if version == 0 else rows.transpose(1, 2)
            encoder[name] = old.reshape(t.shape).contiguous()
        torch.save(state, path)
    return dst


@pytest.mark.parametrize("version", [0, 1.0])
def test_qkv_orderings_before_version_2_are_reordered(version, tmp_path):
    """A 2020 checkpoint (QKV rows [3, np, hn] or [np, hn, 3] per rank) merges to the same model as version 3.0;
    the grouped-query attention no such version had is refused with one line. The byte path takes it without torch
    (each rank's QKV rows as runs of its file in megatron-core's order), and copies it into torch_dist as well."""
    from ckpt_tools.forms.byte_ranges import ByteSource
    from ckpt_tools.verbs import paths
    from ckpt_tools.verbs.request import Request
    old = _as_version(FIXTURES / "gpt_pp2", tmp_path / "old", version, heads=4, head_dim=16)
    source = ByteSource.open(old, VOCAB, False)
    qkv = [k for k in source.shards if k.endswith(("linear_qkv.weight", "linear_qkv.bias"))]
    assert not source.made and qkv and all(len(s.parts) == 12 * (1 if version == 0 else 16)
                                           for k in qkv for s in source.shards[k])
    source.close()
    merge(old, tmp_path / "hf", vocab_size=VOCAB, quiet=True)
    merge(FIXTURES / "gpt_pp2", tmp_path / "v3", vocab_size=VOCAB, quiet=True)
    same_files(tmp_path / "hf", tmp_path / "v3")
    assert paths.by_bytes(old, tmp_path / "dist", Request(1, 1, form="torch_dist"), vocab_size=VOCAB,
                          quiet=True) is not None
    merge(tmp_path / "dist", tmp_path / "dist_hf", vocab_size=VOCAB, quiet=True)
    same_files(tmp_path / "dist_hf", tmp_path / "v3")
    merge(old, tmp_path / "torch_hf", vocab_size=VOCAB, quiet=True, via=TENSORS)  # the torch reader's reordering
    same_files(tmp_path / "torch_hf", tmp_path / "v3")
    src = tmp_path / "gqa"
    shutil.copytree(FIXTURES / "llama_tp2", src)
    for path in sorted(src.glob("iter_*/mp_rank_*/model_optim_rng.pt")):
        state = torch.load(path, weights_only=False)
        state["checkpoint_version"] = version
        torch.save(state, path)
    out = tmp_path / "out"
    line = one_line_error(run("merge", src, out, "--vocab-size", str(VOCAB)))
    assert f"checkpoint_version {version}" in line and "grouped-query" in line, line
    assert_nothing_written(out)


@pytest.mark.parametrize("torch_path", [False, True], ids=["torch-free", "torch"])
def test_real_args_objects_are_read_inertly(torch_path, tmp_path, monkeypatch):
    """A torch_dist common.pt whose args hold what Megatron-LM's own args hold (megatron-core's enums, a signal):
    each loader gives them back as inert records of their constructor arguments, never the classes themselves
    (megatron-core's own registrations of those classes cleared for the check); the weights merge as without them."""
    import signal

    from megatron.core.enums import ModelType
    from megatron.core.transformer.enums import AttnBackend
    from test_megatron_optimizer import FIXTURES as OPTIMIZER_FIXTURES

    from ckpt_tools import io
    from ckpt_tools.forms import torchfile
    src = tmp_path / "src"
    shutil.copytree(OPTIMIZER_FIXTURES / "dist" / "torch_dist_full", src)
    common_pt = src / "iter_0000003" / "common.pt"
    common = torch.load(common_pt, weights_only=False)
    args = common["args"]
    args.attention_backend, args.model_type, args.exit_signal = AttnBackend.auto, ModelType.encoder_or_decoder, \
        signal.SIGTERM
    torch.save(common, common_pt)
    registered = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        read = io.load_file(common_pt)["args"] if torch_path else torchfile.read(common_pt)["args"]
    finally:
        torch.serialization.add_safe_globals(registered)
    for name, value in (("attention_backend", AttnBackend.auto), ("model_type", ModelType.encoder_or_decoder),
                        ("exit_signal", signal.SIGTERM)):
        got = getattr(read, name)
        assert type(got) is torchfile.Record and got._args == (value.value,), (name, got)
    if torch_path:
        monkeypatch.setenv("CKPT_MERGE_TORCH", "1")
    merge(src, tmp_path / "hf", vocab_size=120, quiet=True)
    merge(OPTIMIZER_FIXTURES / "dist" / "torch_dist_full", tmp_path / "plain", vocab_size=120, quiet=True)
    same_files(tmp_path / "hf", tmp_path / "plain")


def test_interleaved_pipeline_written_loads_into_megatron_cores_model_chunks(tmp_path):
    """`--vpp 2` writes the interleaved pipeline Megatron-LM loads: megatron-core 0.16.1 builds its PP2 x VPP2 model
    chunks from the written args (tests/mcore_vpp.py load), loads each form strict (legacy: `model0`/`model1` per
    rank file, layer numbers local to the chunk; torch_dist: global keys) and its interleaved forward gives the saved
    model's logits exactly. Written from every path: the torch-free copies (torch_dist and legacy sources, an HF
    model) and the torch path; a layout Megatron-LM cannot express is refused in one line, nothing written."""
    from conftest import torchrun

    from ckpt_tools.forms.byte_ranges import ByteSource
    from ckpt_tools.verbs.importer import import_hf
    source = ByteSource.open(VPP / "torch", VOCAB, False)  # each virtual stage's chunk as byte ranges: no torch
    assert source.shards and not source.made
    source.close()
    merge(VPP / "torch", tmp_path / "hf", vocab_size=VOCAB, quiet=True)
    outs = {"dist-torch": (VPP / "torch_dist", "torch"), "legacy-torch": (VPP / "torch", "torch"),
            "legacy-dist": (VPP / "torch", "torch_dist")}
    for name, (src, form) in outs.items():
        reshard(src, tmp_path / name, tp=1, pp=2, vpp=2, form=form, vocab_size=VOCAB, quiet=True)
    reshard(VPP / "torch_dist", tmp_path / "torchpath-torch", tp=1, pp=2, vpp=2, form="torch", vocab_size=VOCAB,
            quiet=True, copy_bytes=False)
    import_hf(tmp_path / "hf", tmp_path / "hf-torch", tp=1, pp=2, vpp=2, form="torch", quiet=True)
    import_hf(tmp_path / "hf", tmp_path / "hf-dist", tp=1, pp=2, vpp=2, form="torch_dist", quiet=True,
              copy_bytes=False)
    dirs = [str(tmp_path / n) for n in [*outs, "torchpath-torch", "hf-torch", "hf-dist"]]
    expected = torch.load(VPP / "reference.pt", weights_only=True)["logits"]
    import mcore_newest  # megatron-core 0.16.1, and 0.19 (the newest) where it is staged
    for mode in ("load", "load-newest") if mcore_newest.location() is not None else ("load",):
        torchrun(2, ["tests/mcore_vpp.py", mode, str(VPP / "reference.pt"), str(tmp_path / f"{mode}.pt"), *dirs],
                 timeout=600)
        found = torch.load(tmp_path / f"{mode}.pt", weights_only=True)
        assert sorted(found) == sorted(dirs)
        for d in dirs:  # an HF model holds no padding rows: its output's padding logits are zeros
            assert torch.equal(found[d][..., :VOCAB], expected[..., :VOCAB]), (mode, d)
            assert torch.equal(found[d], expected) or Path(d).name.startswith("hf-"), (mode, d)
    line = one_line_error(run("reshard", VPP / "torch", tmp_path / "bad", "--tp", "1", "--pp", "2", "--vpp", "3",
                              "--format", "torch", "--vocab-size", VOCAB))
    assert line == ("error: num_layers 4 does not split evenly into PP 2 x VPP 3 = 6 model chunks: choose a PP and "
                    "VPP whose product divides it"), line
    assert_nothing_written(tmp_path / "bad")
    line = one_line_error(run("reshard", VPP / "torch", tmp_path / "bad", "--tp", "1", "--pp", "2", "--vpp", "2",
                              "--vocab-size", VOCAB))
    assert line.startswith("error: --vpp 2 applies to Megatron-LM's forms"), line
    assert_nothing_written(tmp_path / "bad")


def test_torch_dist_interleaved_pipeline_of_uneven_stages_reads_its_weights(tmp_path):
    """torch_dist holds every tensor by its global key, so the weights of an interleaved pipeline read whatever its
    split (here args of uneven first and last stages, which the dp_reshardable buckets' decoding does not take: only
    those are left unread)."""
    src = tmp_path / "src"
    shutil.copytree(VPP / "torch_dist", src)
    common = next(src.glob("iter_*/common.pt"))
    state = torch.load(common, weights_only=False)
    state["args"].decoder_first_pipeline_num_layers, state["args"].decoder_last_pipeline_num_layers = 1, 3
    torch.save(state, common)
    merge(src, tmp_path / "hf", vocab_size=VOCAB, quiet=True)
    merge(VPP / "torch_dist", tmp_path / "even", vocab_size=VOCAB, quiet=True)
    uneven, even = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "even"))
    assert len(even) == 39 and sorted(uneven) == sorted(even) and all(torch.equal(uneven[k], even[k]) for k in even)


def test_interleaved_pipeline_reads_as_its_virtual_stages_and_its_optimizer_is_named_not_carried(tmp_path):
    """A legacy PP2 x VPP2 save is read as 4 stages in layer order (chunk v of PP rank p is stage v * 2 + p, as
    megatron-core places the layers); its non-distributed optimizer's state (the chunks' parameters numbered together)
    is not decoded, and says so; a missing chunk is one line."""
    src = tmp_path / "src"
    shutil.copytree(VPP / "torch", src)
    for path in sorted(src.glob("iter_*/mp_rank_*/model_optim_rng.pt")):  # every rank saves its optimizer state
        state = torch.load(path, weights_only=False)
        torch.save({**state, "optimizer": {"optimizer": {"state": {0: {}}, "param_groups": []}}}, path)
    result = run("reshard", src, tmp_path / "out", "--tp", "1", "--pp", "2", "--vocab-size", VOCAB)
    assert result.exit_code == 0, result.output
    assert "NOT carried: its optimizer state of an interleaved pipeline" in result.output, result.output
    merge(VPP / "torch", tmp_path / "hf", vocab_size=VOCAB, quiet=True)
    merge(tmp_path / "out", tmp_path / "again", quiet=True)
    same_files(tmp_path / "hf", tmp_path / "again")
    del state["model1"]
    torch.save(state, path)
    line = one_line_error(run("merge", src, tmp_path / "bad", "--vocab-size", VOCAB))
    assert line == (f"error: {path}: no model chunk 'model1' (found model0), but the args say 2 virtual pipeline "
                    f"stages: the file is damaged or not this checkpoint's; restore it from the source"), line
    assert_nothing_written(tmp_path / "bad")


TE_CASES = sorted(p for p in TE.iterdir() if (p / "torch_dist").is_dir())


def _dcp_tensors(iter_dir: Path) -> tuple[set, dict]:
    """A DCP checkpoint's entry names, and its tensors as torch.distributed.checkpoint's own loader reads them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    entries = dcp.FileSystemReader(str(iter_dir)).read_metadata().state_dict_metadata
    tensors = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in entries.items()
               if isinstance(m, TensorStorageMetadata)}
    dcp.load(tensors, checkpoint_id=str(iter_dir), no_dist=True)
    return set(entries), tensors


@pytest.mark.parametrize("case", TE_CASES, ids=[c.name for c in TE_CASES])
def test_torch_dist_written_holds_every_entry_a_transformer_engine_save_holds(case, tmp_path):
    """megatron-core's load fails on an entry its model asks for and the checkpoint lacks, and a Transformer Engine
    model asks for every module's `_extra_state`, its final norm's (TENorm) too. What `ckpt reshard --format torch_dist`
    writes from either form of a Transformer Engine save, at the save's TP (by the byte copy and by the torch path, and
    `ckpt import` of its merged HF weights), holds every entry the save holds (the
    extra states as None: no FP8 metadata; not the RNG state or megatron-core 0.19's embedded common state, which
    common.pt holds), every tensor equal as torch's DCP loader reads both. On the GPU, megatron-core's own Transformer
    Engine model loads these rewrites (and at another TP, and HF -> import) strict and gives the saved model's logits
    (tests/gpu_te.sh)."""
    import json
    tp = json.loads((case / "case.json").read_text())["tp"]
    names, tensors = _dcp_tensors(case / "torch_dist" / "iter_0000005")
    # TENorm's, in the save (GPTModel's final norm; HybridModel's is `final_norm`)
    assert any(n.startswith(("decoder.final_layernorm._extra_state", "decoder.final_norm._extra_state")) for n in names)
    names -= {n for n in names if n.startswith(("rng_state", "common_state"))}
    from ckpt_tools.verbs.importer import import_hf
    merge(case / "torch_dist", tmp_path / "hf", vocab_size=VOCAB, quiet=True)
    model = "hybrid" if (case / "torch_dist").parent.name.startswith("hybrid") else None
    written = {}
    for form in ("torch_dist", "torch"):  # by the byte copy, and by the torch path
        for copy_bytes in (True, False):
            out = written[form, copy_bytes] = tmp_path / f"{form}-{copy_bytes}"
            reshard(case / form, out, tp=tp, pp=1, form="torch_dist", vocab_size=VOCAB, quiet=True,
                    copy_bytes=copy_bytes)
    for copy_bytes in (True, False):  # and through HF, imported at the save's TP
        out = written["hf", copy_bytes] = tmp_path / f"hf-{copy_bytes}"
        import_hf(tmp_path / "hf", out, tp=tp, form="torch_dist", model=model, quiet=True, copy_bytes=copy_bytes)
    for how, out in written.items():
        got_names, got = _dcp_tensors(out / "release")
        assert names <= got_names, (how, sorted(names - got_names))
        # through HF the vocab's padding rows are zeros (HF holds the true vocab): the true rows compared
        vocab = slice(VOCAB) if how[0] == "hf" else slice(None)
        assert all(torch.equal(got[k][vocab], t[vocab]) if k.startswith(("embedding.", "output_layer.")) else
                   torch.equal(got[k], t) for k, t in tensors.items()), how


@pytest.mark.gpu
def test_transformer_engine_models_load_what_ckpt_writes_from_their_saves(tmp_path):
    """On a GPU with Transformer Engine installed (`bash tests/gpu_te.sh install OUT`, into TE_SITE): megatron-core
    0.19.2 saves its Transformer Engine models (GPTModel: Llama-style, GPT-2-style, with FP8 metadata, at TP 2,
    Mixtral-style with TEGroupedMLP experts; HybridModel `*-*-`), `ckpt` rewrites each save (torch_dist at TP 1 and
    2, from the legacy form, merge -> HF -> import), and megatron-core's Transformer Engine model loads every
    rewrite strict: its logits over the true vocab are the saved model's (the same at the save's TP; at another, as
    the order of the TP reductions gives them: up to 1.2e-5 for the MoE model, measured)."""
    import subprocess
    site = Path(os.environ.get("TE_SITE", "/tmp/te_site"))
    if not (site / "transformer_engine").is_dir():
        pytest.skip(f"Transformer Engine is not installed in {site} (tests/gpu_te.sh install)")
    root, out = Path(__file__).resolve().parent.parent, Path(os.environ.get("TE_OUT") or tmp_path)  # TE_OUT: keep it
    run = subprocess.run(["bash", "tests/gpu_te.sh", "save", str(out)], cwd=root, capture_output=True, text=True,
                         timeout=900)
    assert "FAILED" not in run.stdout and "not saved" not in run.stdout, run.stdout[-3000:]
    lines = (out / "loads.txt").read_text().splitlines()
    cases = {line.split()[0] for line in lines}
    assert len(cases) == 6 and len(lines) == 6 * len(cases), lines  # six loads of each case's save and rewrites
    for line in lines:  # at the save's TP the same logits; at another, as the TP reductions' order gives
        case, load = line.split(":")[0].split()
        diff = float(line.rsplit("=", 1)[1])
        assert diff == 0 if (load == "dist2") == case.endswith("_tp2") else diff < 1e-4, line
