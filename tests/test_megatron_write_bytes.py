"""Megatron-LM's forms written by copying bytes, without torch (verbs/dist_copy.py for torch_dist,
forms/legacy_copy.py for the legacy torch form), hold what the torch path writes: every chunk's values, every
rank file's tensors, the same args and common.pt; sources the byte path must not take are left to the torch path.
That the torch path's output is what megatron-core loads is tests/test_megatron_write.py's.
"""
from __future__ import annotations

import json

import pytest
import torch
from conftest import same_objects
from safetensors.torch import load_file as load_safetensors
from test_megatron_write import hf_dirs, whole_tensors  # noqa: F401 (hf_dirs: a fixture)

from ckpt_tools.verbs.importer import import_hf
from ckpt_tools.verbs.request import Request
from ckpt_tools.verbs.reshard import reshard


# ------------------------------------------------------------ torch_dist by copying the source's shards
def same_dist_checkpoints(a, b, scratch) -> None:
    """Every tensor (torch's own DCP reader, whole) and every common.pt entry of two torch_dist iteration dirs equal."""
    x, y = whole_tensors(a, scratch / "a.pt"), whole_tensors(b, scratch / "b.pt")
    assert sorted(x) == sorted(y)
    for name, t in x.items():
        if torch.is_tensor(t):
            assert y[name].dtype == t.dtype and y[name].shape == t.shape and torch.equal(y[name], t), name
    ca, cb = (torch.load(d / "common.pt", weights_only=False) for d in (a, b))
    assert vars(ca.pop("args")) == vars(cb.pop("args"))
    assert ca == cb
    assert json.loads((a / "metadata.json").read_text()) == json.loads((b / "metadata.json").read_text())


@pytest.mark.slow
def test_copied_chunks_hold_what_the_torch_path_writes(llama_run, tmp_path):
    """Our trainer's TP2 x PP2 checkpoint with its optimizer, to torch_dist at TP1 x PP1: the source's shards copied
    as chunks (one .distcp per source rank, no torch) hold every value the torch path's re-split shards hold."""
    save = llama_run[0]
    fast = reshard(save, tmp_path / "fast", tp=1, pp=1, form="torch_dist", quiet=True)
    slow = reshard(save, tmp_path / "torch", tp=1, pp=1, form="torch_dist", quiet=True, copy_bytes=False)
    fast = fast.replace(str(tmp_path / "fast"), str(tmp_path / "torch"))
    assert fast.split(", ")[:-2] == slow.split(", ")[:-2]  # the same summary but for size and seconds
    assert fast.split("; load with ")[1] == slow.split("; load with ")[1]
    iteration = next(tmp_path.glob("fast/iter_*")).name
    assert len(list((tmp_path / "fast" / iteration).glob("*.distcp"))) == 4  # the source's ranks save them
    same_dist_checkpoints(tmp_path / "fast" / iteration, tmp_path / "torch" / iteration, tmp_path)


def test_copied_chunks_repad_the_vocab_and_import_no_torch(tmp_path):
    """A padded vocab the target TP does not divide (250 rows at TP1 -> 256 at TP4): the copied chunks stop at the
    true vocab and a zero chunk pads, as the torch path pads; `ckpt reshard` imports no torch doing it."""
    import subprocess
    import sys

    from bad_inputs import make_ckpt
    from test_merge_sources import imported

    from ckpt_tools.model.spec import ModelSpec
    spec = ModelSpec("llama", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=4,
                     ffn_hidden_size=96, vocab_size=250, max_position_embeddings=128, make_vocab_size_divisible_by=2)
    ck = make_ckpt(tmp_path / "src", spec, tp=1, pp=1)
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "ckpt_tools.cli", "reshard", str(ck),
                           str(tmp_path / "fast"), "--tp", "4", "--pp", "1", "--format", "torch_dist", "--no-optimizer",
                           "-q"], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    modules = imported(proc)
    assert "ckpt_tools.verbs.dist_copy" in modules and not {m for m in modules if m.split(".")[0] == "torch"}
    reshard(ck, tmp_path / "torch", tp=4, pp=1, form="torch_dist", quiet=True, optimizer=False, copy_bytes=False)
    fast, slow = tmp_path / "fast" / "release", tmp_path / "torch" / "release"
    same_dist_checkpoints(fast, slow, tmp_path)
    emb = whole_tensors(fast, tmp_path / "e.pt")["embedding.word_embeddings.weight"]
    assert emb.shape[0] == 256 and not emb[250:].any() and emb[:250].any()


