"""MXFP4 HF checkpoints (GPT-OSS's published form: its experts' weights as `_blocks` of FP4 codes and `_scales` of
E8M0 exponents, one per 32 inputs) import as the values they stand for, and `ckpt merge --mxfp4` writes them back.
The references are transformers' own: its MXFP4 dequantization (`_convert_moe_packed_tensors`) and its GPT-OSS loading
the MXFP4 checkpoint (dequantized on a machine without a GPU)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file as load_safetensors
from safetensors.torch import save_file
from families_cases import TOKENS, hf_model, rel

from ckpt_tools.errors import ConfigError, FormatError
from ckpt_tools.forms.hf_tensors import HFTensors
from ckpt_tools.model import families, mxfp4
from ckpt_tools.verbs.importer import import_hf
from ckpt_tools.verbs.merge import merge


def packed(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks (every FP4 code, -0 included) and scales around 2 ** 0 of a weight [.., in, out]; each run's
    first code +-6, so that its scale is the one the quantizer picks (a run whose largest value is 3 or less would be
    written back at a smaller scale: the same values in other bytes)."""
    g = torch.Generator().manual_seed(seed)
    blocks_shape, scales_shape = mxfp4.packed_shapes(shape)
    blocks = torch.randint(0, 256, blocks_shape, dtype=torch.uint8, generator=g)
    blocks[..., 0] = (blocks[..., 0] & 0xF0) | torch.randint(0, 2, blocks_shape[:-1], dtype=torch.uint8, generator=g) * 8 | 7
    return blocks, torch.randint(118, 134, scales_shape, dtype=torch.uint8, generator=g)


@pytest.fixture(scope="module")
def mxfp4_dir(tmp_path_factory):
    """transformers' GPT-OSS (tests/test_families.py's case) saved as its published checkpoints are: bf16, the experts'
    weights in MXFP4, config.json's quantization_config."""
    root = tmp_path_factory.mktemp("mxfp4")
    hf_model("gpt_oss").to(torch.bfloat16).save_pretrained(root / "bf16")
    tensors = load_safetensors(root / "bf16" / "model.safetensors")
    out = {}
    for i, (name, t) in enumerate(sorted(tensors.items())):
        if mxfp4.quantized(name, families.get("gpt_oss")):
            out[name + mxfp4.BLOCKS], out[name + mxfp4.SCALES] = packed(tuple(t.shape), i)
        else:
            out[name] = t
    (root / "mxfp4").mkdir()
    save_file(out, root / "mxfp4" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((root / "bf16" / "config.json").read_text())
    (root / "mxfp4" / "config.json").write_text(json.dumps({**config, "quantization_config":
                                                                          mxfp4.config(families.get("gpt_oss"))}))
    return root / "mxfp4"


def test_dequantized_as_transformers_dequantizes(mxfp4_dir):
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors
    source, raw = HFTensors(mxfp4_dir), load_safetensors(mxfp4_dir / "model.safetensors")
    names = [n[:-len(mxfp4.BLOCKS)] for n in raw if n.endswith(mxfp4.BLOCKS)]
    assert len(names) == 8 and not any(n.endswith((mxfp4.BLOCKS, mxfp4.SCALES)) for n in source.where)
    for name in names:
        want = _convert_moe_packed_tensors(raw[name + mxfp4.BLOCKS], raw[name + mxfp4.SCALES])
        assert source.shape(name) == tuple(want.shape) and source.dtype_name(name) == "bfloat16"
        assert torch.equal(source.get(name), want), name
        assert all(torch.equal(source.get(f"{name}[{e}]"), want[e]) for e in range(want.shape[0]))  # a slice alone


def test_quantizing_gives_mxfp4_values_back_and_rounds_to_the_nearest_even():
    blocks, scales = packed((2, 64, 8), 5)
    values = mxfp4.dequantize(blocks, scales, "test")
    again = mxfp4.quantize(values)
    assert torch.equal(mxfp4.dequantize(*again, "test"), values)
    # a run whose largest magnitude is 6: its scale 2 ** 0; the midpoints between FP4 values go to the even code
    run = torch.zeros(32)
    run[:9] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75])
    got = mxfp4.dequantize(*mxfp4.quantize(run.view(32, 1)), "test").view(32)
    assert got[:9].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -1.0]
    # a run of largest magnitude 12.5: scale 2 ** 2 (12.5 / 4 = 3.125 is within 6; 2 ** 1 would leave 6.25)
    run = torch.full((32, 1), 1.0)
    run[0] = 12.5
    b, s = mxfp4.quantize(run)
    assert s.tolist() == [[129]] and mxfp4.dequantize(b, s, "test")[0, 0].item() == 12.0


