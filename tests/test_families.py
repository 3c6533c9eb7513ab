"""Model families (ckpt_tools/families), each against its independent references:

- transformers builds the model (tiny, random, every norm and bias non-trivial); `ckpt import` at TP2 x PP2,
  `ckpt reshard` to TP1 x PP2 and `ckpt merge` give every tensor back bit for bit, and transformers loads
  the merge as the same class with the same logits;
- `ckpt verify` of imported shards against the original runs the trainer's sharded forward (TP2) against
  transformers' forward: logits within 1e-5 (fp32);
- megatron-core's own GPTModel with the family's features (qkv bias, qk layernorm, llama3 rope scaling),
  saved by megatron-core as Megatron-LM does, merged by `ckpt merge`: transformers' logits on the merge
  equal megatron-core's own logits;
- the trainer trains the family (loss falls) and a resharded checkpoint resumes the curve.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import train
from safetensors.torch import load_file as load_safetensors

from ckpt_tools import families, hf
from ckpt_tools.merge import merge
from ckpt_tools.reshard import import_hf, reshard
from ckpt_tools.spec import ModelSpec

VOCAB = 1000
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
          "bos_token_id": 1, "eos_token_id": 2}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
# case -> (transformers config class, its arguments beyond COMMON, our family)
CASES = {
    "llama3_tied": ("LlamaConfig", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True}, "llama"),
    "mistral": ("MistralConfig", {"head_dim": 24, "sliding_window": None}, "mistral"),  # 4 x 24 heads != 64
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": False}, "qwen2"),
    "qwen2_tied": ("Qwen2Config", {"tie_word_embeddings": True}, "qwen2"),
    "qwen3": ("Qwen3Config", {"head_dim": 24}, "qwen3"),
    "phi3": ("Phi3Config", {"pad_token_id": None}, "phi3"),
    "gemma": ("GemmaConfig", {"head_dim": 24, "pad_token_id": None}, "gemma"),  # zero-centred norms, scaled embeddings
    # mixtures of experts: top-2 of 4 experts, renormalised (Mixtral) or not (Qwen3-MoE's norm_topk_prob false)
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}, "mixtral"),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "norm_topk_prob": False, "head_dim": 24}, "qwen3_moe"),
    # q/k norms over all heads (each TP rank its heads' slice), top-2 of 4 experts, not renormalised
    "olmoe": ("OlmoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": False}, "olmoe"),
    # QKV biases, and a shared expert scaled by its sigmoid gate beside the routed top-2 of 4
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 48, "norm_topk_prob": False}, "qwen2_moe"),
}


def hf_model(case: str):
    import transformers
    cls, extra, _ = CASES[case]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**COMMON, **extra}))
    with torch.no_grad():  # every tensor distinct from its neighbours: norms 1 and biases 0 hide mis-orderings
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.float().eval()


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    dirs = {}
    for case in CASES:
        dirs[case] = root / case
        hf_model(case).save_pretrained(dirs[case], safe_serialization=True)
    return dirs


def logits(hf_dir: Path, tokens: torch.Tensor) -> tuple[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return type(model).__name__, model(tokens).logits.float()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


TOKENS = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("case", sorted(CASES))
def test_import_reshard_merge_is_the_same_model(case, hf_dirs, tmp_path):
    src = hf_dirs[case]
    spec = hf.spec_from_hf(src / "config.json")
    assert spec.architecture == CASES[case][2]
    import_hf(src, tmp_path / "tp2pp2", tp=2, pp=2, quiet=True)
    reshard(tmp_path / "tp2pp2", tmp_path / "tp1pp2", tp=1, pp=2, quiet=True)
    merge(tmp_path / "tp1pp2", tmp_path / "merged", quiet=True)
    original = load_safetensors(src / "model.safetensors")
    merged = load_safetensors(tmp_path / "merged" / "model.safetensors")
    assert sorted(merged) == sorted(original)
    for name, t in original.items():
        assert merged[name].dtype == t.dtype and torch.equal(merged[name], t), name
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["model_type"] == json.loads((src / "config.json").read_text())["model_type"]
    assert hf.spec_from_hf(tmp_path / "merged" / "config.json") == spec  # the config maps back to the same model
    cls, ours = logits(tmp_path / "merged", TOKENS)
    want_cls, want = logits(src, TOKENS)
    assert cls == want_cls
    assert rel(ours, want) < 1e-6


FORWARD = ("gemma", "llama3_tied", "mixtral", "olmoe", "phi3", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")  # mistral's head_dim path is qwen3's, qwen2_tied's is qwen2's


@pytest.mark.slow
@pytest.mark.parametrize("case", FORWARD)
def test_sharded_forward_equals_transformers(case, hf_dirs, tmp_path):
    from ckpt_tools import verify
    import_hf(hf_dirs[case], tmp_path / "shards", tp=2, pp=1, optimizer=False, quiet=True)
    tiers, _ = verify.run(tmp_path / "shards", hf_dirs[case], seq=48, batch=2)
    assert all(t.ok for t in tiers), [(t.name, t.reason) for t in tiers]
    assert tiers[2].data["rel_l2"] < 1e-5, tiers[2].data["rel_l2"]


def test_family_records_map_their_config_both_ways():
    """Each family writes a config.json that it reads back as the same spec, and declares a default for
    every feature field."""
    for family in families.all_families():
        assert set(family.features) == set(families.FEATURES), family.name
        spec = ModelSpec(architecture=family.name, num_layers=2, hidden_size=64, num_attention_heads=4,
                         num_query_groups=4 if family.name == "gpt2" else 2, ffn_hidden_size=96, vocab_size=VOCAB,
                         kv_channels=16, max_position_embeddings=128,
                         **({"num_moe_experts": 4, "moe_router_topk": 2} if family.moe else {}),
                         **({"moe_shared_expert_intermediate_size": 48} if family.shared_experts else {}))
        config = hf.hf_config(spec, "float32", 1, 2)
        assert config["model_type"] == family.model_type
        back = ModelSpec.from_dict(family.spec_fields(config, pytest.fail))
        assert back == spec, family.name


@pytest.mark.parametrize("changes,expected", [
    ({"model_type": "mistral", "sliding_window": 4096}, "sliding_window 4096 is not supported (sliding-window"),
    ({"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window=true is not supported"),
    ({"model_type": "qwen3", "attention_bias": True}, "attention_bias=true is not supported"),
    ({"model_type": "phi3", "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope scaling longrope"),
    ({"model_type": "phi3", "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
     "partial_rotary_factor 0.5"),
    ({"model_type": "qwen3_moe", "mlp_only_layers": [0]}, "mlp_only_layers [0] is not supported (layers with a dense"),
    ({"model_type": "qwen3_moe", "decoder_sparse_step": 2}, "decoder_sparse_step 2 is not supported"),
    ({"model_type": "mixtral", "num_experts_per_tok": 5}, "moe_router_topk 5 exceeds num_moe_experts 4"),
])
def test_fields_a_family_cannot_honour_are_refused(changes, expected, tmp_path):
    moe = {"num_moe_experts": 4} if families.get(changes["model_type"]).moe else {}
    spec = ModelSpec(architecture=changes["model_type"], num_layers=2, hidden_size=64, num_attention_heads=4,
                     ffn_hidden_size=96, vocab_size=VOCAB, **moe)
    config = {**hf.hf_config(spec, "float32", None, None), **changes}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(Exception) as e:
        hf.spec_from_hf(path)
    assert expected in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value), str(e.value)


# ---------------------------------------------------------------- megatron-core's own model of each family
MCORE = {  # ModelSpec fields of megatron-core GPTModels whose features the Llama-like families add
    "qwen2_tied": {"architecture": "qwen2", "tie_word_embeddings": True},
    "qwen3": {"architecture": "qwen3", "kv_channels": 24},
    "llama3": {"architecture": "llama", "rope_scaling": "llama3", "rope_scaling_factor": 8.0, "rotary_base": 500000.0},
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(MCORE))
def test_megatron_core_model_merges_to_the_same_transformers_model(case, tmp_path):
    from conftest import torchrun
    model = {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
             "ffn_hidden_size": 96, "vocab_size": VOCAB, "max_position_embeddings": 128, "norm_epsilon": 1e-5,
             **MCORE[case]}
    (tmp_path / "config.json").write_text(json.dumps({"model": model, "tp": 2, "pp": 2, "iteration": 5}))
    torchrun(4, ["tests/mcore_checkpoints.py", str(tmp_path / "config.json"), str(tmp_path)], timeout=600)
    merge(tmp_path / "torch_dist", tmp_path / "merged", vocab_size=VOCAB, quiet=True)
    tokens, expected = torch.load(tmp_path / "tokens.pt"), torch.load(tmp_path / "logits.pt")[..., :VOCAB]
    _, ours = logits(tmp_path / "merged", tokens)
    assert rel(ours, expected) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_megatron_core_moe_checkpoints_merge_to_the_same_transformers_model(case, tmp_path):
    """megatron-core's own MoE GPTModel (SequentialMLP experts) at TP2 x EP2, saved as Megatron-LM does: torch_dist
    (experts on a stacked expert axis), legacy torch (mp_rank_TT_EEE dirs, each EP rank's experts under local
    indices) and legacy torch with Transformer Engine's names; each merges to a transformers MoE model whose logits
    are megatron-core's own, and resharding the legacy one to our format (EP2 -> EP4) changes nothing. The same
    weights loaded by megatron-core into its grouped-GEMM experts (GroupedMLP: weight1/weight2) and saved again, in
    torch_dist and legacy torch, and under TEGroupedMLP's legacy names, merge to the same tensors."""
    from conftest import torchrun
    model = {"architecture": case, "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
             "ffn_hidden_size": 96, "vocab_size": VOCAB, "max_position_embeddings": 128, "norm_epsilon": 1e-5,
             "num_moe_experts": 4, **({"moe_ffn_hidden_size": 32, "moe_router_pre_softmax": True, "kv_channels": 24}
                                      if case == "qwen3_moe" else {}),
             **({"moe_ffn_hidden_size": 32, "moe_router_pre_softmax": True, "moe_shared_expert_intermediate_size": 48}
                if case == "qwen2_moe" else {})}
    (tmp_path / "config.json").write_text(json.dumps({"model": model, "tp": 2, "pp": 1, "ep": 2, "iteration": 5,
                                                        "grouped": True}))
    torchrun(4, ["tests/mcore_checkpoints.py", str(tmp_path / "config.json"), str(tmp_path)], timeout=600)
    tokens, expected = torch.load(tmp_path / "tokens.pt"), torch.load(tmp_path / "logits.pt")[..., :VOCAB]
    merged = {}
    for form in ("torch_dist", "torch", "torch_te"):
        merge(tmp_path / form, tmp_path / f"merged_{form}", vocab_size=VOCAB, quiet=True)
        cls, ours = logits(tmp_path / f"merged_{form}", tokens)
        assert cls == CASES[case][0].replace("Config", "ForCausalLM") and rel(ours, expected) < 1e-5, form
        merged[form] = load_safetensors(tmp_path / f"merged_{form}" / "model.safetensors")
    reshard(tmp_path / "torch", tmp_path / "ours", tp=1, pp=2, ep=4, vocab_size=VOCAB, quiet=True)
    merge(tmp_path / "ours", tmp_path / "merged_ours", quiet=True)
    merged["ours"] = load_safetensors(tmp_path / "merged_ours" / "model.safetensors")
    # Megatron-LM's legacy form written from its torch_dist save by copying bytes (every expert at EP 1)
    from ckpt_tools.formats import dist_copy
    assert dist_copy.reshard(tmp_path / "torch_dist", tmp_path / "legacy", 1, 2, vocab_size=VOCAB, quiet=True,
                             form="torch") is not None  # holding no optimizer state: not left to the torch path
    for form in ("grouped_torch_dist", "grouped_torch", "grouped_torch_te", "legacy"):
        merge(tmp_path / form, tmp_path / f"merged_{form}", vocab_size=VOCAB, quiet=True)
        merged[form] = load_safetensors(tmp_path / f"merged_{form}" / "model.safetensors")
    first = merged["torch_dist"]
    for form, tensors in merged.items():
        assert sorted(tensors) == sorted(first) and all(torch.equal(tensors[k], first[k]) for k in first), form


