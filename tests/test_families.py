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
import re
from pathlib import Path

import pytest
import torch
from conftest import train
from safetensors.torch import load_file as load_safetensors

from ckpt_tools import families, hf
from ckpt_tools.errors import ConfigError
from ckpt_tools.merge import merge
from ckpt_tools.importer import import_hf
from ckpt_tools.request import Layout
from ckpt_tools.reshard import reshard
from ckpt_tools.spec import ModelSpec

VOCAB = 1000
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
          "bos_token_id": 1, "eos_token_id": 2}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 32}
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
    # multi-latent attention (q and kv latents, a rotary part per head), the first layer dense, then MoE layers: a
    # shared expert and sigmoid routing of top-4 of 8 with an expert bias, the best 2 of 4 groups, weights scaled
    "deepseek_v3": ("DeepseekV3Config", {"num_key_value_heads": 4, "rms_norm_eps": 1e-6, "q_lora_rank": 24,
                                         "kv_lora_rank": 16, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8,
                                         "v_head_dim": 12, "n_routed_experts": 8, "num_experts_per_tok": 4,
                                         "moe_intermediate_size": 32, "n_shared_experts": 1, "n_group": 4,
                                         "topk_group": 2, "routed_scaling_factor": 2.5, "first_k_dense_replace": 1,
                                         "num_nextn_predict_layers": 0,
                                         # YaRN as DeepSeek-V3 ships it
                                         # (megatron-core's MLA takes the original context and betas from its
                                         # defaults: 4096, 32, 1; the blend still moves the rotary dims 1-3 of 4)
                                         "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                             "original_max_position_embeddings": 4096, "beta_fast": 32,
                                                             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
                                         "max_position_embeddings": 128}, "deepseek_v3"),
    # GLM-4.5: QKV biases, per-head q/k norms, RoPE on half of each head, a dense first layer, then DeepSeek's MoE
    "glm4_moe": ("Glm4MoeConfig", {"head_dim": 24, "attention_bias": True, "use_qk_norm": True,
                                   "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 0.5},
                                   "n_routed_experts": 8, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
                                   "n_shared_experts": 1, "n_group": 4, "topk_group": 2, "routed_scaling_factor": 1.5,
                                   "first_k_dense_replace": 1, "num_nextn_predict_layers": 0}, "glm4_moe"),
    # GPT-OSS: biased attention with a sink logit per head, an 8-position window on layers 0 and 2, YaRN with its
    # correction range unrounded, top-2 of 4 biased experts with a clamped GLU, stacked in transformers' tensors
    "gpt_oss": ("GptOssConfig", {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
                                 "rope_parameters": GPT_OSS_YARN}, "gpt_oss"),
    # Nemotron-H: a block per layer (Mamba-2, attention without positions, a squared-ReLU MLP), Mamba's 8 heads of 16
    # in 2 groups with a state of 16, scanned by transformers in chunks of 16 (seq 48: three)
    "nemotron_h": ("NemotronHConfig", {"layers_block_type": ["linear_attention", "full_attention", "linear_attention",
                                                             "mlp"], "head_dim": 16, "mamba_num_heads": 8,
                                       "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16, "chunk_size": 16},
                   "nemotron_h"),
    # Qwen3-Next: gated DeltaNet layers (2 key heads of 8, 4 value heads of 8) and a gated attention layer (per-head
    # q/k norms, a quarter of each head rotated), zero-centred norms, top-2 of 4 experts and a gated shared expert
    "qwen3_next": ("Qwen3NextConfig", {"head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                                       "linear_key_head_dim": 8, "linear_value_head_dim": 8, "num_experts": 4,
                                       "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                       "shared_expert_intermediate_size": 48}, "qwen3_next"),
}


def hf_model(case: str):
    import transformers
    cls, extra, _ = CASES[case]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**{**COMMON, **extra}))
    with torch.no_grad():  # every tensor distinct from its neighbours: norms 1 and biases 0 hide mis-orderings
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for name, p in model.named_parameters():  # transformers' Nemotron-H clamps each Mamba step at
            if name.endswith("mixer.dt_bias"):  # time_step_min, megatron-core's does not: steps stay above it here
                p.clamp_(min=-2.0)
        for name, b in model.named_buffers():  # DeepSeek-V3's expert bias (zeros at init) steers the routing
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn_like(b) * 0.1)
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


FORWARD = ("deepseek_v3", "gemma", "glm4_moe", "gpt_oss", "llama3_tied", "mixtral", "nemotron_h", "olmoe", "phi3", "qwen2",
           "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next")  # mistral's head_dim path is qwen3's, qwen2_tied's is qwen2's


