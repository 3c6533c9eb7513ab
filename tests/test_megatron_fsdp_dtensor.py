"""Megatron-LM's `--ckpt-format fsdp_dtensor` (Megatron-FSDP, `--use-megatron-fsdp`), read by every verb.

The fixtures are megatron-core 0.16.1's own saves on GPUs (`bash tests/gpu_fsdp_dtensor.sh OUT`, which runs
tests/mcore_fsdp_dtensor.py): a Llama GPTModel wrapped as Megatron-LM's get_model wraps it for Megatron-FSDP
(Float16Module, FullyShardedDataParallel with optim_grads_params), megatron-core's distributed optimizer, two bf16
steps, then what Megatron-LM's save_checkpoint writes for this form (its `_extra_state` dropped, SwiGLU fc1 saved as
`_w` / `_v` halves, uneven DTensor shards):
- `llama_dp1`: one GPU, model, optimizer (`optimizer.state.module.module.module.<name>.<field>`, param groups as
  `optimizer.param_to_group_meta.*`) and scheduler (`opt_param_scheduler.*`);
- `llama_dp2_model`: two GPUs, the weights sharded unevenly over the two data-parallel ranks (`--no-save-optim`:
  megatron-core 0.16.1 and 0.19.2 cannot save this model's optimizer at DP 2: their uneven-DTensor preprocessing
  waits forever in mismatched collectives, docs/format.md).
`weights.pt` holds megatron-core's own full tensors of what each checkpoint holds (its uneven DTensors gathered by
Megatron-FSDP's gather_uneven_dtensor_to_full_tensor); `logits.pt` its bf16 forward after the steps.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_reshard import assert_nothing_written, one_line_error, run

from ckpt_tools.forms.shards import open_checked, open_checkpoint
from ckpt_tools.model import layout
from ckpt_tools.verbs.merge import merge
from ckpt_tools.verbs.reshard import reshard

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "megatron_fsdp_dtensor"
CASES = ["llama_dp1", "llama_dp2_model"]
VOCAB = 120


def _weights(reader) -> dict:
    meta = reader.meta
    return {key: reader.shards(key)[0] for _, key in layout.stage_keys(meta.spec, meta.layer_counts, 0)
            if layout.holds_weights(key, meta.spec, meta.pp_size)}


@pytest.mark.parametrize("case", CASES)
def test_fsdp_dtensor_weights_are_megatron_cores_own_and_merge_to_its_logits(case, tmp_path, monkeypatch):
    """Every weight read is megatron-core's own gathered tensor, bit for bit (the fp32 main weights Megatron-FSDP
    keeps; the SwiGLU halves joined as [gate; up]); merged, transformers' logits are megatron-core's bf16 forward's
    (to bf16's precision); the torch-free merge and the torch path write the same bytes, and so does a merge after
    a reshard into our format at TP2."""
    from transformers import AutoModelForCausalLM
    src = FIXTURES / case / "fsdp_dtensor"
    reader = open_checkpoint(src, vocab_size=VOCAB)
    assert reader.meta.source == "fsdp_dtensor"
    reference = torch.load(FIXTURES / case / "weights.pt", weights_only=True)
    found = _weights(reader)
    assert sorted(f"module.{k}" for k in found) == sorted(reference)
    assert [k for k, t in found.items() if not torch.equal(t, reference[f"module.{k}"])] == []
    reader.close()
    merge(src, tmp_path / "hf", vocab_size=VOCAB, quiet=True)
    monkeypatch.setenv("CKPT_MERGE_TORCH", "1")
    merge(src, tmp_path / "torch", vocab_size=VOCAB, quiet=True)
    monkeypatch.delenv("CKPT_MERGE_TORCH")
    reshard(src, tmp_path / "ours", tp=2, pp=1, vocab_size=VOCAB, quiet=True)
    merge(tmp_path / "ours", tmp_path / "again", quiet=True)
    files = [load_file(tmp_path / d / "model.safetensors") for d in ("hf", "torch", "again")]
    assert all(sorted(f) == sorted(files[0]) and all(torch.equal(f[k], files[0][k]) for k in f) for f in files)
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()(
            torch.load(FIXTURES / case / "tokens.pt", weights_only=True).cpu()).logits
    expected = torch.load(FIXTURES / case / "logits.pt", weights_only=True)[..., :VOCAB]
    assert ((logits - expected).norm() / expected.norm()).item() < 2e-2


def test_fsdp_dtensor_optimizer_state_is_what_torch_reads_from_the_files(tmp_path):
    """Megatron-FSDP's optimizer state, per parameter by its wrapped name: every parameter's Adam moments (SwiGLU
    fc1's joined from its `_w` / `_v` halves) equal what torch.distributed.checkpoint's own loader reads for that
    name, the masters are the fp32 main weights, the step is Adam's; resharded into our format at TP2 and back to
    TP1 they are the same, bit for bit. Its param groups come from `param_to_group_meta` (one per distinct
    setting, as megatron-core groups them); with its scheduler they go into Megatron-LM's torch_dist at TP2, whose
    optimizer state reads back the same."""
    import torch.distributed.checkpoint as dcp
    src = FIXTURES / "llama_dp1" / "fsdp_dtensor"
    iter_dir = src / "iter_0000003"
    reader = open_checkpoint(src, vocab_size=VOCAB)
    assert reader.has_optimizer() and reader.step() == 2.0
    prefix = reader.ckpt.dcp_prefix
    assert prefix == "optimizer.state.module.module.module."
    names = {key: reader.ckpt.entry(key)[0].fqn[len("model.module."):] for key in _weights(reader)}
    halves = {key: [f"{name}_w", f"{name}_v"] if key.endswith("linear_fc1.weight") else [name]
              for key, name in names.items()}
    wanted = {f"{prefix}{n}.{field}": torch.empty(0) for parts in halves.values() for n in parts
              for field in ("exp_avg", "exp_avg_sq")}
    metadata = dcp.FileSystemReader(str(iter_dir)).read_metadata()
    wanted = {k: torch.empty(tuple(metadata.state_dict_metadata[k].size)) for k in wanted}
    dcp.load(wanted, checkpoint_id=str(iter_dir), no_dist=True)
    theirs = {(key, field): torch.cat([wanted[f"{prefix}{n}.{field}"] for n in parts])
              for key, parts in halves.items() for field in ("exp_avg", "exp_avg_sq")}
    assert len(theirs) == 30

    def differ(r) -> list:
        bad = [k for k, want in theirs.items() if not torch.equal(r.full(*k), want)]
        bad += [k for k in names if not torch.equal(r.full(k, "master"), r.full(k).float())]
        return bad + ([] if r.step() == 2.0 else ["step"])
    assert differ(reader) == []
    groups = reader.megatron_optimizer()[1]
    assert sorted((g["wd_mult"], len(g["params"])) for g in groups) == [(0.0, 5), (1.0, 10)]
    reader.close()
    reshard(src, tmp_path / "ours", tp=2, pp=1, vocab_size=VOCAB, quiet=True)
    reshard(tmp_path / "ours", tmp_path / "back", tp=1, pp=1, quiet=True)
    for out in ("ours", "back"):
        assert differ(open_checked(tmp_path / out, None, True)) == [], out
    reshard(src, tmp_path / "dist", tp=2, pp=1, vocab_size=VOCAB, form="torch_dist", quiet=True)
    written = open_checkpoint(tmp_path / "dist", vocab_size=VOCAB)
    assert differ(written) == []
    scheduler = written.megatron_optimizer()[3]
    assert scheduler["num_steps"] == 2 and scheduler["lr_decay_style"] == "cosine"
    written.close()
    merge(tmp_path / "dist", tmp_path / "hf", quiet=True)
    merge(src, tmp_path / "direct", vocab_size=VOCAB, quiet=True)
    a, b = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "direct" / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_fsdp_dtensor_missing_half_is_one_line(tmp_path):
    """A SwiGLU fc1 whose `_v` half is gone from the index is named in one line (the tensor, where, the fix),
    nothing written."""
    import pickle
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / "llama_dp2_model" / "fsdp_dtensor", src)
    path = src / "iter_0000003" / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # the fixture's own index (torch's DCP Metadata), damaged here
    del metadata.state_dict_metadata["model.module.decoder.layers.1.mlp.linear_fc1.weight_v"]
    path.write_bytes(pickle.dumps(metadata))
    line = one_line_error(run("merge", src, tmp_path / "bad", "--vocab-size", VOCAB))
    assert "model.module.decoder.layers.1.mlp.linear_fc1.weight" in line and "restore" in line, line
    assert_nothing_written(tmp_path / "bad")


def test_fsdp_dtensor_written_is_what_megatron_fsdp_saves_and_loads(tmp_path):
    """`--format fsdp_dtensor` (weights only) holds every model entry megatron-core's own save holds, of its shape and
    dtype, and torch.distributed.checkpoint's own loader reads megatron-core's gathered weights from it exactly (the
    SwiGLU halves where Megatron-FSDP puts them); its args, iteration and checkpoint_version are bytes entries that
    Megatron-LM's rank-0 read takes. On 2 x H200 megatron-core 0.16.1 loaded this output (and an HF import in fp32 and
    bf16) into Megatron-FSDP at DP 2 as Megatron-LM's load_checkpoint does, strict, and gave the saved model's logits
    exactly (tests/gpu_fsdp_dtensor.sh, case load; test_megatron_core_loads_what_ckpt_writes_as_fsdp_dtensor).
    Refused in one line, nothing written: PP 2, --ep, --vpp."""
    import torch.distributed.checkpoint as dcp
    case = FIXTURES / "llama_dp2_model"
    reshard(case / "fsdp_dtensor", tmp_path / "out", tp=1, pp=1, vocab_size=VOCAB, form="fsdp_dtensor", quiet=True)
    theirs = dcp.FileSystemReader(str(case / "fsdp_dtensor" / "iter_0000003")).read_metadata().state_dict_metadata
    iter_dir = tmp_path / "out" / "release"
    ours = dcp.FileSystemReader(str(iter_dir)).read_metadata().state_dict_metadata
    model = {k: v for k, v in theirs.items() if k.startswith("model.")}
    assert len(model) == 17 and all(k in ours for k in model), sorted(set(model) - set(ours))
    assert all(tuple(ours[k].size) == tuple(v.size) and ours[k].properties.dtype == v.properties.dtype
               for k, v in model.items())
    loaded = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in model.items()}
    loaded.update({"args": None, "iteration": None, "checkpoint_version": None})
    dcp.load(loaded, checkpoint_id=str(iter_dir), no_dist=True)
    reference = torch.load(case / "weights.pt", weights_only=True)
    for name, want in reference.items():
        if name.endswith("linear_fc1.weight"):
            got = torch.cat([loaded[f"model.{name}_w"], loaded[f"model.{name}_v"]])
        else:
            got = loaded[f"model.{name}"]
        assert torch.equal(got, want), name
    assert loaded["iteration"] == 0 and loaded["checkpoint_version"] == 3.0
    assert loaded["args"].ckpt_format == "fsdp_dtensor" and loaded["args"].use_megatron_fsdp
    line = one_line_error(run("reshard", case / "fsdp_dtensor", tmp_path / "pp2", "--tp", "1", "--pp", "2",
                              "--format", "fsdp_dtensor", "--vocab-size", VOCAB))
    assert "fsdp_dtensor form at PP 2" in line and "--pp 1" in line, line
    assert_nothing_written(tmp_path / "pp2")
    for extra, expected in ((["--ep", "2"], "--ep 2 does not apply to fsdp_dtensor"),
                            (["--pp", "2", "--vpp", "2"], "--vpp 2 with --format fsdp_dtensor")):
        args = ["--tp", "1", "--pp", "1", *extra] if "--pp" not in extra else ["--tp", "1", *extra]
        line = one_line_error(run("reshard", case / "fsdp_dtensor", tmp_path / "bad", "--format", "fsdp_dtensor",
                                  "--vocab-size", VOCAB, *args))
        assert expected in line, line
        assert_nothing_written(tmp_path / "bad")


def _entries(iter_dir: Path) -> dict:
    """Every entry of a DCP checkpoint as torch.distributed.checkpoint's own loader reads it (bytes entries through
    the safe unpickler; args, a Namespace, left out)."""
    import io

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
    metadata = dcp.FileSystemReader(str(iter_dir)).read_metadata()
    out = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
           if not isinstance(m, BytesStorageMetadata)}
    dcp.load(out, checkpoint_id=str(iter_dir), no_dist=True)
    for k, m in metadata.state_dict_metadata.items():
        if isinstance(m, BytesStorageMetadata) and k != "args":
            where = metadata.storage_data[MetadataIndex(k)]
            with open(iter_dir / where.relative_path, "rb") as f:
                f.seek(where.offset)
                out[k] = torch.load(io.BytesIO(f.read(where.length)), weights_only=True)
    return out


def test_fsdp_dtensor_written_with_optimizer_holds_what_megatron_fsdp_saves(tmp_path):
    """Megatron-FSDP's own save with its distributed optimizer (llama_dp1), rewritten by `ckpt reshard --format
    fsdp_dtensor` directly and by way of torch_dist at TP2 (its state in the distributed optimizer's
    fully_reshardable form and common.pt), holds every entry megatron-core saved but the RNG state, equal as
    torch.distributed.checkpoint's own loader reads both: the fp32 main weights, each parameter's exp_avg,
    exp_avg_sq and step (a SwiGLU fc1's per half), its param group's settings (under the whole fc1's name, as
    Megatron-FSDP leaves them) and the scheduler's. The only other entries are the same under Transformer Engine's
    names. The load command asks for the optimizer (no --no-load-optim), not the RNG state. From our format without
    the trainer's config, its groups and schedule are unknown: one line, nothing written."""
    src = FIXTURES / "llama_dp1" / "fsdp_dtensor"
    line = reshard(src, tmp_path / "direct", tp=1, pp=1, vocab_size=VOCAB, form="fsdp_dtensor", quiet=True)
    assert "model + optimizer" in line and "--use-distributed-optimizer --use-megatron-fsdp --no-load-rng" in line, line
    reshard(src, tmp_path / "dist", tp=2, pp=1, vocab_size=VOCAB, form="torch_dist", quiet=True)
    reshard(tmp_path / "dist", tmp_path / "via_dist", tp=1, pp=1, form="fsdp_dtensor", quiet=True)
    theirs = _entries(src / "iter_0000003")
    wanted = {k: v for k, v in theirs.items() if not k.startswith("rng_state.")}
    assert any(k.endswith("linear_fc1.weight_w.exp_avg") for k in wanted) and \
        any(k.startswith("optimizer.param_to_group_meta.") for k in wanted) and "opt_param_scheduler.num_steps" in wanted
    for out in ("direct", "via_dist"):
        ours = _entries(tmp_path / out / "iter_0000003")
        assert sorted(set(wanted) - set(ours)) == [], out
        unequal = [k for k, v in wanted.items() if not (torch.equal(v, ours[k]) and v.dtype == ours[k].dtype
                                                        if torch.is_tensor(v) else v == ours[k])]
        assert unequal == [], (out, unequal[:4])
        extra = set(ours) - set(theirs)
        assert extra and all("layer_norm_weight" in k for k in extra), (out, sorted(extra)[:4])
    ours_dir = tmp_path / "ours"
    reshard(src, ours_dir, tp=1, pp=1, vocab_size=VOCAB, quiet=True)
    line = one_line_error(run("reshard", ours_dir, tmp_path / "bad", "--tp", "1", "--pp", "1", "--format",
                              "fsdp_dtensor"))
    assert "param groups and LR schedule cannot be written" in line and "--no-optimizer" in line, line
    assert_nothing_written(tmp_path / "bad")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_megatron_core_loads_what_ckpt_writes_as_fsdp_dtensor(tmp_path):
    """megatron-core (Megatron-FSDP at DP 2, Megatron-LM's load path: strict DCP load of the preprocessed state dict,
    then the wrapped model's load_state_dict) loads `ckpt`'s fsdp_dtensor output of its own save and of an HF import
    (fp32, bf16): its forward gives the saved model's logits exactly, its gathered weights are the written ones."""
    from conftest import torchrun
    case = FIXTURES / "llama_dp2_model"
    merge(case / "fsdp_dtensor", tmp_path / "hf", vocab_size=VOCAB, quiet=True)
    from ckpt_tools.verbs.importer import import_hf
    dirs = {"resharded": tmp_path / "a", "imported": tmp_path / "b", "bf16": tmp_path / "c"}
    reshard(case / "fsdp_dtensor", dirs["resharded"], tp=1, pp=1, vocab_size=VOCAB, form="fsdp_dtensor", quiet=True)
    import_hf(tmp_path / "hf", dirs["imported"], tp=1, pp=1, form="fsdp_dtensor", quiet=True)
    import_hf(tmp_path / "hf", dirs["bf16"], tp=1, pp=1, form="fsdp_dtensor", quiet=True, dtype=torch.bfloat16)
    config = tmp_path / "load.json"
    config.write_text(json.dumps({"model": json.loads((case / "config.json").read_text())["model"]}))
    torchrun(2, ["tests/mcore_fsdp_dtensor.py", "load", str(config), str(tmp_path / "loaded.pt"),
                 *map(str, dirs.values())], timeout=600)
    found = torch.load(tmp_path / "loaded.pt", weights_only=False)
    expected = torch.load(case / "logits.pt", weights_only=True)[..., :VOCAB]
    weights = torch.load(case / "weights.pt", weights_only=True)
    for name, d in dirs.items():
        assert not found[str(d)]["missing"] and not found[str(d)]["unexpected"], name
        assert torch.equal(found[str(d)]["logits"][..., :VOCAB], expected), name
        for k, want in weights.items():
            want = want.bfloat16().float() if name == "bf16" else want
            rows = slice(0, VOCAB) if "word_embeddings" in k or "output_layer" in k else slice(None)
            assert torch.equal(found[str(d)]["weights"][k][rows], want[rows]), (name, k)


def test_fsdp_dtensor_of_experts_holds_both_specs_names_and_merges_back(tmp_path):
    """A Mixtral written as fsdp_dtensor holds each expert's tensors under the local spec's names
    (`local_experts.<e>.linear_fc1.weight_w/_v`) and TEGroupedMLP's (`experts.linear_fc1.weight<e>_w/_v`, second
    index entries over the same bytes), and merges back to the HF tensors bit for bit."""
    import torch.distributed.checkpoint as dcp
    from transformers import MixtralConfig, MixtralForCausalLM

    from ckpt_tools.verbs.importer import import_hf
    torch.manual_seed(0)
    MixtralForCausalLM(MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)).save_pretrained(tmp_path / "hf")
    import_hf(tmp_path / "hf", tmp_path / "fsdp", tp=1, pp=1, form="fsdp_dtensor", quiet=True)
    index = dcp.FileSystemReader(str(tmp_path / "fsdp" / "release")).read_metadata().state_dict_metadata
    layer = "model.module.decoder.layers.1.mlp.experts."
    for half in ("_w", "_v"):
        assert f"{layer}local_experts.3.linear_fc1.weight{half}" in index
        assert f"{layer}linear_fc1.weight3{half}" in index
    assert f"{layer}linear_fc2.weight3" in index and f"{layer}local_experts.3.linear_fc2.weight" in index
    merge(tmp_path / "fsdp", tmp_path / "back", quiet=True)
    a, b = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_megatron_fsdp_resumes_from_what_ckpt_writes_on_the_uninterrupted_curve(tmp_path):
    """Megatron-FSDP (megatron-core's distributed optimizer, bf16, one GPU) trains two steps, saves fsdp_dtensor with
    its optimizer and scheduler, and trains three more (tests/mcore_fsdp_dtensor.py, "continue"). Its save rewritten
    by `ckpt reshard --format fsdp_dtensor` directly, and by way of torch_dist at TP2, is loaded as Megatron-LM's
    load_checkpoint loads it (--no-load-rng: model, optimizer and scheduler, strict) into a model of other weights:
    the three steps after it give the uninterrupted run's losses exactly, as its own save does."""
    from conftest import torchrun
    config = tmp_path / "run.json"
    model = json.loads((FIXTURES / "llama_dp1" / "config.json").read_text())["model"]
    config.write_text(json.dumps({"model": model, "iteration": 3, "optimizer": True, "continue": 3}))
    torchrun(1, ["tests/mcore_fsdp_dtensor.py", str(config), str(tmp_path / "run")], timeout=600)
    src = tmp_path / "run" / "fsdp_dtensor"
    reshard(src, tmp_path / "direct", tp=1, pp=1, vocab_size=VOCAB, form="fsdp_dtensor", quiet=True)
    reshard(src, tmp_path / "dist", tp=2, pp=1, vocab_size=VOCAB, form="torch_dist", quiet=True)
    reshard(tmp_path / "dist", tmp_path / "via_dist", tp=1, pp=1, form="fsdp_dtensor", quiet=True)
    dirs = [str(src), str(tmp_path / "direct"), str(tmp_path / "via_dist")]
    torchrun(1, ["tests/mcore_fsdp_dtensor.py", "resume", str(config), str(tmp_path / "resumed.json"), *dirs],
             timeout=600)
    uninterrupted = json.loads((tmp_path / "run" / "losses.json").read_text())
    resumed = json.loads((tmp_path / "resumed.json").read_text())
    assert len(uninterrupted) == 3
    print("uninterrupted", uninterrupted, "resumed", resumed)
    for d in dirs:
        assert resumed[d] == uninterrupted, (d, resumed[d], uninterrupted)