# ---------------------------------------------------------------- the trainer trains each family
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "gemma", "mixtral", "olmoe", "qwen2_moe"])
def test_trainer_trains_and_resumes_after_reshard(arch, tmp_path):
    """TP2: the q/k norms' gradients are summed over TP (each rank saw only its heads), OLMoE's norms over all heads
    sum their squares over TP and keep each rank's weight slice, Gemma's zero-centred norms start at zero; a
    checkpoint resharded to TP1 x PP2 continues the same curve. (QKV biases are linear biases, split
    with their weight like gpt2's and trained in gpt2's tests; llama3 scaling only changes the rotary tables, whose
    forward test_sharded_forward_equals_transformers checks.)"""
    extra = {"architecture": arch, "kv_channels": 24} if arch in ("qwen3", "gemma") else {"architecture": arch}
    if arch == "gemma":
        extra["tie_word_embeddings"] = True
    if arch in ("mixtral", "olmoe", "qwen2_moe"):  # top-2 of 4 experts, each on every rank; the load-balancing loss
        extra.update(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01)
    if arch in ("olmoe", "qwen2_moe"):
        extra.update(moe_router_pre_softmax=True)
    if arch == "qwen2_moe":  # a gated shared expert beside the routed ones, split over TP as the dense MLP
        extra.update(moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=48)
    if arch == "llama3":  # Llama 3.1 frequency scaling, short original context so that it bites at seq 64
        extra = {"architecture": "llama", "rope_scaling": "llama3", "rotary_base": 500000.0,
                 "rope_original_max_position_embeddings": 32}
    run = tmp_path / "run" / "save"
    first = train("tiny_llama.yaml", run, 2, tp_degree=2, pp_degree=1, train_iters=6, save_interval=3,
                  num_micro_batches=2, **extra)
    assert first[-1]["loss"] < first[0]["loss"] - 0.05, [m["loss"] for m in first]
    reshard(run / "checkpoint-3", tmp_path / "re" / "save", tp=1, pp=2, quiet=True)
    resumed = train("tiny_llama.yaml", tmp_path / "re" / "save", 2, tp_degree=1, pp_degree=2, train_iters=6,
                    num_micro_batches=2, **extra)
    assert [m["iteration"] for m in resumed] == [4, 5, 6]
    for a, b in zip(first[3:], resumed):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]), (a, b)


