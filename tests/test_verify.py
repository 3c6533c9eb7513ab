"""`ckpt verify`: passes on good merges and reshards, fails and names the tensor and layer on a bad one."""
from __future__ import annotations

import shutil
from pathlib import Path

import h5py
import pytest
import torch
from click.testing import CliRunner

from ckpt_tools import memory
from ckpt_tools.cli import main
from ckpt_tools.verbs.merge import merge
from ckpt_tools.verbs.reshard import reshard

FAST = ["--batch", "2", "--seq-len", "32", "--device", "cpu"]


def verify(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(main, ["verify", *map(str, args), *FAST])
    return res.exit_code, res.output


@pytest.fixture(scope="module")
def llama_hf(llama_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("verify") / "hf"
    merge(llama_run[0], out, quiet=True)
    return out


def test_good_merge_passes_all_tiers_and_writes_a_report(llama_run, llama_hf, tmp_path):
    report = tmp_path / "r.h5"
    code, out = verify(llama_run[0], llama_hf, "--report", report)
    assert code == 0, out
    assert "tier 1 weights        PASS" in out and "tier 2 hidden states  PASS" in out and "tier 3 logits         PASS" in out
    assert "39 tensors compared: 39 bit-exact, 0 differ, 0 missing, 0 extra" in out
    with h5py.File(report) as f:
        assert f["settings"].attrs["dtype"] == "fp32" and f["settings"].attrs["tp"] == 2
        assert all(f[f"tier{i}"].attrs["ok"] for i in (1, 2, 3))
        assert f["tier1"].attrs["exact"] == 39
        names = [n.decode() for n in f["tier2/names"][:]]
        assert names[0] == "embedding" and names[-1] == "final_norm" and len(f["tier2/rel_l2"]) == len(names)
        assert max(f["tier2/rel_l2"][:]) < 1e-5
        assert f["tier3/per_token_kl"].shape == (2, 32) and f["tier3/per_token_max_abs"].shape == (2, 32)
        assert f["tier3"].attrs["rel_l2"] < 1e-5 and f["tier3"].attrs["top1"] == 1.0


def test_one_changed_element_is_named_in_tier1_and_its_layer_in_tier2(llama_run, llama_hf, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(llama_run[0] / "checkpoint-8", bad)
    shard = bad / "pytorch_model_tp_1_pp_1.bin"  # stage 1 holds layers 2, 3; local layer 0 = global layer 2
    # Change one element in place (same file size, as a flipped bit would): find its byte offset
    # through the file mapping, then write the new value there.
    obj = torch.load(shard, weights_only=True, mmap=True)
    t = obj["model"]["decoder.layers.0.mlp.linear_fc2.weight"]
    (start, _, _), = [r for r in memory.file_mappings(shard) if r[0] <= t.data_ptr() < r[1]]
    offset = t.data_ptr() - start + (3 * t.stride(0) + 5) * t.element_size()
    value = torch.tensor([float(t[3, 5]) + 0.5], dtype=t.dtype)
    del obj, t
    with open(shard, "r+b") as f:
        f.seek(offset)
        f.write(value.numpy().tobytes())
    code, out = verify(bad, llama_hf)
    assert code == 1
    assert "differs: decoder.layers.2.mlp.linear_fc2.weight -> model.layers.2.mlp.down_proj.weight: 1 element(s)" in out
    assert "layer 2 is the first layer whose hidden states differ" in out
    assert "pytorch_model_tp_1_pp_1.bin: xxh3_128 differs from meta.json" in out  # same size, other bytes
    last = out.strip().splitlines()[-1]
    assert last.startswith("error: verify failed: tier 1 weights: tensor decoder.layers.2.mlp.linear_fc2.weight")


@pytest.mark.slow  # torchrun trainings or forwards (the fast tier leaves them out)
def test_resharded_checkpoint_verifies_against_the_original(llama_run, tmp_path):
    reshard(llama_run[0], tmp_path / "re", tp=1, pp=2, layers=[1, 3], quiet=True)
    code, out = verify(tmp_path / "re", llama_run[0])
    assert code == 0, out
    assert "SRC at TP1 x PP2" in out and "[trainer TP2 x PP2]" in out
    assert "108 tensors compared: 108 bit-exact" in out  # 27 parameters x (weights, master, exp_avg, exp_avg_sq)


@pytest.mark.slow  # torchrun trainings or forwards (the fast tier leaves them out)
def test_gpt2_alone_and_against_safetensors_and_text_tokens(gpt2_run, tmp_path):
    code, out = verify(gpt2_run[0])  # no OTHER: integrity + sharded vs its own TP1 x PP1 join
    assert code == 0 and "[TP1 x PP1 join]" in out, out
    st = tmp_path / "model.safetensors"
    merge(gpt2_run[0], st, fmt="safetensors", quiet=True)
    text = tmp_path / "text.txt"
    text.write_text((Path(__file__).parent.parent / "fixtures" / "corpus.txt").read_text()[:20000])
    code, out = verify(gpt2_run[0], st, "--tokens", text)
    assert code == 0, out
    assert f"({text})" in out and "tensors compared" in out and " 0 differ, 0 missing, 0 extra" in out


def test_verify_refuses_cuda_without_gpus_and_missing_other(llama_run, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    res = CliRunner().invoke(main, ["verify", str(llama_run[0]), "--device", "cuda"])
    assert res.exit_code == 1 and "no CUDA device" in res.output and len(res.output.splitlines()) == 1
    res = CliRunner().invoke(main, ["verify", str(llama_run[0]), str(tmp_path / "nope")])
    assert res.exit_code == 1 and "nope" in res.output and len(res.output.splitlines()) == 1


# ------------------------------------------------------------ bf16 judged against the run's own noise floor
CORPUS = Path(__file__).resolve().parent.parent / "fixtures" / "corpus.txt"
TEXT = ["--tokens", str(CORPUS), "--batch", "2", "--seq-len", "64", "--device", "cpu"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """tiny llama trained until its loss is well below the uniform one (1.4 nats: peaked logits, as trained models
    have), at TP1; its HF merge; the same checkpoint resharded to TP2 and to PP2."""
    import math

    from conftest import train
    root = tmp_path_factory.mktemp("trained")
    metrics = train("tiny_llama.yaml", root / "tp1", 1, tp_degree=1, pp_degree=1, train_iters=300, num_micro_batches=1,
                    micro_batch_size=8, lr=2e-2, min_lr=2e-3, log_interval=50)
    import json
    vocab = json.loads((next((root / "tp1").glob("checkpoint-*")) / "meta.json").read_text())["vocab"]["true"]
    assert metrics[-1]["loss"] < math.log(vocab) - 1.4, (metrics[-1]["loss"], math.log(vocab))
    merge(root / "tp1", root / "hf", quiet=True)
    reshard(root / "tp1", root / "tp2", tp=2, pp=1, quiet=True)
    reshard(root / "tp1", root / "pp2", tp=1, pp=2, quiet=True)
    return root


def verify_text(src, other, dtype: str) -> tuple[int, str]:
    res = CliRunner().invoke(main, ["verify", str(src), str(other), "--dtype", dtype, *TEXT])
    return res.exit_code, res.output


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp1", "tp2", "pp2"])
def test_bf16_never_fails_a_correct_conversion_of_a_trained_model(trained, layout):
    code, out = verify_text(trained / layout, trained / "hf", "bf16")
    assert code == 0, out
    assert "FAIL" not in out and out.count("PASS") == 5 and "tier 2f hidden, fp32" in out, out
    assert "noise floor" in out, out


def _faulty(hf: Path, out: Path, fault: str) -> Path:
    """A copy of the HF merge with one fault of the catalogue."""
    import json

    from safetensors.torch import load_file, save_file
    shutil.copytree(hf, out)
    weights = load_file(out / "model.safetensors")
    q = weights["model.layers.1.self_attn.q_proj.weight"]
    if fault == "one element":
        weights["model.layers.1.mlp.down_proj.weight"][3, 5] += 0.05
    elif fault == "swapped heads":
        head = q.shape[0] // 4
        q[:head], q[head:2 * head] = q[head:2 * head].clone(), q[:head].clone()
    elif fault == "transposed QKV group":
        k, v = weights["model.layers.1.self_attn.k_proj.weight"], weights["model.layers.1.self_attn.v_proj.weight"]
        head = k.shape[0] // 2
        k[:head], v[:head] = v[:head].clone(), k[:head].clone()
    elif fault == "shifted vocab row":
        emb = weights["model.embed_tokens.weight"]
        emb[10:], emb[9] = emb[9:-1].clone(), emb[-1].clone()
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    if fault == "wrong rope base":
        config = json.loads((out / "config.json").read_text())
        params = config.get("rope_parameters") or {}
        if params:
            params["rope_theta"] = params.get("rope_theta", 10000.0) * 2
        else:
            config["rope_theta"] = config.get("rope_theta", 10000.0) * 2
        (out / "config.json").write_text(json.dumps(config))
    return out


FAULTS = {"one element": "layer 1", "swapped heads": "layer 1", "transposed QKV group": "layer 1",
          "shifted vocab row": "embedding", "wrong rope base": "layer 0"}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_every_fault_is_caught_and_its_layer_named(trained, fault, dtype, tmp_path):
    bad = _faulty(trained / "hf", tmp_path / "bad", fault)
    code, out = verify_text(trained / "tp1", bad, dtype)
    assert code == 1, out
    assert f"{FAULTS[fault]} is the first layer whose hidden states differ" in out or fault in (
        "one element", "shifted vocab row") and "tier 1 weights        FAIL" in out, out


def test_values_that_are_not_finite_never_pass():
    """NaN or Inf on one side fails in fp32 and in bf16 (where a NaN floor must not become a NaN tolerance)."""
    from ckpt_tools.verbs import tiers as v
    good = torch.randn(2, 8, 16)
    bad = good.clone()
    bad[0, 3, 5] = float("nan")
    tokens = torch.randint(0, 16, (2, 8))
    assert not v.tier2({"layer 0": good}, {"layer 0": bad}, ["layer 0"], 1e-4).ok
    assert not v.tier3(good, bad, tokens, v.TOLERANCES["fp32"]).ok
    hidden, logits, _ = v.calibrated((({"layer 0": good}, good), ({"layer 0": bad}, bad)),
                                     (({"layer 0": good}, good), ({"layer 0": good}, good)), ["layer 0"],
                                     v.TOLERANCES["bf16"])
    assert not v.tier2({"layer 0": good}, {"layer 0": bad}, ["layer 0"], hidden).ok
    assert not v.tier3(good, bad * float("inf"), tokens, logits).ok


def test_a_checkpoint_with_sha256_records_still_verifies_and_its_damage_is_named(llama_run, tmp_path):
    """Manifests written before XXH3-128 hold sha256 records: tier 1's file check (checkpoint.check_files) checks
    them by sha256 (hashlib's own digest), passes when the bytes match and names the file whose bytes changed."""
    import hashlib
    import json

    from bad_inputs import tensor_record_span

    from ckpt_tools.forms import checkpoint as fmt
    old = tmp_path / "old"
    shutil.copytree(llama_run[0] / "checkpoint-8", old)
    meta = json.loads((old / fmt.META).read_text())
    meta.pop("checksum")
    meta["files"] = {n: {"size": r["size"], "sha256": hashlib.sha256((old / n).read_bytes()).hexdigest()}
                     for n, r in meta["files"].items()}
    fmt.write_meta(old / fmt.META, meta)
    assert fmt.check_files(fmt.Meta.read(old)) == []
    shard = old / "pytorch_model_tp_0_pp_0.bin"
    start, length = tensor_record_span(shard)
    data = bytearray(shard.read_bytes())
    data[start + length // 2] ^= 1  # one flipped bit inside a tensor's bytes: the file still loads, sizes agree
    shard.write_bytes(bytes(data))
    assert fmt.check_files(fmt.Meta.read(old)) == [
        f"{shard}: sha256 differs from meta.json: the file changed after it was saved; restore it from the source "
        f"checkpoint"]
    torch.load(shard, weights_only=True)  # only the hash can tell