@pytest.mark.parametrize("arch", ["llama", "llama_tied", "qwen2_tied", "qwen3"])
def test_imported_chunks_hold_what_the_torch_path_writes(arch, hf_dirs, tmp_path):
    """HF -> torch_dist by copying each HF tensor's rows as chunks (q/k/v per query group, gate/up halves, the true
    vocab plus a zero chunk): every value as the torch path's split shards hold it (torch's DCP reader)."""
    fast = import_hf(hf_dirs[arch], tmp_path / "fast", tp=2, pp=2, form="torch_dist", quiet=True)
    slow = import_hf(hf_dirs[arch], tmp_path / "torch", tp=2, pp=2, form="torch_dist", quiet=True, copy_bytes=False)
    fast = fast.replace(str(tmp_path / "fast"), str(tmp_path / "torch"))
    assert fast.split(", ")[:-3] == slow.split(", ")[:-3] and fast.split("; ")[-1] == slow.split("; ")[-1]
    # one per target rank, as megatron-core saves them: each HF run of rows cut at the TP shards it spans
    assert len(list((tmp_path / "fast" / "release").glob("*.distcp"))) == 4
    same_dist_checkpoints(tmp_path / "fast" / "release", tmp_path / "torch" / "release", tmp_path)


@pytest.mark.parametrize("arch, dtype, pp, copied", [
    ("gpt2", None, 2, {"embedding.word_embeddings.weight", "decoder.layers.0.input_layernorm.weight"}),
    ("llama", torch.bfloat16, 2, set()), ("qwen3", torch.bfloat16, 2, set()),
    ("deepseek_v3", torch.bfloat16, 1, {"decoder.layers.1.mlp.router.expert_bias"}),
    ("qwen3_next", None, 1, {"embedding.word_embeddings.weight", "decoder.layers.0.self_attention.conv1d.weight"}),
    ("nemotron_h", torch.bfloat16, 1, set())],
    ids=["gpt2-transposed", "llama-to-bf16", "qwen3-to-bf16", "deepseek_v3-to-bf16", "qwen3_next-norm-offset",
         "nemotron_h-to-bf16"])