def test_olmoe_norm_over_all_heads_split_over_tp_equals_transformers(tmp_path):
    """The trainer's OLMoE q/k norm at TP2 (each rank half the features, the squares summed over TP through autograd)
    against transformers' OlmoeRMSNorm over the whole width: output, input and weight gradients of each half."""
    from conftest import torchrun
    torchrun(2, ["tests/across_heads_norm_check.py", str(tmp_path / "errors.json")])
    for errors in json.loads((tmp_path / "errors.json").read_text()):
        assert all(e < 1e-6 for e in errors.values()), errors


@pytest.mark.parametrize("case,why", [("gemma", "no embedding scaling"), ("olmoe", "norms span all heads")])
def test_models_megatron_core_cannot_build_are_not_written_in_megatron_lm_forms(case, why, hf_dirs, tmp_path):
    from ckpt_tools.errors import ConfigError
    for form in ("torch_dist", "torch"):
        with pytest.raises(ConfigError, match=why):
            import_hf(hf_dirs[case], tmp_path / "out", tp=1, pp=1, form=form, quiet=True)
        assert not (tmp_path / "out").exists()
    import_hf(hf_dirs[case], tmp_path / "ours", tp=1, pp=1, optimizer=False, quiet=True)
    with pytest.raises(ConfigError, match=why):
        reshard(tmp_path / "ours", tmp_path / "out", tp=1, pp=1, form="torch_dist", quiet=True)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("case,form,written,loaded", [("mixtral", "torch_dist", (2, 2, 1), (2, 1, 2)),
                                                      ("qwen3_moe", "torch", (2, 1, 1), (2, 1, 1)),
                                                      ("qwen2_moe", "torch_dist", (1, 2, 1), (2, 1, 2)),
                                                      ("mixtral", "torch", (1, 2, 2), (1, 2, 2))])
