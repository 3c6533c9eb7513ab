"""`ckpt import`: ckpt_tools/verbs/importer.py's import_hf, against transformers' own models and files.

- HF -> shards -> HF gives transformers' own tensors back bit for bit (fp32 and bf16, tied and untied,
  Llama and GPT-2), with a fresh optimizer state and zero vocab padding rows;
- the imported shards give transformers' logits in the trainer's model;
- invalid targets, an existing OUT and unsupported HF models are refused with one line, before anything
  is written.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import sharded_logits
from safetensors.torch import load_file as load_safetensors
from safetensors.torch import save_file as save_safetensors
from test_reshard import BAD_TARGETS, assert_nothing_written, full_tensors, meta, one_line_error, run

from ckpt_tools import io
from ckpt_tools.forms import checkpoint as fmt
from ckpt_tools.model.ranks import Rank
from ckpt_tools.verbs.importer import import_hf
from ckpt_tools.verbs.merge import merge

# ---------------------------------------------------------------- HF import -> merge, and logits
VOCAB = 1000
HF_MODELS = ("llama", "llama_tied", "gpt2")
LLAMA_KW = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-5}


def hf_model(arch: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    if arch.startswith("llama"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_KW, bos_token_id=1, eos_token_id=2,
                                             tie_word_embeddings=arch == "llama_tied"))
    else:
        model = GPT2LMHeadModel(GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_inner=96, n_positions=128,
            activation_function="gelu_new", bos_token_id=0, eos_token_id=0))
    with torch.no_grad():  # every tensor distinct from its neighbours: norms 1 and biases 0 hide mis-orderings
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """{(arch, dtype): HF model dir saved by transformers}; fp32 and bf16 of the same weights."""
    root = tmp_path_factory.mktemp("hf")
    dirs = {}
    for arch in HF_MODELS:
        model = hf_model(arch)
        for dtype, tdtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            path = root / f"{arch}-{dtype}"
            model.to(tdtype).save_pretrained(path, safe_serialization=True)
            dirs[arch, dtype] = path
    return dirs


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("arch", HF_MODELS)
def test_import_then_merge_gives_the_hf_tensors_back(arch, dtype, hf_dirs, tmp_path):
    hf_dir = hf_dirs[arch, dtype]
    import_hf(hf_dir, tmp_path / "shards", tp=2, pp=2, quiet=True)
    ckpt = tmp_path / "shards" / "checkpoint-0"
    m = meta(ckpt)
    assert m["parallel"]["layers_per_stage"] == [2, 2] and m["vocab"] == {
        "true": VOCAB, "padded": 1024, "divisible_by": 128, "padding": "zeros"}
    want = torch.float32 if dtype == "fp32" else torch.bfloat16
    # the fresh optimizer is recorded, not written (contract 2): no optimizer files; the reader makes it from the
    # weights (fp32 masters equal to them, zero moments, step 0), as the trainer does
    assert m["fresh_optimizer"] is True and not list(ckpt.glob("optimizer_*"))
    from ckpt_tools.forms.shards import open_checkpoint
    reader = open_checkpoint(ckpt)
    assert reader.has_optimizer()
    for key in reader.keys():
        weights = reader.full(key)
        if not torch.is_tensor(weights):
            continue
        assert weights.dtype == want and torch.equal(reader.full(key, "master"), weights.float()), key
        assert not reader.full(key, "exp_avg").any() and not reader.full(key, "exp_avg_sq").any(), key
        assert float(reader.shards(key, "step")[0]) == 0, key
    # the padding rows (1000..1023, all on TP rank 1) are zeros: merge drops them, so only this sees them
    full = full_tensors(ckpt, optimizer=False)
    vocab_keys = [k for k in full if k.endswith(("word_embeddings.weight", "output_layer.weight"))]
    assert len(vocab_keys) == 2  # embedding and output layer (a tied model keeps a copy on the last stage at PP2)
    for key in vocab_keys:
        assert full[key]["model"].shape[0] == 1024 and not full[key]["model"][VOCAB:].any(), key
        assert full[key]["model"][:VOCAB].abs().min() > 0, key

    merge(tmp_path / "shards", tmp_path / "merged", quiet=True)
    original = load_safetensors(hf_dir / "model.safetensors")
    merged = load_safetensors(tmp_path / "merged" / "model.safetensors")
    assert sorted(merged) == sorted(original)
    assert ("lm_head.weight" in merged) == (arch == "llama")  # tied heads are not saved
    for name, t in original.items():
        assert t.dtype == want, name
        assert merged[name].dtype == t.dtype and torch.equal(merged[name], t), name


@pytest.mark.parametrize("arch,tp,pp", [("llama", 2, 4), ("llama_tied", 2, 2), ("gpt2", 2, 1)])
def test_import_into_ours_without_torch_writes_the_torch_paths_tensors(arch, tp, pp, hf_dirs, tmp_path):
    """`ckpt import` into our format copies the HF tensors' rows into each rank's file without torch
    (verbs/ours_copy.py; torch is not imported by the command) where the torch path would only move them: every
    rank file holds the torch path's tensors, bit for bit, in its order (QKV groups, row-parallel columns, a tied
    model's output copy on the last stage), and meta.json is the torch path's but for the files'
    hashes. A tensor whose value is not its HF bytes (GPT-2's transposed Conv1D weights) is made by torch alone inside
    the same path (verbs/hf_copy.made_by_torch); where every weight must be cast (a --dtype) the torch path does
    it."""
    import subprocess
    import sys

    from ckpt_tools.verbs import hf_copy
    hf_dir = hf_dirs[arch, "bf16"]
    if arch == "gpt2":  # torch makes the transposed weights; the job stays on the byte path
        def declined(*args, **kwargs):
            raise AssertionError("the byte path declined the job: the torch path ran")
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(hf_copy, "start_through", declined)
            import_hf(hf_dir, tmp_path / "bytes", tp=tp, pp=pp, quiet=True)
    else:
        code = ("import sys; from ckpt_tools.cli import main; sys.argv = ['ckpt', 'import', sys.argv[1], sys.argv[2], "
                f"'--tp', '{tp}', '--pp', '{pp}', '--quiet']\ntry:\n    main()\nexcept SystemExit:\n    pass\n"
                "print('TORCH' if 'torch' in sys.modules else 'NO TORCH')")
        proc = subprocess.run([sys.executable, "-c", code, str(hf_dir), str(tmp_path / "bytes")], capture_output=True,
                              text=True, check=True)
        assert proc.stdout.strip().splitlines()[-1] == "NO TORCH", proc.stdout
    import_hf(hf_dir, tmp_path / "torch", tp=tp, pp=pp, quiet=True, copy_bytes=False)
    a, b = tmp_path / "bytes" / "checkpoint-0", tmp_path / "torch" / "checkpoint-0"
    names = sorted(f.name for f in b.iterdir())
    assert sorted(f.name for f in a.iterdir()) == names and any(n.startswith("pytorch_model_") for n in names)
    for name in (n for n in names if n.endswith(".bin")):
        ours, theirs = (torch.load(d / name, weights_only=True) for d in (a, b))
        assert list(ours) == list(theirs) == ["model"], name
        ours, theirs = ours["model"], theirs["model"]
        assert list(ours) == list(theirs), name
        for key, t in theirs.items():
            assert (t is None and ours[key] is None) or (t.dtype == ours[key].dtype and torch.equal(t, ours[key])), key
    ma, mb = meta(a), meta(b)
    assert {k: v for k, v in ma.items() if k not in ("files", "checksum")} == \
        {k: v for k, v in mb.items() if k not in ("files", "checksum")}
    assert sorted(ma["files"]) == sorted(mb["files"])
    from ckpt_tools.forms.shards import open_checked
    open_checked(tmp_path / "bytes", None, True).close()  # every file's recorded size and content hash
    import_hf(hf_dir, tmp_path / "fp32", tp=tp, pp=pp, quiet=True, dtype=torch.float32)  # converted: torch's path
    assert meta(tmp_path / "fp32" / "checkpoint-0")["dtypes"]["params"] == "float32"


def test_masters_that_carry_more_than_the_weights_are_written(hf_dirs, tmp_path):
    """An fp32 HF model imported in bf16: the fresh optimizer stays recorded (no moments written), but its fp32
    masters, the HF values bf16 rounds, are written alone; merge --from-master-weights gives the HF tensors back bit
    for bit, directly and after a reshard (which keeps it so); a recorded masters file that is missing is named."""
    from ckpt_tools.verbs.reshard import reshard
    src = hf_dirs["llama", "fp32"]
    import_hf(src, tmp_path / "bf16", tp=2, pp=1, dtype=torch.bfloat16, quiet=True)
    ckpt = tmp_path / "bf16" / "checkpoint-0"
    state = io.load_file(ckpt / fmt.optimizer_file(Rank(0, 0)))["optimizer"]
    assert meta(ckpt)["fresh_optimizer"] is True and state and all(set(s) == {"master"} for s in state.values())
    reshard(tmp_path / "bf16", tmp_path / "re", tp=1, pp=2, quiet=True)
    re = tmp_path / "re" / "checkpoint-0"
    state = io.load_file(re / fmt.optimizer_file(Rank(0, 1)))["optimizer"]
    assert meta(re)["fresh_optimizer"] is True and state and all(set(s) == {"master"} for s in state.values())
    original = load_safetensors(src / "model.safetensors")
    for name in ("bf16", "re"):
        merge(tmp_path / name, tmp_path / f"m-{name}", from_master=True, quiet=True)
        merged = load_safetensors(tmp_path / f"m-{name}" / "model.safetensors")
        assert all(torch.equal(merged[k], t) for k, t in original.items()), name
    merge(tmp_path / "bf16", tmp_path / "m-weights", quiet=True)  # the weights themselves are the rounded ones
    weights = load_safetensors(tmp_path / "m-weights" / "model.safetensors")
    assert all(torch.equal(weights[k], t.to(torch.bfloat16)) for k, t in original.items())
    (ckpt / fmt.optimizer_file(Rank(1, 0))).unlink()
    from ckpt_tools.errors import FormatError
    from ckpt_tools.forms.shards import open_checkpoint
    with pytest.raises(FormatError, match="optimizer_tp_1_pp_0.bin: missing shard"):
        open_checkpoint(ckpt).full("decoder.layers.0.mlp.linear_fc2.weight", "master")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_imported_model_gives_the_transformers_logits(arch, hf_dirs, tmp_path):
    from transformers import AutoModelForCausalLM
    hf_dir = hf_dirs[arch, "fp32"]
    import_hf(hf_dir, tmp_path / "shards", tp=2, pp=1, optimizer=False, quiet=True)
    tokens = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = model(tokens).logits.float()
    ours = sharded_logits(tmp_path / "shards", tokens, tmp_path, tp=2, pp=1)
    assert ours.shape == expected.shape == (2, 40, VOCAB)
    rel = ((ours - expected).norm() / expected.norm()).item()
    assert rel < 1e-5, rel


# ---------------------------------------------------------------- invalid targets, existing OUT
@pytest.mark.parametrize("args,expected", BAD_TARGETS)
def test_import_refuses_an_invalid_target_before_writing(args, expected, hf_dirs, tmp_path):
    out = tmp_path / "out"
    line = one_line_error(run("import", hf_dirs["llama", "fp32"], out, *args, "-q"))
    for text in expected:
        assert text in line, line
    assert_nothing_written(out)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["reshard", "import"])
def test_existing_out_is_left_untouched_without_force(command, llama_run, hf_dirs, tmp_path):
    src = llama_run[0] if command == "reshard" else hf_dirs["llama", "fp32"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    line = one_line_error(run(command, src, out, "--tp", "1", "--pp", "2", "-q"))
    assert str(out) in line and "already exists" in line and "--force" in line, line
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    result = run(command, src, out, "--tp", "1", "--pp", "2", "--force", "-q")  # and --force does replace it
    assert result.exit_code == 0, result.output
    assert not (out / "keep.txt").exists() and (out / "latest").is_file()


# ---------------------------------------------------------------- unsupported HF models
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@pytest.mark.parametrize("changes,expected", [
    ({"rope_scaling": YARN_ROPE}, "rope_scaling 'yarn' is not available for llama"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"mlp_bias": True}, "mlp_bias=true"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
])
def test_import_refuses_an_unsupported_llama_config(changes, expected, hf_dirs, tmp_path):
    from transformers import LlamaConfig
    hf_dir = tmp_path / "hf"
    shutil.copytree(hf_dirs["llama", "fp32"], hf_dir)
    LlamaConfig(**{**LLAMA_KW, **changes}).save_pretrained(hf_dir)  # config.json as transformers writes it
    out = tmp_path / "out"
    line = one_line_error(run("import", hf_dir, out, "--tp", "2", "--pp", "2", "-q"))
    assert "config.json" in line and expected in line, line
    assert_nothing_written(out)


def test_import_refuses_an_unsupported_gpt2_config(hf_dirs, tmp_path):
    hf_dir = tmp_path / "hf"
    shutil.copytree(hf_dirs["gpt2", "fp32"], hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    config["activation_function"] = "relu"
    (hf_dir / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    line = one_line_error(run("import", hf_dir, out, "-q"))
    assert "activation_function 'relu'" in line, line
    assert_nothing_written(out)


@pytest.mark.parametrize("edit,expected", [
    ("drop", "missing model.layers.1.self_attn.k_proj.weight"),
    ("add", "unexpected model.layers.4.input_layernorm.weight"),
    ({"intermediate_size": 128}, "model.layers.0.mlp.gate_proj.weight [96, 64], expected [128, 64]"),
    ({"num_key_value_heads": 4}, "model.layers.0.self_attn.k_proj.weight [32, 64], expected [64, 64]"),
    ({"vocab_size": 900}, "model.embed_tokens.weight [1000, 64], expected [900, 64]"),  # not a silent truncation
])
def test_import_refuses_weights_that_do_not_fit_the_config(edit, expected, hf_dirs, tmp_path):
    from transformers import LlamaConfig
    hf_dir = tmp_path / "hf"
    shutil.copytree(hf_dirs["llama", "fp32"], hf_dir)
    if isinstance(edit, dict):
        LlamaConfig(**{**LLAMA_KW, **edit}).save_pretrained(hf_dir)
    else:
        tensors = load_safetensors(hf_dir / "model.safetensors")
        if edit == "drop":
            del tensors["model.layers.1.self_attn.k_proj.weight"]
        else:
            tensors["model.layers.4.input_layernorm.weight"] = torch.ones(64)
        save_safetensors(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    line = one_line_error(run("import", hf_dir, out, "--tp", "2", "--pp", "2", "-q"))
    assert expected in line and "config.json" in line, line
    assert_nothing_written(out)


@pytest.mark.parametrize("runs", [["hole", "data", "hole"], ["data", "hole", "data"], ["data"], ["hole"], []])
@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256"])
def test_hash_of_a_file_with_holes_equals_the_hash_of_its_bytes(runs, algorithm, tmp_path):
    """hashing.hash_file hashes holes from a zero buffer instead of reading them: the digest is that of the bytes, by
    xxhash's and hashlib's own one-shot functions (the algorithm written now, and the one older manifests hold)."""
    import hashlib
    import os

    import xxhash

    from ckpt_tools.hashing import hash_file
    path = tmp_path / "f"
    with open(path, "wb") as f:
        for i, run in enumerate(runs):
            n = (5000, 3 << 21, 1 << 20)[i % 3]
            f.seek(n, 1) if run == "hole" else f.write(os.urandom(n))
        f.truncate(f.tell())
    reference = {"xxh3_128": lambda b: xxhash.xxh3_128_hexdigest(b), "sha256": lambda b: hashlib.sha256(b).hexdigest()}
    assert hash_file(path, algorithm) == reference[algorithm](path.read_bytes())


def test_an_hf_tensor_over_2_gib_is_read_whole(tmp_path):
    """One read() returns at most ~2 GiB on Linux: a larger tensor (a 70B model's embedding in bf16) is read in
    several, not refused as truncated. The file is sparse: zeros but for its last element."""
    import json
    import struct

    from ckpt_tools.forms.hf_tensors import HFTensors
    n = (1 << 30) + (1 << 19)  # bf16 elements: 2 GiB + 1 MiB
    header = json.dumps({"x": {"dtype": "BF16", "shape": [n], "data_offsets": [0, 2 * n]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.seek(2 * n - 2, 1)
        f.write(torch.tensor([1.5], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes())
    t = HFTensors(tmp_path).get("x")
    assert t.shape == (n,) and float(t[-1]) == 1.5 and float(t[0]) == 0.0


@pytest.mark.parametrize("record,ok", [
    ({"size": 3, "xxh3_128": "ab"}, True), ({"size": 3, "sha256": "ab"}, True),
    ({"size": 3, "xxh3_128": "ab", "sha256": "cd"}, False), ({"size": 3, "xxh3_128": None, "sha256": "cd"}, False),
    ({"size": 3}, False), ({"size": 3, "md5": "ab"}, False),
])
def test_a_file_record_names_exactly_one_known_hash(record, ok):
    """hashing.record_hash: the one (algorithm, digest) of a meta.json record; two, none, a null or an unknown one: None
    (meta.json is then refused naming the record)."""
    from ckpt_tools.hashing import record_hash
    assert (record_hash(record) is not None) == ok
