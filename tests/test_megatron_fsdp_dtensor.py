"""Megatron-LM's `--ckpt-format fsdp_dtensor` (Megatron-FSDP, `--use-megatron-fsdp`), read by every verb.

The fixtures are megatron-core 0.16.1's own saves on GPUs (`bash tests/gpu_fsdp_dtensor.sh OUT`, which runs
tests/mcore_fsdp_dtensor.py): a Llama GPTModel wrapped as Megatron-LM's get_model wraps it for Megatron-FSDP
(Float16Module, FullyShardedDataParallel with optim_grads_params), megatron-core's distributed optimizer, two bf16
steps, then what Megatron-LM's save_checkpoint writes for this form (its `_extra_state` dropped, SwiGLU fc1 saved as
`_w` / `_v` halves, uneven DTensor shards):
- `llama_dp1`: one GPU, model and optimizer (`optimizer.state.module.module.module.<name>.<field>`, param groups as
  `optimizer.param_to_group_meta.*`);
- `llama_dp2_model`: two GPUs, the weights sharded unevenly over the two data-parallel ranks (`--no-save-optim`:
  megatron-core 0.16.1 and 0.19.2 cannot save this model's optimizer at DP 2: their uneven-DTensor preprocessing
  waits forever in mismatched collectives, docs/format.md).
`weights.pt` holds megatron-core's own full tensors of what each checkpoint holds (its uneven DTensors gathered by
Megatron-FSDP's gather_uneven_dtensor_to_full_tensor); `logits.pt` its bf16 forward after the steps.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_reshard import assert_nothing_written, one_line_error, run

from ckpt_tools import layout, megatron_lm
from ckpt_tools.merge import merge
from ckpt_tools.reshard import reshard
from ckpt_tools.shards import open_checked

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
    reader = megatron_lm.open_reader(src, vocab_size=VOCAB)
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
    setting, as megatron-core groups them). Without an opt_param_scheduler entry (this save holds none), a reshard
    into torch_dist with optimizer state is refused in one line, nothing written; --no-optimizer writes the weights."""
    import torch.distributed.checkpoint as dcp
    src = FIXTURES / "llama_dp1" / "fsdp_dtensor"
    iter_dir = src / "iter_0000003"
    reader = megatron_lm.open_reader(src, vocab_size=VOCAB)
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
    line = one_line_error(run("reshard", src, tmp_path / "dist", "--tp", "1", "--pp", "1", "--format", "torch_dist",
                              "--vocab-size", VOCAB))
    assert "no opt_param_scheduler state" in line and "--no-optimizer" in line, line
    assert_nothing_written(tmp_path / "dist")
    result = run("reshard", src, tmp_path / "dist", "--tp", "2", "--pp", "1", "--format", "torch_dist",
                 "--vocab-size", VOCAB, "--no-optimizer")
    assert result.exit_code == 0, result.output
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