def test_megatron_core_loads_the_moe_checkpoints_we_write(case, form, written, loaded, hf_dirs, tmp_path):
    """`ckpt import --format torch_dist|torch` of an MoE model: megatron-core's own MoE GPTModel loads it the way
    Megatron-LM does (torch_dist at another TP x PP and with EP2; torch per rank, strict, with EP2 from the
    mp_rank_TT_PPP_EEE dirs, each EP rank's experts under local indices) and gives transformers' logits; merging
    what we wrote gives the HF tensors back bit for bit."""
    from conftest import torchrun
    import_hf(hf_dirs[case], tmp_path / "megatron", tp=written[0], pp=written[1], ep=written[2], form=form, quiet=True)
    spec = hf.spec_from_hf(hf_dirs[case] / "config.json")
    torch.save(TOKENS, tmp_path / "tokens.pt")
    tp, pp, ep = loaded
    cfg = {"model": spec.to_dict(), "tp": tp, "pp": pp, "ep": ep, "form": form, "load": str(tmp_path / "megatron"),
           "padded_vocab": spec.padded_vocab_size(written[0]), "tokens": str(tmp_path / "tokens.pt"),
           "out": str(tmp_path / "loaded.pt")}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    torchrun(tp * pp * ep, ["tests/mcore_load.py", str(tmp_path / "config.json")], timeout=600)
    result = torch.load(tmp_path / "loaded.pt", weights_only=False)
    _, want = logits(hf_dirs[case], TOKENS)
    assert rel(result["logits"][..., :VOCAB], want) < 1e-5
    assert result["args"]["num_experts"] == spec.num_moe_experts
    merge(tmp_path / "megatron", tmp_path / "back", quiet=True)
    original = load_safetensors(hf_dirs[case] / "model.safetensors")
    back = load_safetensors(tmp_path / "back" / "model.safetensors")
    assert sorted(back) == sorted(original) and all(torch.equal(back[k], original[k]) for k in original)


