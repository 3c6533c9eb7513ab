"""Block-scaled FP8 HF checkpoints (DeepSeek-V3's and Kimi K2's published form: e4m3 weights, one fp32
`weight_scale_inv` per block) import as the values they stand for, as transformers' own FP8 loader dequantizes
them: the reference is transformers loading the FP8 checkpoint (dequantize=True on a machine without a GPU)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file as load_safetensors
from safetensors.torch import save_file
from families_cases import TOKENS, hf_model, rel

from ckpt_tools.errors import FormatError
from ckpt_tools.forms.hf_tensors import HFTensors
from ckpt_tools.verbs.importer import import_hf
from ckpt_tools.verbs.merge import merge
from ckpt_tools.verbs.reshard import reshard

E4M3_MAX = 448.0
# the weights DeepSeek-V3's published checkpoint holds in FP8 blocks (its model.safetensors.index.json): every linear
# projection of attention, MLPs, experts and shared experts; not norms, the router, embeddings or the head
PUBLISHED_FP8 = tuple(f"{p}.weight" for p in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                                              "gate_proj", "up_proj", "down_proj"))


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's rule: per block, scale = amax / 448, the weight divided by it in e4m3 (partial last blocks)."""
    rows, cols = w.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scale = torch.empty(grid)
    for i in range(grid[0]):
        for j in range(grid[1]):
            part = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scale[i, j] = part.abs().max().clamp(min=1e-12) / E4M3_MAX
    full = scale.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (w / full).to(torch.float8_e4m3fn), scale