def test_tensors_torch_makes_are_written_into_the_copied_chunks(arch, dtype, pp, copied, hf_dirs, tmp_path,
                                                                monkeypatch):
    """The byte path chooses per tensor: a tensor whose megatron-core value is not its HF bytes (GPT-2's Conv1D
    weights transposed, Qwen3-Next's norm offset, every weight of an fp32 model asked for in bf16 but DeepSeek-V3's
    expert bias, which the layout table keeps in fp32 and is then copied) is made
    by torch and written from memory, the rest still copied; the job never falls back whole to the torch path, and
    every value is the torch path's."""
    from ckpt_tools.verbs import hf_copy
    slow = import_hf(hf_dirs[arch], tmp_path / "torch", tp=2, pp=pp, dtype=dtype, form="torch_dist", quiet=True,
                     copy_bytes=False)

    def declined(*args, **kwargs):
        raise AssertionError("the byte path declined the job: the source was read through torch")
    monkeypatch.setattr(hf_copy, "start_through", declined)
    made, choose = {}, hf_copy.made_by_torch
    monkeypatch.setattr(hf_copy, "made_by_torch", lambda key, *a: made.setdefault(key, choose(key, *a)))
    fast = import_hf(hf_dirs[arch], tmp_path / "fast", tp=2, pp=pp, dtype=dtype, form="torch_dist", quiet=True)
    assert {k for k in made if made[k] is None} >= copied and any(made.values()), made  # some of each
    if not copied:  # every weight cast
        assert all(made.values()), made
    assert fast.replace(str(tmp_path / "fast"), str(tmp_path / "torch")).split(", ")[:-3] == slow.split(", ")[:-3]
    same_dist_checkpoints(tmp_path / "fast" / "release", tmp_path / "torch" / "release", tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("what,form", [("exp_avg", "torch_dist"), ("weight", "torch_dist"), ("weight", "torch"),
                                       ("weight", "ours")])
def test_replicas_that_differ_are_refused_in_words(what, form, llama_run, tmp_path):
    """A layernorm (or its exp_avg) that differs between TP ranks: the byte copy declines (it would save TP rank 0's
    copy only), and the source read through its torch reader is refused in its words, into every form."""
    import shutil

    from bad_inputs import M, O, resave

    from ckpt_tools.forms.shards import open_checkpoint
    from ckpt_tools.verbs import paths
    ck = shutil.copytree(open_checkpoint(llama_run[0]).meta.dir, tmp_path / "src" / "ck")
    key = "decoder.layers.0.input_layernorm.weight"
    if what == "exp_avg":
        resave(ck, O(1, 0), lambda o: o["optimizer"][key]["exp_avg"].__setitem__(0, 5.0))
    else:
        resave(ck, M(1, 0), lambda o: o["model"][key].__setitem__(0, 5.0))
    asked = {"form": form, "optimizer": form != "torch"} if form != "ours" else {}  # the legacy form: weights only
    assert paths.by_bytes(ck, tmp_path / "out", Request(1, 1, **asked), quiet=True) is None
    assert not (tmp_path / "out").exists()
    with pytest.raises(Exception, match="replicated tensor differs between TP rank 0 and TP rank 1"):
        reshard(ck, tmp_path / "out", 1, 1, quiet=True, **asked)
    assert not (tmp_path / "out").exists()


def test_copied_chunks_merge_on_the_byte_path(hf_dirs, tmp_path):
    """torch_dist whose TP shards are rows of several chunks (an import's q/k/v runs, a vocab and its zero chunk)
    merges without torch, to the torch reader's bytes and to the HF model it came from."""
    from test_merge_sources import assert_same_as_torch
    import_hf(hf_dirs["llama"], tmp_path / "mlm", tp=2, pp=2, form="torch_dist", quiet=True)
    files = assert_same_as_torch(tmp_path / "mlm", tmp_path / "merged")
    from safetensors.torch import load as load_bytes
    same = load_safetensors(hf_dirs["llama"] / "model.safetensors")
    merged = load_bytes(files["model.safetensors"])
    assert sorted(merged) == sorted(same) and all(torch.equal(merged[k], same[k]) for k in same)


# (family, spec fields, source TP x PP, target TP x PP): joins and splits of TP (3 included) and PP, GQA, biases
# and LayerNorm (gpt2), the tied head's copy appearing on a last stage, the vocab re-padded (250 rows)
LEGACY_COPIES = [
    ("llama", {"num_query_groups": 2}, (2, 2), (1, 1)),
    ("llama", {"tie_word_embeddings": True, "vocab_size": 250, "make_vocab_size_divisible_by": 2}, (1, 1), (4, 2)),
    ("gpt2", {"num_query_groups": 4}, (2, 1), (4, 2)),
    ("llama", {"hidden_size": 96, "num_attention_heads": 6, "num_query_groups": 6, "ffn_hidden_size": 192},
     (2, 1), (3, 1)),
]


@pytest.mark.parametrize("arch,fields,src,dst", LEGACY_COPIES,
                         ids=[f"{a}-tp{s[0]}pp{s[1]}-to-tp{d[0]}pp{d[1]}" for a, _, s, d in LEGACY_COPIES])
def test_legacy_files_written_without_torch_hold_what_the_torch_path_writes(arch, fields, src, dst, tmp_path):
    """`--format torch` by copying bytes (forms/legacy_copy.py: dim-0 pieces copied file to file, row-parallel
    shards gathered by columns, new vocab rows zero) writes, file by file, what the torch path's torch.save writes:
    the same keys in the same order, tensors bit-exact in dtype and shape, the same args."""
    import subprocess
    import sys

    from bad_inputs import make_ckpt
    from test_merge_sources import imported

    from ckpt_tools.model.spec import ModelSpec
    spec = ModelSpec(arch, **{"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128,
                              "vocab_size": 256, "max_position_embeddings": 128, **fields})
    ck = make_ckpt(tmp_path / "src", spec, tp=src[0], pp=src[1], optimizer=False)
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "ckpt_tools.cli", "reshard", str(ck),
                           str(tmp_path / "fast"), "--tp", str(dst[0]), "--pp", str(dst[1]), "--format", "torch"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not {m for m in imported(proc) if m.split(".")[0] == "torch"}  # the byte path wrote it
    slow = reshard(ck, tmp_path / "slow", tp=dst[0], pp=dst[1], form="torch", quiet=True, copy_bytes=False)
    assert proc.stdout.replace("fast", "slow").split(", ")[:-2] == slow.split(", ")[:-2]
    same_legacy_files(tmp_path / "fast", tmp_path / "slow", dst[0] * dst[1])


def same_legacy_files(fast, slow, count: int) -> None:
    """Each rank's model_optim_rng.pt: the same keys in the same order, tensors bit-exact in dtype and shape, the
    same args, iteration and checkpoint_version."""
    files = sorted((slow / "release").glob("mp_rank_*/model_optim_rng.pt"))
    assert len(files) == count
    for path in files:
        b = torch.load(path, weights_only=False)
        a = torch.load(fast / path.relative_to(slow), weights_only=False)
        assert vars(a.pop("args")) == vars(b.pop("args"))
        ma, mb = a.pop("model"), b.pop("model")
        assert a == b and list(ma) == list(mb), path
        for key, t in mb.items():
            assert (t is None and ma[key] is None) or (ma[key].dtype == t.dtype and torch.equal(ma[key], t)), key


@pytest.mark.parametrize("arch,tp,pp", [("llama", 2, 2), ("llama_tied", 2, 2), ("qwen2_tied", 1, 2), ("qwen3", 2, 1)])
def test_imported_legacy_files_hold_what_the_torch_path_writes(arch, tp, pp, hf_dirs, tmp_path):
    """`ckpt import --format torch` without torch: each HF tensor's rows cut into the target shards (q, k and v rows
    per query group, gate and up halves, the vocab padded with zeros) hold, file by file, what torch.save writes."""
    import subprocess
    import sys

    from test_merge_sources import imported
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "ckpt_tools.cli", "import", str(hf_dirs[arch]),
                           str(tmp_path / "fast"), "--tp", str(tp), "--pp", str(pp), "--format", "torch"],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not {m for m in imported(proc) if m.split(".")[0] == "torch"}  # the byte path wrote it
    import_hf(hf_dirs[arch], tmp_path / "slow", tp=tp, pp=pp, form="torch", quiet=True, copy_bytes=False)
    same_legacy_files(tmp_path / "fast", tmp_path / "slow", tp * pp)