@pytest.mark.parametrize("case", ["mistral", "phi3"])
def test_families_sharing_megatron_arguments_come_back_as_themselves(case, hf_dirs, tmp_path):
    """Mistral's and Phi-3's Megatron-LM arguments are Llama's: the written args name the family, so a merge of
    the Megatron-LM checkpoint is a Mistral / Phi-3 model again."""
    import_hf(hf_dirs[case], tmp_path / "megatron", tp=1, pp=2, form="torch", quiet=True)
    merge(tmp_path / "megatron", tmp_path / "merged", quiet=True)
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["model_type"] == case
    original = load_safetensors(hf_dirs[case] / "model.safetensors")
    merged = load_safetensors(tmp_path / "merged" / "model.safetensors")
    assert sorted(merged) == sorted(original) and all(torch.equal(merged[k], original[k]) for k in original)


# ---------------------------------------------------------------- expert parallelism in our format
def test_experts_move_between_expert_parallel_ranks_bit_exactly(hf_dirs, tmp_path):
    """Mixtral imported at TP2 x PP2 x EP2 (each file: its stage's dense tensors and its two experts), resharded to
    TP1 x PP1 x EP4 and back to TP2 x PP2 without EP: every model and optimizer file is byte-identical to a direct
    import at TP2 x PP2, the EP4 checkpoint merges to the HF weights bit for bit, its sharded forward (the
    experts gathered from their EP ranks) gives transformers' logits, and written into Megatron-LM's forms (the
    torch_dist chunks copied from each EP rank's file; the legacy form at the source's EP2) it merges to the same
    weights."""
    from ckpt_tools import verify
    from ckpt_tools.checkpoint import Meta
    from ckpt_tools.io import sha256_file
    src = hf_dirs["mixtral"]
    import_hf(src, tmp_path / "ep2", tp=2, pp=2, ep=2, quiet=True)
    ep2 = tmp_path / "ep2" / "checkpoint-0"
    assert Meta.read(ep2).ep_size == 2
    assert (ep2 / "pytorch_model_tp_1_pp_1_ep_1.bin").is_file() and not (ep2 / "pytorch_model_tp_1_pp_1.bin").exists()
    local = torch.load(ep2 / "pytorch_model_tp_0_pp_0_ep_1.bin", weights_only=True)["model"]
    assert "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight" in local  # global expert 3, local 1
    assert "decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight" not in local
    reshard(tmp_path / "ep2", tmp_path / "ep4", tp=1, pp=1, ep=4, quiet=True)
    reshard(tmp_path / "ep4", tmp_path / "back", tp=2, pp=2, ep=1, quiet=True)
    import_hf(src, tmp_path / "direct", tp=2, pp=2, quiet=True)
    back, direct = tmp_path / "back" / "checkpoint-0", tmp_path / "direct" / "checkpoint-0"
    names = sorted(p.name for p in direct.glob("*.bin"))
    assert names == sorted(p.name for p in back.glob("*.bin")) and len(names) == 8
    assert all(sha256_file(back / n) == sha256_file(direct / n) for n in names)
    merge(tmp_path / "ep4", tmp_path / "merged", quiet=True)
    original = load_safetensors(src / "model.safetensors")
    merged = load_safetensors(tmp_path / "merged" / "model.safetensors")
    assert sorted(merged) == sorted(original) and all(torch.equal(merged[k], original[k]) for k in original)
    tiers, _ = verify.run(tmp_path / "ep2", src, seq=48, batch=2)
    assert all(t.ok for t in tiers), [(t.name, t.reason) for t in tiers]
    assert tiers[2].data["rel_l2"] < 1e-5
    for form in ("torch_dist", "torch"):  # each EP rank's experts into Megatron-LM's forms (legacy: at EP2), and back
        reshard(tmp_path / "ep2", tmp_path / form, tp=1, pp=2, form=form, optimizer=False, quiet=True)
        if form == "torch":
            assert sorted(p.name for p in (tmp_path / form / "release").glob("mp_rank_*")) == \
                [f"mp_rank_00_{p:03d}_{e:03d}" for p in range(2) for e in range(2)]
        merge(tmp_path / form, tmp_path / f"{form}_merged", quiet=True)
        back = load_safetensors(tmp_path / f"{form}_merged" / "model.safetensors")
        assert sorted(back) == sorted(original) and all(torch.equal(back[k], original[k]) for k in original), form


