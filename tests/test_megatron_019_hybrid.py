"""megatron-core 0.19.2's hybrids as it saves them (fixtures/megatron_019, made by tests/mcore_newest.py): a Mamba
hybrid (Nemotron-H) saved by 0.19.2's HybridModel and by 0.16.1's MambaModel (fixtures/megatron_mamba_016), proven
against each rank's own shards and megatron-core's loader; the MoE norm's alias by model class; Qwen3-Next's saves on
the byte path. The GPTModel and attention + MLP HybridModel saves are tests/test_megatron_019.py's."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from test_megatron_019 import SAVES, VOCAB, newest_or_skip, same_files

from ckpt_tools.model import hybrid
from ckpt_tools.verbs.merge import merge
from ckpt_tools.verbs.reshard import reshard

# ---------------------------------------------------------------- a Mamba hybrid (Nemotron-H) as megatron-core 0.19.2 saves it
MAMBA = SAVES / "hybrid_nemotron_h_tp2"  # 'M*M-' at TP2; local_tp<r>_pp0.pt: each rank's own shards, in memory
# the same model as megatron-core 0.16.1's MambaModel saves it (Megatron-LM's pretrain_mamba.py, --hybrid-override-pattern)
MAMBA_016 = SAVES.parent / "megatron_mamba_016" / "mamba_nemotron_h_tp2"
MAMBA_SAVES = {"0.19": MAMBA, "0.16": MAMBA_016}


def megatron_core_names(state: dict) -> dict:
    """megatron-core 0.19's local state dict in the layout table's names: its MambaMixer's convolution parameters
    (`conv1d_weight`), HybridStack's final norm."""
    return {re.sub(r"conv1d_(weight|bias)$", r"conv1d.\1", k).replace("decoder.final_norm.", "decoder.final_layernorm."): v
            for k, v in state.items()}


@pytest.mark.parametrize("version", sorted(MAMBA_SAVES))
@pytest.mark.parametrize("form", ["torch_dist", "torch"])
def test_megatron_core_mamba_hybrid_reads_as_its_own_shards(form, version, tmp_path):
    """megatron-core's HybridModel (0.19.2; 0.16.1's MambaModel) of Mamba-2, attention and MLP layers, saved by itself
    at TP2 in both forms: every rank's shard the reader gives (Mamba's in_proj joined from its five stored parts, its
    convolution from three, its norm from Transformer Engine's fused name) is the tensor megatron-core held on that
    rank, bit for bit."""
    save = MAMBA_SAVES[version]
    reshard(save / form, tmp_path / "ours", tp=2, pp=1, vocab_size=VOCAB, quiet=True)
    for r in range(2):
        held = megatron_core_names(torch.load(save / f"local_tp{r}_pp0.pt", weights_only=True))
        ours = torch.load(next((tmp_path / "ours").glob(f"checkpoint-*/pytorch_model_tp_{r}_pp_0.bin")),
                          weights_only=True)["model"]
        ours = {k: v for k, v in ours.items() if torch.is_tensor(v)}
        assert sorted(ours) == sorted(held), set(ours) ^ set(held)
        for k, v in held.items():
            assert ours[k].dtype == v.dtype and torch.equal(ours[k], v), (r, k)


def _hf_tensor(hf: dict, key: str, spec) -> torch.Tensor:
    """A layer-table key's full tensor made from transformers' NemotronH tensors by their own definitions: QKV grouped
    per query group [q heads; k; v], the vocab padded with zeros."""
    m = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", key)
    if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return hf["backbone.embeddings.weight" if key.startswith("embedding") else "lm_head.weight"]
    if key == "decoder.final_layernorm.weight":
        return hf["backbone.norm_f.weight"]
    i, name = m.group(1), m.group(2)
    h = f"backbone.layers.{i}."
    if name.endswith(("norm.weight", "layernorm.weight")) and not name.startswith("mixer."):
        return hf[h + "norm.weight"]
    if name.startswith("mixer."):
        return hf[h + name]
    if name == "self_attention.linear_qkv.weight":
        q, k, v = (hf[h + f"mixer.{p}_proj.weight"] for p in "qkv")
        g, d = spec.num_query_groups, spec.kv_channels
        q, k, v = q.view(g, -1, q.shape[-1]), k.view(g, d, -1), v.view(g, d, -1)
        return torch.cat([q, k, v], dim=1).reshape(-1, q.shape[-1])
    return hf[h + {"self_attention.linear_proj.weight": "mixer.o_proj.weight", "mlp.linear_fc1.weight":
                   "mixer.up_proj.weight", "mlp.linear_fc2.weight": "mixer.down_proj.weight"}[name]]