def fp8_dir(tmp_path, block: tuple[int, int]):
    """transformers' DeepSeek-V3 (tests/test_families.py's) saved with its projection weights in FP8 blocks (the
    router, norms, embeddings and head as they are, as DeepSeek ships them)."""
    src = tmp_path / "bf"
    hf_model("deepseek_v3").save_pretrained(src)
    tensors = load_safetensors(src / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if name.endswith(PUBLISHED_FP8):
            out[name], out[name + "_scale_inv"] = quantize(t, block)
        else:
            out[name] = t
    dest = tmp_path / "fp8"
    dest.mkdir()
    save_file(out, dest / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def test_fp8_blocks_import_as_transformers_dequantizes_them(tmp_path):
    """Import at TP2 x PP2 x EP2, reshard, merge (fp32): every tensor is transformers' own dequantized one, bit for
    bit, the logits the same, and the merge's config.json carries no quantization_config."""
    from transformers import AutoModelForCausalLM
    src = fp8_dir(tmp_path, (8, 8))
    import_hf(src, tmp_path / "ours", tp=2, pp=2, ep=2, quiet=True)
    reshard(tmp_path / "ours", tmp_path / "re", tp=1, pp=2, quiet=True)
    merge(tmp_path / "re", tmp_path / "merged", quiet=True)
    theirs = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    reference = {k: v for k, v in theirs.state_dict().items() if "rotary" not in k}
    merged = load_safetensors(tmp_path / "merged" / "model.safetensors")
    fused = {k for k in reference if ".experts." in k}  # transformers holds the experts fused [E, ...]
    for name, want in reference.items():
        if name in fused:
            continue
        assert torch.equal(merged[name], want.float()), name
    experts = theirs.model.layers[1].mlp.experts
    gate, up = experts.gate_up_proj[3].chunk(2)
    assert torch.equal(merged["model.layers.1.mlp.experts.3.gate_proj.weight"], gate)
    assert torch.equal(merged["model.layers.1.mlp.experts.3.up_proj.weight"], up)
    assert "quantization_config" not in json.loads((tmp_path / "merged" / "config.json").read_text())
    with torch.no_grad():
        want = theirs(TOKENS).logits
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        assert rel(ours(TOKENS).logits, want) < 1e-6


def test_partial_fp8_blocks_dequantize_as_transformers_does(tmp_path):
    """Weights whose sizes the block does not divide (DeepSeek-V3's 576-row kv_a_proj_with_mqa at 128): the last
    blocks partial, against transformers' block dequantization (its FP8 backward's)."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    src = fp8_dir(tmp_path, (16, 16))
    tensors = load_safetensors(src / "model.safetensors")
    source = HFTensors(src)
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"  # [24, 64]: rows 16 + 8
    assert tensors[name + "_scale_inv"].shape == (2, 4) and name + "_scale_inv" not in source.where
    want = _dequantize_fp8_weight(tensors[name], tensors[name + "_scale_inv"], [16, 16], torch.float32)
    assert torch.equal(source.get(name), want)


@pytest.mark.parametrize("quantization,expected", [
    ({"quant_method": "awq", "bits": 4}, "quantization_config {\"quant_method\": \"awq\", \"bits\": 4} is not read"),
    ({"quant_method": "fp8", "weight_block_size": [8, 8], "activation_scheme": "static"}, "activation_scheme dynamic"),
])
def test_other_quantizations_are_refused(quantization, expected, tmp_path):
    src = fp8_dir(tmp_path, (8, 8))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(FormatError) as e:
        import_hf(src, tmp_path / "out", tp=1, pp=1, quiet=True)
    assert expected in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "out").exists()


def test_merge_writes_fp8_blocks_as_transformers_quantizes_them(tmp_path):
    """`ckpt merge --fp8-blocks 8x8` of an fp32 DeepSeek-V3: each decoder linear weight and its scales are bit for
    bit transformers' own FP8 quantizer's (Fp8Quantize), the rest fp32, config.json declares the blocks, transformers
    loads the result (dequantizing); and merging an FP8 import back to FP8 gives the source's weights and scales."""
    from click.testing import CliRunner
    from transformers import AutoModelForCausalLM
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.utils.quantization_config import FineGrainedFP8Config

    from ckpt_tools.cli import main
    src = tmp_path / "hf"
    hf_model("deepseek_v3").save_pretrained(src)
    import_hf(src, tmp_path / "ours", tp=2, pp=1, quiet=True)
    result = CliRunner().invoke(main, ["merge", str(tmp_path / "ours"), str(tmp_path / "merged8"), "--fp8-blocks", "8x8",
                                       "--quiet"])
    assert result.exit_code == 0, result.output
    out, original = load_safetensors(tmp_path / "merged8" / "model.safetensors"), \
        load_safetensors(src / "model.safetensors")
    quantizer = Fp8Quantize(type("Q", (), {"quantization_config": FineGrainedFP8Config(weight_block_size=[8, 8])})())
    quantized = 0
    for name, t in original.items():
        if name.endswith(PUBLISHED_FP8):
            want = quantizer.convert({name: t})
            assert out[name].dtype == torch.float8_e4m3fn and torch.equal(out[name].view(torch.uint8),
                                                                           want[name].view(torch.uint8)), name
            assert torch.equal(out[name + "_scale_inv"], want[name + "_scale_inv"]), name
            quantized += 1
        else:
            assert torch.equal(out[name], t), name
    assert quantized == 4 * 5 + 3 + 3 * (8 + 1) * 3  # attention (5 a layer), 1 dense MLP, 3 MoE layers
    config = json.loads((tmp_path / "merged8" / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [8, 8]}
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged8", dtype=torch.float32).eval()  # dequantizing
    expected = {n: _dequantize_fp8_weight(t, out[n + "_scale_inv"], [8, 8], torch.float32)
                if n + "_scale_inv" in out else t for n, t in out.items() if not n.endswith("_scale_inv")}
    (tmp_path / "dq").mkdir()
    save_file(expected, tmp_path / "dq" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "dq" / "config.json").write_text((src / "config.json").read_text())
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(tmp_path / "dq", dtype=torch.float32).eval()(TOKENS).logits
        assert rel(model(TOKENS).logits, want) < 1e-6
    # FP8 in, FP8 out: the source's own e4m3 weights and scales
    fp8 = fp8_dir(tmp_path, (8, 8))
    import_hf(fp8, tmp_path / "ours8", tp=2, pp=1, quiet=True)
    merge(tmp_path / "ours8", tmp_path / "back", quiet=True, fp8_blocks=(8, 8))
    back, source = load_safetensors(tmp_path / "back" / "model.safetensors"), load_safetensors(fp8 / "model.safetensors")
    assert sorted(back) == sorted(source)
    for k, t in source.items():  # the e4m3 weights byte for byte; a scale recomputed from its block within float32
        if k.endswith("_scale_inv"):  # rounding (amax / 448 against 1 / (448 / amax) of the dequantized block)
            assert torch.allclose(back[k], t, rtol=3e-7, atol=0), (k, (back[k] / t - 1).abs().max())
        else:
            assert torch.equal(back[k].view(torch.uint8), t.view(torch.uint8)) if t.dtype == torch.float8_e4m3fn \
                else torch.equal(back[k], t), k


def test_fp8_problems_are_refused_in_one_line(tmp_path):
    """An e4m3 tensor without its scales; --fp8-blocks for a family whose HF weights have no FP8 form; multi-token
    prediction layers in the weights (published DeepSeek-V3 holds them as model.layers.61): refused, nothing written.
    `ckpt verify` of a bf16 import against its FP8 source finds every tensor the same (cast once, as imported)."""
    from ckpt_tools.errors import ConfigError
    from ckpt_tools.forms.shards import open_checkpoint
    from ckpt_tools.verbs import verify
    src = fp8_dir(tmp_path, (8, 8))
    tensors = load_safetensors(src / "model.safetensors")
    import_hf(src, tmp_path / "bf16", tp=2, pp=1, dtype=torch.bfloat16, quiet=True)
    tier = verify.tier1(open_checkpoint(tmp_path / "bf16"), src)
    assert tier.ok and tier.data["exact"] == tier.data["compared"] > 100, tier.lines
    bare = dict(tensors)
    del bare["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    (tmp_path / "bare").mkdir()
    save_file(bare, tmp_path / "bare" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "bare" / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(FormatError, match="o_proj.weight is F8_E4M3 without block scales"):
        import_hf(tmp_path / "bare", tmp_path / "out", tp=1, pp=1, quiet=True)
    mtp = dict(tensors, **{"model.layers.4.eh_proj.weight": torch.zeros(64, 128)})
    (tmp_path / "mtp").mkdir()
    save_file(mtp, tmp_path / "mtp" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (tmp_path / "mtp" / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=0)))
    with pytest.raises(FormatError, match="model.layers.4.eh_proj.weight .1 tensors of layers numbered from 4. but "
                                          "config.json's num_nextn_predict_layers is 0"):
        import_hf(tmp_path / "mtp", tmp_path / "out", tp=1, pp=1, quiet=True)
    (tmp_path / "mtp" / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=1)))
    with pytest.raises(FormatError, match="missing model.layers.4.embed_tokens|missing model.layers.4.enorm"):
        import_hf(tmp_path / "mtp", tmp_path / "out", tp=1, pp=1, quiet=True)
    assert not (tmp_path / "out").exists()
    hf_model("llama3_tied").save_pretrained(tmp_path / "llama")
    import_hf(tmp_path / "llama", tmp_path / "ours", tp=1, pp=1, quiet=True)
    with pytest.raises(ConfigError, match="--fp8-blocks: llama's HF weights have no block-scaled FP8 form"):
        merge(tmp_path / "ours", tmp_path / "out", quiet=True, fp8_blocks=(8, 8))
    assert not (tmp_path / "out").exists()