def test_an_expert_parallel_size_the_model_cannot_take_is_refused(hf_dirs, tmp_path):
    from ckpt_tools.errors import ConfigError
    with pytest.raises(ConfigError, match="num_moe_experts 4 is not divisible by EP 3"):
        import_hf(hf_dirs["mixtral"], tmp_path / "out", tp=1, pp=1, ep=3, quiet=True)
    with pytest.raises(ConfigError, match="is dense: drop --ep"):
        import_hf(hf_dirs["qwen3"], tmp_path / "out", tp=1, pp=1, ep=2, quiet=True)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("case,tp,pp,ep", [("mixtral", 1, 2, 2), ("qwen3_moe", 2, 1, 1), ("qwen2_moe", 2, 1, 1)])
def test_megatron_core_moe_model_loads_our_shards(case, tp, pp, ep, hf_dirs, tmp_path):
    """megatron-core's own GPTModel with MoE layers (SequentialMLP experts; with EP, its expert parallelism over the
    data-parallel ranks) loads each rank's file of ours with strict=True, and its forward gives transformers'
    logits."""
    from conftest import torchrun
    import_hf(hf_dirs[case], tmp_path / "ours", tp=tp, pp=pp, ep=ep, optimizer=False, quiet=True)
    spec = hf.spec_from_hf(hf_dirs[case] / "config.json")
    torch.save(TOKENS, tmp_path / "tokens.pt")
    cfg = {"model": spec.to_dict(), "tp": tp, "pp": pp, "ep": ep, "form": "ours", "load": str(tmp_path / "ours"),
           "padded_vocab": spec.padded_vocab_size(tp), "tokens": str(tmp_path / "tokens.pt"),
           "out": str(tmp_path / "logits.pt")}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    torchrun(tp * pp * ep, ["tests/mcore_load.py", str(tmp_path / "config.json")], timeout=600)
    theirs = torch.load(tmp_path / "logits.pt")["logits"][..., :VOCAB]
    _, want = logits(hf_dirs[case], TOKENS)
    assert rel(theirs, want) < 1e-5


