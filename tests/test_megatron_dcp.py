"""Megatron-LM's `--ckpt-format torch_dcp` (its FSDP2 form: TP = PP = 1, every parameter a DTensor sharded on dim 0
over the data-parallel ranks, saved by torch.distributed.checkpoint under the model's own keys `model.<name>`, args
and iteration as bytes entries). megatron-core's own GPTModel, wrapped in megatron-core's own
TorchFullyShardedDataParallel and saved as Megatron-LM's `generate_state_dict` + `dcp.save` do (tests/mcore_dcp.py),
is the reference: merged, its logits are transformers'; resharded into Megatron-LM's torch_dist, megatron-core loads
it strict with the same logits."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import torchrun
from safetensors.torch import load_file as load_safetensors
from families_cases import VOCAB, logits, rel

from ckpt_tools.forms import megatron_lm
from ckpt_tools.forms.shards import open_checkpoint
from ckpt_tools.model.spec import ModelSpec
from ckpt_tools.verbs.merge import merge
from ckpt_tools.verbs.reshard import reshard

BASE = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2, "ffn_hidden_size": 96,
        "vocab_size": VOCAB, "max_position_embeddings": 128, "norm_epsilon": 1e-5}
MODELS = {
    "llama": {"architecture": "llama"},
    # experts inside the FSDP-wrapped layers; GPT-OSS's sinks, windows, biased router and experts
    "gpt_oss": {"architecture": "gpt_oss", "ffn_hidden_size": 32, "kv_channels": 16, "num_moe_experts": 4,
                "moe_router_topk": 2, "sliding_window": 8, "window_attn_skip_freq": 2, "activation_clamp": 7.0,
                "rope_scaling": "yarn", "rope_scaling_factor": 4.0, "rope_original_max_position_embeddings": 32,
                "rope_truncate": False, "rotary_base": 150000.0},
}


@pytest.mark.slow
@pytest.mark.parametrize("case,version", [("llama", "0.16"), ("gpt_oss", "0.16"), ("llama", "0.19")])
def test_megatron_lm_torch_dcp_checkpoint_merges_and_reshards(case, version, tmp_path):
    """megatron-core 0.16.1 (installed) and 0.19.2 (the newest, tests/mcore_newest.py) save it."""
    newest = version == "0.19"
    if newest:
        import mcore_newest
        if mcore_newest.location() is None:
            pytest.skip("megatron-core 0.19.2 is not staged (scripts/setup_env.sh stages it into .venv)")
    model = {**BASE, **MODELS[case]}
    (tmp_path / "config.json").write_text(json.dumps({"model": model, "iteration": 5, "newest": newest}))
    torchrun(2, ["tests/mcore_dcp.py", str(tmp_path / "config.json"), str(tmp_path)], timeout=600)
    assert (tmp_path / "megatron_core_version.txt").read_text().startswith(version)
    src = tmp_path / "torch_dcp"
    assert open_checkpoint(src, vocab_size=VOCAB).meta.source == megatron_lm.TORCH_DCP
    tokens, expected = torch.load(tmp_path / "tokens.pt"), torch.load(tmp_path / "logits.pt")[..., :VOCAB]
    merge(src, tmp_path / "merged", vocab_size=VOCAB, quiet=True)  # the byte path
    _, ours = logits(tmp_path / "merged", tokens)
    assert rel(ours, expected) < 1e-5
    merge(src, tmp_path / "via_torch", vocab_size=VOCAB, via="tensors", quiet=True)
    a, b = (load_safetensors(tmp_path / d / "model.safetensors") for d in ("merged", "via_torch"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    # into Megatron-LM's torch_dist at TP2 x PP2: megatron-core loads it strict, with its own logits
    reshard(src, tmp_path / "dist", tp=2, pp=2, vocab_size=VOCAB, form="torch_dist", quiet=True)
    spec = ModelSpec.from_dict(model)
    torch.save(tokens, tmp_path / "tokens_in.pt")
    cfg = {"model": spec.to_dict(), "tp": 2, "pp": 2, "form": "torch_dist", "load": str(tmp_path / "dist"),
           "padded_vocab": spec.padded_vocab_size(1), "tokens": str(tmp_path / "tokens_in.pt"),
           "out": str(tmp_path / "loaded.pt")}
    (tmp_path / "load.json").write_text(json.dumps(cfg))
    torchrun(4, ["tests/mcore_load.py", str(tmp_path / "load.json")], timeout=600)
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=False)["logits"][..., :VOCAB]
    assert rel(loaded, expected) < 1e-5


FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"  # made by tests/mcore_dcp_optimizer.py OUT [fp32]


def _same_state(reader, reference: dict) -> list[str]:
    """The (key, field) pairs whose optimizer state differs from megatron-core's own (reference.pt)."""
    return [f"{key} [{field}]" for key, fields in reference.items() for field, want in fields.items()
            if not torch.equal((reader.full(key, field) if field != "step" else torch.tensor(reader.step())).float(),
                               want.float())]


