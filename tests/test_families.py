"""Model families (ckpt_tools/model/families) as whole models, each against its independent references:

- transformers builds the model (tiny, random, every norm and bias non-trivial); `ckpt import` at TP2 x PP2,
  `ckpt reshard` to TP1 x PP2 and `ckpt merge` give every tensor back bit for bit, and transformers loads
  the merge as the same class with the same logits;
- `ckpt verify` of imported shards against the original runs the trainer's sharded forward (TP2) against
  transformers' forward: logits within 1e-5 (fp32);
- megatron-core's own GPTModel with the family's features (qkv bias, qk layernorm, llama3 rope scaling),
  saved by megatron-core as Megatron-LM does, merged by `ckpt merge`: transformers' logits on the merge
  equal megatron-core's own logits;
- the trainer trains the family (loss falls) and a resharded checkpoint resumes the curve;
- in Megatron-LM's forms: a model megatron-core cannot build is not written, and the families that share Llama's
  Megatron-LM arguments come back as themselves.

The cases are tests/families_cases.py's; what each family's config maps to and refuses, with no model built, is
proven in test_families_config.py; the MoE families against megatron-core's MoE model in test_families_moe.py,
DeepSeek-V3's MLA model and multi-token prediction layers in test_families_deepseek.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import train
from families_cases import CASES, OWN_FIELDS, TOKENS, VOCAB, logits, rel
from families_cases import hf_dirs  # noqa: F401 (a fixture)
from safetensors.torch import load_file as load_safetensors

from ckpt_tools.model import hf
from ckpt_tools.errors import ConfigError
from ckpt_tools.verbs.merge import merge
from ckpt_tools.verbs.importer import import_hf
from ckpt_tools.verbs.reshard import reshard


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


# every case but mistral (its head_dim path is qwen3's), qwen2 and qwen2_tied (QKV biases: glm's), seed_oss (glm's
# biases and head_dim) and ernie4_5 (ernie4_5_bias's rotation, tied as llama3_tied)
FORWARD = ("deepseek_v3", "ernie4_5_bias", "gemma", "glm", "glm4_moe", "gpt_oss", "llama3_tied", "mixtral",
           "nemotron_h", "olmoe", "phi3", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next")


@pytest.mark.slow
@pytest.mark.parametrize("case", FORWARD)
def test_sharded_forward_equals_transformers(case, hf_dirs, tmp_path):
    from ckpt_tools.verbs import verify
    import_hf(hf_dirs[case], tmp_path / "shards", tp=2, pp=1, optimizer=False, quiet=True)
    tiers, _ = verify.run(tmp_path / "shards", hf_dirs[case], seq=48, batch=2)
    assert all(t.ok for t in tiers), [(t.name, t.reason) for t in tiers]
    assert tiers[2].data["rel_l2"] < 1e-5, tiers[2].data["rel_l2"]


@pytest.mark.slow
def test_gated_deltanet_moe_model_at_ep2(hf_dirs, tmp_path):
    """Qwen3-Next at TP2 x PP2 x EP2 (its experts over EP ranks beside the DeltaNet's heads over TP): resharded to one
    rank it merges to transformers' tensors bit for bit, and the EP2 checkpoint's sharded forward gives
    transformers' logits."""
    from ckpt_tools.verbs import verify
    import_hf(hf_dirs["qwen3_next"], tmp_path / "ep2", tp=2, pp=2, ep=2, optimizer=False, quiet=True)
    reshard(tmp_path / "ep2", tmp_path / "one", tp=1, pp=1, ep=1, quiet=True)
    merge(tmp_path / "one", tmp_path / "merged", quiet=True)
    original = load_safetensors(hf_dirs["qwen3_next"] / "model.safetensors")
    merged = load_safetensors(tmp_path / "merged" / "model.safetensors")
    assert sorted(merged) == sorted(original) and all(torch.equal(merged[k], original[k]) for k in original)
    tiers, _ = verify.run(tmp_path / "ep2", hf_dirs["qwen3_next"], seq=48, batch=2)
    assert all(t.ok for t in tiers), [(t.name, t.reason) for t in tiers]
    assert tiers[2].data["rel_l2"] < 1e-5


# ---------------------------------------------------------------- megatron-core's own model of each family
MCORE = {  # ModelSpec fields of megatron-core GPTModels whose features the Llama-like families add (Qwen2's and
    # Seed-OSS's QKV biases and explicit head_dim are GLM-4's too, tied embeddings ERNIE 4.5's)
    # GLM-4.5: QKV biases, q/k norms, half-rotary heads, a dense layer, then sigmoid / grouped / scaled routing
    "glm4_moe": {"architecture": "glm4_moe", "kv_channels": 24, "add_qkv_bias": True, "qk_layernorm": True,
                 "rotary_percent": 0.5, "num_moe_experts": 8, "moe_router_topk": 4, "moe_ffn_hidden_size": 32,
                 "moe_shared_expert_intermediate_size": 32, "moe_router_num_groups": 4, "moe_router_group_topk": 2,
                 "moe_router_topk_scaling_factor": 1.5, "layer_pattern": "*-*E*E*E"},
    "qwen3": {"architecture": "qwen3", "kv_channels": 24},
    # ERNIE 4.5: RoPE on adjacent pairs (megatron-core's rotary_interleaved), a bias on every linear layer, tied
    "ernie4_5": {"architecture": "ernie4_5", "kv_channels": 24, "add_bias_linear": True},
    # GLM-4: QKV biases, RoPE on the first half of each head in adjacent pairs
    "glm": {"architecture": "glm", "kv_channels": 24, "add_qkv_bias": True, "rotary_percent": 0.5},
    "llama3": {"architecture": "llama", "rope_scaling": "llama3", "rope_scaling_factor": 8.0, "rotary_base": 500000.0},
    # GPT-OSS: sinks, windows on alternate layers, GPTModel's YaRN unrounded, biased experts (ETP 1) with the clamped
    # GLU of +1
    "gpt_oss": {"architecture": "gpt_oss", "ffn_hidden_size": 32, "kv_channels": 16, "num_moe_experts": 4,
                "moe_router_topk": 2, **{k: v for k, v in OWN_FIELDS["gpt_oss"].items()}, "rotary_base": 150000.0},
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
    tokens, expected = torch.load(tmp_path / "tokens.pt"), torch.load(tmp_path / "logits.pt")[..., :VOCAB]
    # GPT-OSS's biased experts are whole in each TP rank's legacy file (megatron-core's ETP 1): that form too
    for form in ("torch_dist", "torch") if case == "gpt_oss" else ("torch_dist",):
        merge(tmp_path / form, tmp_path / f"merged_{form}", vocab_size=VOCAB, quiet=True)
        _, ours = logits(tmp_path / f"merged_{form}", tokens)
        assert rel(ours, expected) < 1e-5, form


# ---------------------------------------------------------------- the trainer trains each family
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "gemma", "mixtral", "olmoe", "qwen2_moe", "deepseek_v3", "gpt_oss",
                                  "nemotron_h", "qwen3_next"])
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
    if arch == "deepseek_v3":  # MLA at TP2 (its latent norms' gradients whole on each rank), a dense first layer,
        # sigmoid routing of top-2 of 4 experts in 2 groups with an expert bias and a shared expert
        extra.update(num_query_groups=4, norm_epsilon=1e-6, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=12,
                     qk_pos_emb_head_dim=8, v_head_dim=12, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                     moe_shared_expert_intermediate_size=32, moe_router_num_groups=2, moe_router_group_topk=1,
                     moe_router_topk_scaling_factor=2.5, layer_pattern="+-+E+E+E", moe_aux_loss_coeff=0.01)
    if arch == "gpt_oss":  # sinks split over TP by heads, an 8-position window on layers 0 and 2 (seq 64), biased
        # router and experts with the clamped GLU, YaRN unrounded
        extra.update(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01, ffn_hidden_size=32, kv_channels=16,
                     **OWN_FIELDS["gpt_oss"], rotary_base=150000.0)
    if arch == "nemotron_h":  # a block per layer: Mamba-2 (its heads, groups and channels split over TP), attention
        # without positions, a squared-ReLU MLP; resumed at PP2, a Mamba layer on each stage
        extra.update(layer_pattern="M*M-", mamba_num_heads=8, mamba_head_dim=16, mamba_state_dim=16,
                     mamba_num_groups=2)
    if arch == "qwen3_next":  # gated DeltaNet layers (key and value heads split over TP, the recurrence per rank) and a
        # gated attention layer with zero-centred q/k norms and a quarter of each head rotated, MoE with a gated shared
        # expert
        extra.update(layer_pattern="GEGEGE*E", kv_channels=16, rotary_percent=0.25, linear_num_key_heads=2,
                     linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                     num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                     moe_shared_expert_intermediate_size=48, moe_aux_loss_coeff=0.01)
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
    parts = {"nemotron_h": ("mixer", ("z", "x", "B", "C", "dt")),
             "qwen3_next": ("self_attention", ("query", "key", "value", "z", "beta", "alpha"))}
    if arch in parts:  # through Megatron-LM's torch_dist and back, optimizer state included: Mamba's and the DeltaNet's
        # in_proj and convolution as megatron-core's per-part tensors (`...in_proj.weight.z`), their moments too
        from ckpt_tools.forms import dcp
        reshard(run / "checkpoint-3", tmp_path / "mlm", tp=1, pp=2, form="torch_dist", quiet=True)
        index = dcp.read_metadata(tmp_path / "mlm" / "iter_0000003")
        module, names = parts[arch]
        for part in names:
            assert f"optimizer.state.exp_avg.decoder.layers.0.{module}.in_proj.weight.{part}" in index.tensors
        reshard(tmp_path / "mlm", tmp_path / "back", tp=2, pp=1, quiet=True)
        for t in range(2):
            same_optimizer(run, tmp_path / "back", f"checkpoint-3/optimizer_tp_{t}_pp_0.bin")