@pytest.mark.slow
@pytest.mark.parametrize("case", FORWARD)
def test_sharded_forward_equals_transformers(case, hf_dirs, tmp_path):
    from ckpt_tools import verify
    import_hf(hf_dirs[case], tmp_path / "shards", tp=2, pp=1, optimizer=False, quiet=True)
    tiers, _ = verify.run(tmp_path / "shards", hf_dirs[case], seq=48, batch=2)
    assert all(t.ok for t in tiers), [(t.name, t.reason) for t in tiers]
    assert tiers[2].data["rel_l2"] < 1e-5, tiers[2].data["rel_l2"]


@pytest.mark.slow
def test_gated_deltanet_moe_model_at_ep2(hf_dirs, tmp_path):
    """Qwen3-Next at TP2 x PP2 x EP2 (its experts over EP ranks beside the DeltaNet's heads over TP): resharded to one
    rank it merges to transformers' tensors bit for bit, and the EP2 checkpoint's sharded forward gives
    transformers' logits."""
    from ckpt_tools import verify
    import_hf(hf_dirs["qwen3_next"], tmp_path / "ep2", tp=2, pp=2, ep=2, optimizer=False, quiet=True)
    reshard(tmp_path / "ep2", tmp_path / "one", tp=1, pp=1, ep=1, quiet=True)
    merge(tmp_path / "one", tmp_path / "merged", quiet=True)
    original = load_safetensors(hf_dirs["qwen3_next"] / "model.safetensors")
    merged = load_safetensors(tmp_path / "merged" / "model.safetensors")
    assert sorted(merged) == sorted(original) and all(torch.equal(merged[k], original[k]) for k in original)
    tiers, _ = verify.run(tmp_path / "ep2", hf_dirs["qwen3_next"], seq=48, batch=2)
    assert all(t.ok for t in tiers), [(t.name, t.reason) for t in tiers]
    assert tiers[2].data["rel_l2"] < 1e-5