def test_legacy_files_at_expert_parallelism_hold_what_the_torch_path_writes(tmp_path):
    """`--format torch --ep 2`: Megatron-LM's mp_rank_TT_PPP_EEE dirs, each EP rank's experts under local indices,
    written by copying bytes and by the torch path alike (file by file), and the summary names the flag that loads
    it."""
    from bad_inputs import make_ckpt

    from ckpt_tools.model.spec import ModelSpec
    spec = ModelSpec("mixtral", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                     ffn_hidden_size=96, vocab_size=256, max_position_embeddings=128, num_moe_experts=4)
    ck = make_ckpt(tmp_path / "src", spec, tp=2, pp=1, optimizer=False)
    fast = reshard(ck, tmp_path / "fast", tp=1, pp=2, ep=2, form="torch", quiet=True)
    slow = reshard(ck, tmp_path / "slow", tp=1, pp=2, ep=2, form="torch", quiet=True, copy_bytes=False)
    assert "TP1 x PP2 x EP2" in fast and "--expert-model-parallel-size 2" in fast and fast.split(", ")[:-2] == \
        slow.replace("slow", "fast").split(", ")[:-2]
    assert sorted(p.name for p in (tmp_path / "fast" / "release").iterdir()) == \
        [f"mp_rank_00_{p:03d}_{e:03d}" for p in range(2) for e in range(2)]
    same_legacy_files(tmp_path / "fast", tmp_path / "slow", 4)
    model = torch.load(tmp_path / "fast" / "release" / "mp_rank_00_001_001" / "model_optim_rng.pt",
                       weights_only=False)["model"]
    assert {k.split("local_experts.")[1][0] for k in model if "local_experts" in k} == {"0", "1"}  # local indices


@pytest.mark.parametrize("form,tp", [("torch_dist", 1), ("torch", 2), ("torch", 1)])
def test_imported_row_chunks_reshard_on_the_byte_path(form, tp, hf_dirs, tmp_path):
    """An import into torch_dist saves row-parallel tensors as whole rows (ByteSource holds them as one shard, TP 1):
    resharded without torch into torch_dist and into the legacy form at TP 1 and 2 (columns cut from the rows), it
    holds what the torch path writes."""
    from ckpt_tools.verbs import paths
    import_hf(hf_dirs["llama"], tmp_path / "mlm", tp=2, pp=2, form="torch_dist", quiet=True)
    assert paths.by_bytes(tmp_path / "mlm", tmp_path / "fast", Request(tp, 1, form=form), quiet=True) is not None
    reshard(tmp_path / "mlm", tmp_path / "slow", tp=tp, pp=1, form=form, quiet=True, copy_bytes=False)
    if form == "torch":
        same_legacy_files(tmp_path / "fast", tmp_path / "slow", tp)
    else:
        same_dist_checkpoints(tmp_path / "fast" / "release", tmp_path / "slow" / "release", tmp_path)