def same_optimizer(a: Path, b: Path, name: str) -> None:
    """The optimizer file `name` of two runs' save dirs holds the same tensors, bit for bit."""
    x, y = (torch.load(d / name, weights_only=True)["optimizer"] for d in (a, b))
    assert sorted(x) == sorted(y)
    for key in x:
        for field in ("master", "exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(x[key][field], y[key][field]), (name, key, field)


# ---------------------------------------------------------------- Megatron-LM's forms of each family
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


def test_transformer_engine_only_models_are_written_in_torch_dist_only(hf_dirs, tmp_path):
    """Qwen3-Next's gated DeltaNet layers and zero-centred norms exist in megatron-core as Transformer Engine modules
    only: the legacy form (local names) is refused in one line, before anything is written."""
    with pytest.raises(ConfigError,
                       match="written in Megatron-LM's torch_dist form only by this version, not in torch"):
        import_hf(hf_dirs["qwen3_next"], tmp_path / "out", tp=1, pp=1, form="torch", quiet=True)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["mistral", "phi3", "seed_oss", "ernie4_5_bias"])
def test_families_sharing_megatron_arguments_come_back_as_themselves(case, hf_dirs, tmp_path):
    """Mistral's and Phi-3's Megatron-LM arguments are Llama's, Seed-OSS's Qwen2's: the written args name the
    family, so a merge of the Megatron-LM checkpoint is a Mistral / Phi-3 / Seed-OSS model again. ERNIE 4.5's
    rotary_interleaved is its own: read back from the arguments, it is an ERNIE 4.5 model again too."""
    from ckpt_tools.verbs.inspect import describe
    import_hf(hf_dirs[case], tmp_path / "megatron", tp=1, pp=2, form="torch", quiet=True)
    assert ("RoPE (base 500000, interleaved)" in describe(tmp_path / "megatron")) == (case == "ernie4_5_bias")
    merge(tmp_path / "megatron", tmp_path / "merged", quiet=True)
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["model_type"] == CASES[case][2]
    original = load_safetensors(hf_dirs[case] / "model.safetensors")
    merged = load_safetensors(tmp_path / "merged" / "model.safetensors")
    assert sorted(merged) == sorted(original) and all(torch.equal(merged[k], original[k]) for k in original)



def test_norm_offsets_are_made_per_tensor_on_the_byte_path(hf_dirs, tmp_path):
    """Qwen3-Next's zero-centred norms (HF holds 1 + w): the byte path joins each such tensor and makes it by torch,
    copying the rest; the output is the torch path's, file for file (as HF, and cast to bf16 as safetensors), and
    without a cast the HF model's own weights."""
    from test_merge_sources import assert_same_as_torch
    import_hf(hf_dirs["qwen3_next"], tmp_path / "shards", tp=2, pp=2, quiet=True)
    for options in ({}, {"dtype": "bf16", "fmt": "safetensors"}):
        out = tmp_path / (options.get("dtype") or "same")
        assert assert_same_as_torch(tmp_path / "shards", out, **options)
    original = load_safetensors(hf_dirs["qwen3_next"] / "model.safetensors")
    merged = load_safetensors(tmp_path / "same" / "fast" / "merged" / "model.safetensors")
    assert sorted(merged) == sorted(original) and all(torch.equal(merged[k], original[k]) for k in original)
