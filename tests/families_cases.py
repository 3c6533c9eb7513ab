"""The model families' test cases, shared by tests/test_families*.py (and the tests that take a family's model):
transformers' tiny configs of every family (CASES), the random models built from them (hf_model) and saved once per
test module (the hf_dirs fixture), the sizes each family's blocks need beyond the common ones (OWN_FIELDS), and the
logits and relative error the tests compare.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

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
    # QKV biases as Qwen2's, head_dim explicit (4 x 24 heads != 64), transformers' training dropouts (0.1)
    "seed_oss": ("SeedOssConfig", {"head_dim": 24}, "seed_oss"),
    # RoPE on adjacent pairs of dims, tied embeddings (its default); and with a bias on every linear layer, untied
    "ernie4_5": ("Ernie4_5Config", {"head_dim": 24, "pad_token_id": None}, "ernie4_5"),
    "ernie4_5_bias": ("Ernie4_5Config", {"head_dim": 24, "pad_token_id": None, "use_bias": True,
                                         "tie_word_embeddings": False}, "ernie4_5"),
    # GLM-4: QKV biases, a fused gate_up_proj, RoPE on half of each head in adjacent pairs (ERNIE 4.5's rotation)
    "glm": ("GlmConfig", {"head_dim": 24, "pad_token_id": None}, "glm"),
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