@pytest.mark.slow
@pytest.mark.parametrize("version,pp", [("0.19", 2), ("0.16", 1)])
def test_megatron_core_loads_our_mamba_hybrid_and_saves_it_back(version, pp, tmp_path):
    """megatron-core's TP2 save resharded by `ckpt reshard --format torch_dist` to TP1 x PP (its in_proj and
    convolution re-cut into parts per rank): megatron-core (0.19.2's HybridModel at PP2; 0.16.1's MambaModel, whose
    pattern has no pipeline segments, at PP1) loads it strict, and at TP1 each of its tensors is transformers' own
    (merged from the TP2 save): the split of every Mamba part over TP is megatron-core's. Its own save of what it
    loaded merges back to the same HF tensors, bit for bit; `ckpt import` of that HF model to the same layout gives the
    same checkpoint."""
    import json

    from ckpt_tools.model.hf import spec_from_hf
    from ckpt_tools.verbs.importer import import_hf
    mcore_newest = newest_or_skip()
    save = MAMBA_SAVES[version]
    merge(save / "torch_dist", tmp_path / "hf", vocab_size=VOCAB, quiet=True)
    reshard(save / "torch_dist", tmp_path / "w", tp=1, pp=pp, vocab_size=VOCAB, form="torch_dist", quiet=True)
    case = mcore_newest.CASES["hybrid_nemotron_h_tp2"] if version == "0.19" else mcore_newest.OLDER[
        "mamba_nemotron_h_tp2"]
    cfg = {**case, "tp": 1, "pp": pp, "load": str(tmp_path / "w"), "out": str(tmp_path / "loaded")}
    (tmp_path / "loaded").mkdir()
    (tmp_path / "load.json").write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(pp),
                           mcore_newest.__file__, "load", str(tmp_path / "load.json")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    hf, spec = load_file(tmp_path / "hf" / "model.safetensors"), spec_from_hf(tmp_path / "hf" / "config.json")
    first = 0
    for p in range(pp):  # at TP1 each rank holds whole tensors; a stage numbers its layers from 0
        held = megatron_core_names(torch.load(tmp_path / "loaded" / f"local_tp0_pp{p}.pt", weights_only=True))
        layers = {int(m.group(1)) for m in map(re.compile(r"^decoder\.layers\.(\d+)\.").match, held) if m}
        for k, v in held.items():
            g = re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + first}.", k)
            want = _hf_tensor(hf, g, spec)
            assert torch.equal(v[:want.shape[0]], want), (p, k)  # (a vocab's padding rows kept as they were)
        first += len(layers)
    assert first == 4
    merge(tmp_path / "loaded" / "torch_dist", tmp_path / "back", quiet=True)
    same_files(tmp_path / "hf", tmp_path / "back")
    import_hf(tmp_path / "hf", tmp_path / "imported", tp=1, pp=pp, form="torch_dist", quiet=True)
    merge(tmp_path / "imported", tmp_path / "imported_hf", quiet=True)
    same_files(tmp_path / "hf", tmp_path / "imported_hf")


def test_the_moe_norm_alias_follows_the_model_class():
    """An MoE layer's pre-MLP norm, written under the local GPT spec's fused name, gets Transformer Engine's own name as
    a second entry in a GPTModel's keys (layer i is the table's layer i; a stacked key only when every layer is MoE);
    a HybridModel writes it under its own name already, so none there (its index is not the table's layer)."""
    from ckpt_tools.forms.torch_dist_names import te_alias
    from ckpt_tools.model.spec import ModelSpec
    glm = ModelSpec(architecture="glm4_moe", num_layers=3, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
                    vocab_size=VOCAB, num_moe_experts=4, moe_shared_expert_intermediate_size=32, layer_pattern="*-*E*E")
    fused = "decoder.layers.{}.mlp.linear_fc1.layer_norm_weight"
    assert te_alias(fused.format(1), glm) == "decoder.layers.1.pre_mlp_layernorm.weight"
    assert te_alias(fused.format(0), glm) is None  # a dense layer: fused under Transformer Engine too
    assert te_alias("decoder.layers.mlp.linear_fc1.layer_norm_weight", glm) is None  # not every layer MoE
    for j in range(6):  # the HybridModel's indices 0-5
        assert te_alias(fused.format(j), glm, by_pattern=True) is None
    assert hybrid.Pattern.for_layers([2, 2], "*-*-", single=True).single  # a hybrid family's layers without Mamba


@pytest.mark.parametrize("name", ["gpt_qwen3_next_tp2", "hybrid_qwen3_next_tp2"])
def test_qwen3_next_saves_merge_on_the_byte_path_with_the_torch_paths_files(name, tmp_path):
    """megatron-core 0.19.2's own Qwen3-Next saves (GPTModel and HybridModel, TP2, torch_dist): the byte path takes
    them (its norm offsets made by torch, tensor by tensor) and writes the torch path's files, byte for byte."""
    from test_merge_sources import assert_same_as_torch
    for options in ({}, {"dtype": "bf16", "fmt": "safetensors"}):
        out = tmp_path / (options.get("dtype") or "same")
        assert assert_same_as_torch(SAVES / name / "torch_dist", out, vocab_size=VOCAB, **options)