@pytest.mark.slow
def test_trainer_splits_experts_over_data_parallel_ranks(tmp_path):
    """EP2 over DP2 (megatron-core's expert parallelism: each rank holds two of the four experts, tokens gathered
    and their outputs summed back across the EP group) trains the same curve as every expert on every rank; its
    checkpoint has a file per EP rank, which resharded to EP1 resumes the EP1 run's curve, and the EP1 checkpoint
    resharded to EP2 resumes at EP2. The load-balancing loss keeps the experts evenly loaded (the logged balance)."""
    moe = {"architecture": "mixtral", "num_moe_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01,
           "tp_degree": 1, "pp_degree": 1, "train_iters": 6, "save_interval": 3, "num_micro_batches": 2}
    ep2 = train("tiny_llama.yaml", tmp_path / "ep2" / "save", 2, ep_degree=2, **moe)
    ep1 = train("tiny_llama.yaml", tmp_path / "ep1" / "save", 2, ep_degree=1, **moe)
    assert ep1[-1]["loss"] < ep1[0]["loss"] - 0.05, [m["loss"] for m in ep1]
    # the experts share the tokens: E x sum_e (share routed to e) x (mean probability of e) is 1 when even, 4 at worst
    assert all(m["moe_balance"] < 1.2 for m in ep1 + ep2), [m["moe_balance"] for m in ep1 + ep2]
    for a, b in zip(ep1, ep2):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
        # the norms agree to fp32 summation order: without EP the norm is one fp32 sum over the whole flat buffer
        # (~5e-5 off a float64 sum on CPU), with EP a sum of per-parameter norms (~2e-6 off)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 2e-4 * abs(a["grad_norm"]), (a, b)
    saved = tmp_path / "ep2" / "save" / "checkpoint-3"
    assert (saved / "pytorch_model_tp_0_pp_0_ep_1.bin").is_file()
    reshard(saved, tmp_path / "to_ep1" / "save", tp=1, pp=1, ep=1, quiet=True)
    resumed = train("tiny_llama.yaml", tmp_path / "to_ep1" / "save", 2, ep_degree=1, **moe)
    reshard(tmp_path / "ep1" / "save" / "checkpoint-3", tmp_path / "to_ep2" / "save", tp=1, pp=1, ep=2, quiet=True)
    resumed_ep2 = train("tiny_llama.yaml", tmp_path / "to_ep2" / "save", 2, ep_degree=2, **moe)
    for run in (resumed, resumed_ep2):
        assert [m["iteration"] for m in run] == [4, 5, 6]
        for a, b in zip(ep1[3:], run):
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_trainer_trains_with_megatron_cores_own_moe_layer(arch, tmp_path):
    """`moe_layer: megatron_core`: megatron-core's MoELayer (TopKRouter, alltoall dispatcher over EP2, SequentialMLP
    experts, Qwen2-MoE's gated shared expert as its SharedExpertMLP, its load-balancing loss through
    MoEAuxLossAutoScaler) trains the curve of the trainer's own MoE layer from the same initial weights; its
    checkpoint holds the same keys, and the trainer's own layer resumes it on the same curve (and the other way
    round)."""
    moe = {"architecture": arch, "num_moe_experts": 4, "moe_router_topk": 2, "moe_aux_loss_coeff": 0.01,
           "tp_degree": 1, "pp_degree": 1, "ep_degree": 2, "train_iters": 6, "save_interval": 3,
           "num_micro_batches": 2}
    if arch == "qwen2_moe":
        moe.update(moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=48, moe_router_pre_softmax=True)
    theirs = train("tiny_llama.yaml", tmp_path / "mcore" / "save", 2, moe_layer="megatron_core", **moe)
    ours = train("tiny_llama.yaml", tmp_path / "ours" / "save", 2, moe_layer="ours", **moe)
    assert theirs[-1]["loss"] < theirs[0]["loss"] - 0.05, [m["loss"] for m in theirs]
    for a, b in zip(ours, theirs):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)
    for src, layer, want in (("mcore", "ours", ours), ("ours", "megatron_core", theirs)):
        run = tmp_path / f"{src}_to_{layer}" / "save"
        reshard(tmp_path / src / "save" / "checkpoint-3", run, tp=1, pp=1, ep=2, quiet=True)
        resumed = train("tiny_llama.yaml", run, 2, moe_layer=layer, **moe)
        assert [m["iteration"] for m in resumed] == [4, 5, 6]
        for a, b in zip(want[3:], resumed):
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a, b)