OWN_FIELDS = {  # the sizes a family's blocks need beyond the common ones
    "deepseek_v3": {"norm_epsilon": 1e-6, "q_lora_rank": 24, "kv_lora_rank": 16, "qk_head_dim": 12,
                    "qk_pos_emb_head_dim": 8, "v_head_dim": 12, "moe_ffn_hidden_size": 24, "layer_pattern": "+-+E",
                    "moe_router_num_groups": 2, "moe_router_group_topk": 1, "moe_router_topk_scaling_factor": 2.5},
    "glm4_moe": {"moe_ffn_hidden_size": 24, "layer_pattern": "*-*E", "rotary_percent": 0.5, "add_qkv_bias": True,
                 "moe_router_num_groups": 2, "moe_router_group_topk": 1, "moe_router_topk_scaling_factor": 2.5},
    "gpt_oss": {"sliding_window": 8, "window_attn_skip_freq": 2, "activation_clamp": 7.0, "rope_scaling": "yarn",
                "rope_scaling_factor": 4.0,
                "rope_original_max_position_embeddings": 32, "rope_truncate": False, "rope_mscale_all_dim": 0.0},
    "nemotron_h": {"layer_pattern": "M*", "mamba_num_heads": 8, "mamba_head_dim": 16, "mamba_state_dim": 16,
                   "mamba_num_groups": 2},
    "qwen3_next": {"layer_pattern": "GE*E", "rotary_percent": 0.25, "linear_num_key_heads": 2,
                   "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                   "linear_conv_kernel_dim": 4, "moe_ffn_hidden_size": 32}}


def test_family_records_map_their_config_both_ways():
    """Each family writes a config.json that it reads back as the same spec, and declares a default for
    every feature field."""
    for family in families.all_families():
        assert set(family.features) == set(families.FEATURES), family.name
        spec = ModelSpec(architecture=family.name, num_layers=2, hidden_size=64, num_attention_heads=4,
                         num_query_groups=4 if family.name in ("gpt2", "deepseek_v3") else 2, ffn_hidden_size=96,
                         vocab_size=VOCAB, kv_channels=16, max_position_embeddings=128,
                         **({"num_moe_experts": 4, "moe_router_topk": 2} if family.moe else {}),
                         **({"moe_shared_expert_intermediate_size": 48} if family.shared_experts else {}),
                         **OWN_FIELDS.get(family.name, {}))
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
    ({"model_type": "deepseek_v3", "rope_interleave": False}, "rope_interleave=false is not supported"),
    ({"model_type": "deepseek_v3", "norm_topk_prob": False}, "norm_topk_prob=false is not supported"),
    ({"model_type": "deepseek_v3", "rms_norm_eps": 1e-5}, "rms_norm_eps 1e-05 is not 1e-6"),
    ({"model_type": "deepseek_v3", "n_group": 2, "topk_group": 2}, "topk_group 2: transformers scores a group"),
    ({"model_type": "deepseek_v3", "first_k_dense_replace": 2}, "first_k_dense_replace 2 with 2 layers"),
    ({"model_type": "deepseek_v3", "rope_parameters": {"rope_type": "yarn", "factor": 40.0, "truncate": False}},
     "yarn with truncate false or an explicit attention_factor is not supported"),
    ({"model_type": "deepseek_v3", "rope_parameters": {"rope_type": "yarn"}}, "yarn without a factor"),
    ({"model_type": "deepseek_v3", "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "mscale": 0,
                                                       "mscale_all_dim": 1.0}}, "yarn with mscale 0 and mscale_all_dim"),
    ({"model_type": "qwen3", "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling 'yarn' is not"),
    ({"model_type": "glm4_moe", "norm_topk_prob": False}, "norm_topk_prob=false is not supported"),
    ({"model_type": "llama", "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5 is not supported"),
    ({"model_type": "gpt_oss", "attention_bias": False}, "attention_bias=false is not supported (attention without"),
    ({"model_type": "gpt_oss", "swiglu_alpha": 1.5}, "swiglu_alpha 1.5 is not supported"),
    ({"model_type": "gpt_oss", "layer_types": ["full_attention", "sliding_attention"]},
     "megatron-core's window_attn_skip_freq makes every N-th layer full"),
    ({"model_type": "gpt_oss", "sliding_window": 0}, "sliding_window 0 (a number of positions"),
    ({"model_type": "nemotron_h", "layers_block_type": ["linear_attention", "moe"]}, "MoE layers ('E' in 'ME'"),
    ({"model_type": "nemotron_h", "conv_kernel": 2}, "conv_kernel 2 is not supported (a convolution of another"),
    ({"model_type": "nemotron_h", "mlp_hidden_act": "silu"}, "mlp_hidden_act 'silu' is not supported"),
    ({"model_type": "nemotron_h", "layer_norm_epsilon": 1e-6}, "megatron-core's gated norm inside each mixer fixes"),
    ({"model_type": "nemotron_h", "mamba_num_heads": 3}, "mamba_num_heads 3 is not divisible by mamba_num_groups 2"),
    ({"model_type": "nemotron_h", "layers_block_type": ["linear_attention", "convolution"]},
     "layers_block_type ['linear_attention', 'convolution']"),
    ({"model_type": "qwen3_next", "mlp_only_layers": [1]}, "mlp_only_layers [1] is not supported (layers with a dense"),
    ({"model_type": "qwen3_next", "attention_bias": True}, "attention_bias=true is not supported"),
    ({"model_type": "qwen3_next", "layer_types": ["linear_attention", "sliding_attention"]},
     "layer_types ['linear_attention', 'sliding_attention'] is not 2 entries"),
    ({"model_type": "qwen3_next", "linear_num_value_heads": 3}, "linear_num_value_heads 3 is not divisible by"),
])
def test_fields_a_family_cannot_honour_are_refused(changes, expected, tmp_path):
    moe = {"num_moe_experts": 4} if families.get(changes["model_type"]).moe else {}
    if families.get(changes["model_type"]).shared_experts:
        moe["moe_shared_expert_intermediate_size"] = 48
    spec = ModelSpec(architecture=changes["model_type"], num_layers=2, hidden_size=64, num_attention_heads=4,
                     ffn_hidden_size=96, vocab_size=VOCAB, **moe, **OWN_FIELDS.get(changes["model_type"], {}))
    config = {**hf.hf_config(spec, "float32", None, None), **changes}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(Exception) as e:
        hf.spec_from_hf(path)
    assert expected in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("fields,expected", [
    ({"architecture": "gpt_oss", "num_moe_experts": 4, "rope_scaling": "yarn"},
     "activation_clamp unset: transformers' GPT-OSS always clamps"),
    ({"architecture": "gpt_oss", "num_moe_experts": 4, "activation_clamp": 7.0, "rope_scaling": None,
      "rope_truncate": False}, "rope_truncate false (YaRN's correction range unrounded) with rope_scaling None"),
    ({"architecture": "deepseek_v3", "rope_truncate": False, "rope_scaling": "yarn", **OWN_FIELDS["deepseek_v3"],
      "num_moe_experts": 4, "moe_shared_expert_intermediate_size": 48}, "only YaRN in the families whose config says so"),
    ({"architecture": "llama", "sliding_window": 8}, "sliding_window 8 given, but llama attends to every earlier"),
    ({"architecture": "llama", "activation_clamp": 7.0}, "glu_linear_offset / activation_clamp with activation 'swiglu'"),
    ({"architecture": "llama", "mamba_num_heads": 8}, "mamba_num_heads given, but llama has no Mamba layers"),
    ({"architecture": "nemotron_h", **OWN_FIELDS["nemotron_h"], "mamba_state_dim": None},
     "a Mamba-2 mixer needs mamba_state_dim"),
    ({"architecture": "nemotron_h", **OWN_FIELDS["nemotron_h"], "layer_pattern": "M*-"},
     "layer_pattern 'M*-' is not 2 symbols"),
    ({"architecture": "nemotron_h", **OWN_FIELDS["nemotron_h"], "layer_pattern": "M+"},
     "symbol(s) '+' not read for nemotron_h"),
    ({"architecture": "qwen3", "linear_num_key_heads": 2}, "linear_num_key_heads given, but qwen3 has no gated"),
    ({"architecture": "qwen3_next", **OWN_FIELDS["qwen3_next"], "num_moe_experts": 4,
      "moe_shared_expert_intermediate_size": 48, "layer_pattern": "GEG-"}, "layer_pattern 'GEG-': dense MLPs"),
])
def test_model_fields_a_family_cannot_hold_are_refused(fields, expected):
    base = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 96, "vocab_size": VOCAB}
    with pytest.raises(ConfigError, match=re.escape(expected)):
        ModelSpec(**{**base, **fields})