def in_bf16(src, dst, fp32: tuple[str, ...] = ()):
    """A copy of an HF dir with its tensors in bf16 but those whose names end in `fp32`."""
    import shutil

    from safetensors.torch import save_file
    shutil.copytree(src, dst)
    tensors = load_safetensors(dst / "model.safetensors")
    save_file({k: t if k.endswith(fp32) else t.to(torch.bfloat16) for k, t in tensors.items()},
              dst / "model.safetensors", metadata={"format": "pt"})
    return dst


# DeepSeek-V3 in bf16: with its expert bias in bf16 too (the layout table keeps it in fp32: torch makes it), or with
# its router weight and expert bias in fp32, as transformers saves a bf16 model (the router, kept in bf16, is made by
# torch; into our format its fresh optimizer's fp32 masters are written, as contract 2 says)
ALL_BF16, AS_SAVED = (), ("mlp.gate.weight", "e_score_correction_bias")


HEAD = ("lm_head.weight",)  # a bf16 Llama whose head is fp32: made by torch, its vocab padded, its masters written


@pytest.mark.parametrize("arch, fp32, form, tp, pp, masters", [
    ("gpt2", None, "torch", 2, 2, False), ("gpt2", None, "ours", 2, 2, False),
    ("deepseek_v3", ALL_BF16, "torch", 2, 1, False), ("deepseek_v3", ALL_BF16, "ours", 2, 1, False),
    ("deepseek_v3", AS_SAVED, "ours", 2, 2, True), ("llama", HEAD, "torch", 2, 2, False),
    ("llama", HEAD, "ours", 2, 2, True), ("qwen3_next", None, "ours", 2, 1, False),
    ("nemotron_h", None, "ours", 1, 2, False)],
    ids=["gpt2-transposed-legacy", "gpt2-transposed-ours", "deepseek_v3-expert-bias-legacy",
         "deepseek_v3-expert-bias-ours", "deepseek_v3-fp32-router-masters-ours", "llama-fp32-head-legacy",
         "llama-fp32-head-masters-ours", "qwen3_next-norm-offset-ours", "nemotron_h-3d-conv-ours"])
def test_rank_files_take_the_tensors_torch_makes(arch, fp32, form, tp, pp, masters, hf_dirs, tmp_path, monkeypatch):
    """Into the legacy form and our format the byte path chooses per tensor too: a tensor whose value is not its HF
    bytes (GPT-2's transposed Conv1D weights, Qwen3-Next's norm offset, DeepSeek-V3's expert bias kept in fp32 from a
    bf16 model or its fp32 router kept in bf16, a padded fp32 head kept in bf16, a 3-D convolution) is made by torch,
    split as the torch path splits it and written from memory into its rank files; the rest are still copied; the
    job never falls back whole to the torch path, and every rank file's tensors are the torch path's, bit for bit,
    the fresh optimizer's fp32 masters too where they are written (our meta.json too, but for the files' hashes)."""
    from ckpt_tools.verbs import hf_copy
    src = in_bf16(hf_dirs[arch], tmp_path / "hf", fp32) if fp32 is not None else hf_dirs[arch]
    asked = {"form": "torch"} if form == "torch" else {}
    import_hf(src, tmp_path / "slow", tp=tp, pp=pp, quiet=True, copy_bytes=False, **asked)

    def declined(*args, **kwargs):
        raise AssertionError("the byte path declined the job: the source was read through torch")
    monkeypatch.setattr(hf_copy, "start_through", declined)
    made, choose = {}, hf_copy.made_by_torch
    monkeypatch.setattr(hf_copy, "made_by_torch", lambda key, *a, **k: made.setdefault(key, choose(key, *a, **k)))
    import_hf(src, tmp_path / "fast", tp=tp, pp=pp, quiet=True, **asked)
    assert any(made.values()) and not all(made.values()), made  # some of each
    if form == "torch":
        same_legacy_files(tmp_path / "fast", tmp_path / "slow", tp * pp)
        return
    a, b = tmp_path / "fast" / "checkpoint-0", tmp_path / "slow" / "checkpoint-0"
    files = sorted(f.name for f in b.glob("*.bin"))
    assert sorted(f.name for f in a.glob("*.bin")) == files
    assert any(n.startswith("optimizer_") for n in files) == masters, files  # the fresh masters, where written
    for name in files:
        same_objects(*(torch.load(d / name, weights_only=True) for d in (a, b)), name)
    from ckpt_tools.forms.shards import open_checked
    open_checked(tmp_path / "fast", None, True).close()  # every file's recorded size and content hash
    ma, mb = (json.loads((d / "meta.json").read_text()) for d in (a, b))
    assert {k: v for k, v in ma.items() if k not in ("files", "checksum")} == \
        {k: v for k, v in mb.items() if k not in ("files", "checksum")}