@pytest.mark.slow
def test_megatron_core_moe_checkpoint_with_another_expert_tensor_parallel_size_merges(tmp_path):
    """megatron-core's MoE GPTModel at TP2 with its experts unsplit (--expert-tensor-parallel-size 1; the experts then
    lie whole on each TP rank), saved as Megatron-LM does: the torch_dist save (experts as global tensors, whatever
    their split) merges to a transformers Mixtral with megatron-core's own logits, and reshards into our format
    (experts split over TP as the dense layers) bit-exactly; the legacy form of such a run is refused in one line."""
    from conftest import torchrun

    from ckpt_tools.errors import ConfigError
    model = {"architecture": "mixtral", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
             "num_query_groups": 2, "ffn_hidden_size": 96, "vocab_size": VOCAB, "max_position_embeddings": 128,
             "norm_epsilon": 1e-5, "num_moe_experts": 4}
    (tmp_path / "config.json").write_text(json.dumps({"model": model, "tp": 2, "pp": 1, "etp": 1, "iteration": 5}))
    torchrun(2, ["tests/mcore_checkpoints.py", str(tmp_path / "config.json"), str(tmp_path)], timeout=600)
    tokens, expected = torch.load(tmp_path / "tokens.pt"), torch.load(tmp_path / "logits.pt")[..., :VOCAB]
    merge(tmp_path / "torch_dist", tmp_path / "merged", vocab_size=VOCAB, quiet=True)
    cls, ours = logits(tmp_path / "merged", tokens)
    assert cls == "MixtralForCausalLM" and rel(ours, expected) < 1e-5
    reshard(tmp_path / "torch_dist", tmp_path / "ours", tp=2, pp=1, vocab_size=VOCAB, quiet=True)
    merge(tmp_path / "ours", tmp_path / "merged_ours", quiet=True)
    first = load_safetensors(tmp_path / "merged" / "model.safetensors")
    again = load_safetensors(tmp_path / "merged_ours" / "model.safetensors")
    assert sorted(again) == sorted(first) and all(torch.equal(again[k], first[k]) for k in first)
    with pytest.raises(ConfigError, match="expert_tensor_parallel_size 1 differs from tensor_model_parallel_size 2"):
        merge(tmp_path / "torch", tmp_path / "legacy", vocab_size=VOCAB, quiet=True)
    assert not (tmp_path / "legacy").exists()