def test_mxfp4_checkpoint_imports_reshards_and_merges_back_byte_for_byte(mxfp4_dir, tmp_path):
    """Import at TP2 x PP2 x EP2: the weights are transformers' own dequantization of the checkpoint (its model
    loaded from it), the logits its; `merge --mxfp4` gives every tensor back byte for byte, `merge` the bf16 model."""
    from transformers import AutoModelForCausalLM, Mxfp4Config
    import_hf(mxfp4_dir, tmp_path / "ours", tp=2, pp=2, ep=2, quiet=True)
    merge(tmp_path / "ours", tmp_path / "packed", mxfp4=True, quiet=True)
    original = load_safetensors(mxfp4_dir / "model.safetensors")
    back = load_safetensors(tmp_path / "packed" / "model.safetensors")
    assert sorted(back) == sorted(original) and all(torch.equal(back[k], original[k]) for k in original)
    assert json.loads((tmp_path / "packed" / "config.json").read_text())["quantization_config"]["quant_method"] == \
        "mxfp4"
    theirs = AutoModelForCausalLM.from_pretrained(mxfp4_dir, quantization_config=Mxfp4Config(dequantize=True),
                                                  dtype=torch.bfloat16).eval()
    merge(tmp_path / "ours", tmp_path / "bf16", quiet=True)
    plain = load_safetensors(tmp_path / "bf16" / "model.safetensors")
    state = theirs.state_dict()
    assert sorted(plain) == sorted(state) and all(torch.equal(plain[k], state[k]) for k in state)
    mine = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()
    with torch.no_grad():
        assert rel(mine(TOKENS).logits, theirs.float()(TOKENS).logits) < 1e-6


def test_mxfp4_refusals(mxfp4_dir, tmp_path):
    raw = load_safetensors(mxfp4_dir / "model.safetensors")
    name = next(n for n in raw if n.endswith(mxfp4.SCALES))
    (tmp_path / "nan").mkdir()
    save_file({**raw, name: torch.full_like(raw[name], 255)}, tmp_path / "nan" / "model.safetensors")
    (tmp_path / "nan" / "config.json").write_text((mxfp4_dir / "config.json").read_text())
    with pytest.raises(FormatError, match=r"an MXFP4 scale of 255 .* is NaN"):
        HFTensors(tmp_path / "nan").get(name[:-len(mxfp4.SCALES)])
    (tmp_path / "lost").mkdir()
    save_file({k: v for k, v in raw.items() if k != name}, tmp_path / "lost" / "model.safetensors")
    (tmp_path / "lost" / "config.json").write_text((mxfp4_dir / "config.json").read_text())
    with pytest.raises(FormatError, match="without their scales"):
        HFTensors(tmp_path / "lost")
    blocks = name[:-len(mxfp4.SCALES)] + mxfp4.BLOCKS
    (tmp_path / "alone").mkdir()
    save_file({k: v for k, v in raw.items() if k != blocks}, tmp_path / "alone" / "model.safetensors")
    (tmp_path / "alone" / "config.json").write_text((mxfp4_dir / "config.json").read_text())
    with pytest.raises(FormatError, match="without their blocks"):
        HFTensors(tmp_path / "alone")
    hf_model("mixtral").save_pretrained(tmp_path / "mixtral")
    import_hf(tmp_path / "mixtral", tmp_path / "dense", tp=1, pp=1, quiet=True)
    with pytest.raises(ConfigError, match="--mxfp4: mixtral's HF weights have no MXFP4 form"):
        merge(tmp_path / "dense", tmp_path / "out", mxfp4=True, quiet=True)