@pytest.mark.parametrize("fixture", ["megatron_torch_dcp", "megatron_torch_dcp_fp32"])
def test_torch_dcp_optimizer_state_is_megatron_cores_own(fixture, tmp_path):
    """A `--use-torch-fsdp2` run's torch_dcp save (two data-parallel ranks on 2 GPUs, three Adam steps; made by
    tests/mcore_dcp_optimizer.py): `--bf16` (Float16OptimizerWithFloat16Params: fp32 masters beside the Adam state)
    and fp32 (FP32Optimizer: Adam's own state dict, the weights the masters). Every parameter's master, moments and
    step, found by its index in megatron-core's param groups, are megatron-core's own optimizer object's, bit for bit;
    resharded into our format (TP2 x PP2) and into Megatron-LM's torch_dist (TP2, with its param groups and
    scheduler), they read back the same."""
    from ckpt_tools.forms.shards import open_checked
    reference = torch.load(FIXTURES / fixture / "reference.pt", weights_only=True)
    src = FIXTURES / fixture / "torch_dcp"
    reader = open_checkpoint(src, vocab_size=120)
    assert reader.has_optimizer() and len(reference) == 15
    assert _same_state(reader, reference) == []
    reshard(src, tmp_path / "ours", tp=2, pp=2, vocab_size=120, quiet=True)
    assert _same_state(open_checked(tmp_path / "ours", None, True), reference) == []
    reshard(src, tmp_path / "dist", tp=2, pp=1, vocab_size=120, form="torch_dist", quiet=True)
    written = open_checkpoint(tmp_path / "dist", vocab_size=120)
    assert _same_state(written, reference) == []
    scheduler = written.megatron_optimizer()[3]
    assert scheduler["num_steps"] == 3 and scheduler["lr_decay_style"] == "cosine"


@pytest.mark.parametrize("verb", ["reshard", "import"])
def test_torch_dcp_output_is_refused_naming_the_form_megatron_lm_loads(verb, tmp_path):
    """`--format torch_dcp`: one line saying why Megatron-LM could not load it and what to pass; nothing written."""
    from test_reshard import assert_nothing_written, one_line_error, run
    if verb == "reshard":
        src = tmp_path / "no-such-checkpoint"  # refused before the source is read
        args = ["reshard", src, tmp_path / "out", "--tp", "1", "--pp", "1", "--vocab-size", "120"]
    else:
        src = tmp_path / "no-such-hf-dir"  # refused before the source is read
        args = ["import", src, tmp_path / "out", "--tp", "1", "--pp", "1"]
    from ckpt_tools import cli
    from ckpt_tools.verbs import request
    assert cli.FORMS == request.CHOICES  # the command line offers what the request knows, torch_dcp included
    line = one_line_error(run(*map(str, args), "--format", "torch_dcp"))
    assert "--format torch_dcp is not written" in line and "is_loading" in line and "--format torch_dist" in line, line
    assert_nothing_written(tmp_path / "out")