# ---------------------------------------------------------------- megatron-core's own model of each family
MCORE = {  # ModelSpec fields of megatron-core GPTModels whose features the Llama-like families add
    # GLM-4.5: QKV biases, q/k norms, half-rotary heads, a dense layer, then sigmoid / grouped / scaled routing
    "glm4_moe": {"architecture": "glm4_moe", "kv_channels": 24, "add_qkv_bias": True, "qk_layernorm": True,
                 "rotary_percent": 0.5, "num_moe_experts": 8, "moe_router_topk": 4, "moe_ffn_hidden_size": 32,
                 "moe_shared_expert_intermediate_size": 32, "moe_router_num_groups": 4, "moe_router_group_topk": 2,
                 "moe_router_topk_scaling_factor": 1.5, "layer_pattern": "*-*E*E*E"},
    "qwen2_tied": {"architecture": "qwen2", "tie_word_embeddings": True},
    "qwen3": {"architecture": "qwen3", "kv_channels": 24},
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
        from ckpt_tools.formats import dcp
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
    with pytest.raises(ConfigError, match="written in Megatron-LM's torch_dist form only by this version, not in torch"):
        import_hf(hf_dirs["qwen3_next"], tmp_path / "out", tp=1, pp=1, form="torch", quiet=True)
    assert not (tmp_path / "out").exists()


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




def test_yarn_megatron_lm_cannot_say_is_not_written_in_its_forms():
    """megatron-core's MLA takes YaRN's original context and betas from its config defaults (4096, 32, 1: no
    Megatron-LM argument sets them): a DeepSeek-V3 of another original context is refused for Megatron-LM's forms
    in one line, and the load command names the rotary flags --use-checkpoint-args does not restore."""
    from pathlib import Path

    from ckpt_tools import megatron_args, to_megatron
    from ckpt_tools.errors import ConfigError
    fields = {**OWN_FIELDS["deepseek_v3"], "rope_scaling": "yarn", "rope_scaling_factor": 40.0,
              "rope_mscale_all_dim": 1.0}
    spec = ModelSpec(architecture="deepseek_v3", num_layers=2, hidden_size=64, num_attention_heads=4,
                     num_query_groups=4, ffn_hidden_size=96, vocab_size=VOCAB, num_moe_experts=4, moe_router_topk=2,
                     moe_shared_expert_intermediate_size=48, **{**fields, "rope_original_max_position_embeddings": 32})
    with pytest.raises(ConfigError, match="YaRN with rope_original_max_position_embeddings 32 \\(Megatron-LM: 4096\\)"):
        megatron_args.check_expressible(spec)
    ok = ModelSpec(**{**spec.to_dict(), "rope_original_max_position_embeddings": 4096})
    megatron_args.check_expressible(ok)
    line = to_megatron.loads_with(Path("out"), Layout("torch_dist", 1, [spec.num_layers], 128), spec=ok)
    assert "--rope-type yarn --rotary-scaling-factor 40 --mscale 1 --mscale-all-dim 1" in line, line
