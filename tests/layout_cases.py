"""Specs, cases and bitwise helpers shared by the layout-table tests (test_layout, test_layout_table).
All sizes divide 8, so every TP in TPS is valid for every spec."""
from __future__ import annotations

import pytest
import torch

from ckpt_tools.model import layout
from ckpt_tools.model.spec import ModelSpec

TPS = (1, 2, 4, 8)
DTYPES = (torch.float32, torch.bfloat16)
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
             torch.float64: torch.int64}


# ---------------------------------------------------------------- specs whose sizes all divide 8
def llama(tie: bool = False, **kw) -> ModelSpec:
    """GQA with 2 heads per group; 8 query groups so TP 8 divides; ffn 32 so gated TP 8 divides."""
    d = dict(architecture="llama", num_layers=4, hidden_size=64, num_attention_heads=16,
             num_query_groups=8, ffn_hidden_size=32, vocab_size=1000, max_position_embeddings=32,
             tie_word_embeddings=tie)
    d.update(kw)
    return ModelSpec(**d)


def gpt2(**kw) -> ModelSpec:
    d = dict(architecture="gpt2", num_layers=4, hidden_size=64, num_attention_heads=8,
             ffn_hidden_size=32, vocab_size=1000, max_position_embeddings=32, tie_word_embeddings=True)
    d.update(kw)
    return ModelSpec(**d)


def deepseek(**kw) -> ModelSpec:
    """Multi-latent attention (16 heads, latents 32 and 16 + 8 rotary), a dense first layer, MoE layers after it
    (8 experts of 16, a shared expert of 32, an expert bias)."""
    d = dict(architecture="deepseek_v3", num_query_groups=16, norm_epsilon=1e-6, q_lora_rank=32, kv_lora_rank=16,
             qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=8, num_moe_experts=8, moe_router_topk=4,
             moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=32, moe_router_num_groups=4,
             moe_router_group_topk=2, layer_pattern="+-+E+E+E")
    d.update(kw)
    return llama(**d)


def gpt_oss(**kw) -> ModelSpec:
    """Sinks (one per head), biased attention, biased router and experts (4 of width 32), windows."""
    return llama(**{**dict(architecture="gpt_oss", num_moe_experts=4, moe_router_topk=2, sliding_window=8,
                           window_attn_skip_freq=2, activation_clamp=7.0, rope_scaling="yarn"), **kw})


def nemotron_h(**kw) -> ModelSpec:
    """Mamba-2 (16 heads of 4 in 8 groups, a state of 8), attention and squared-ReLU MLP layers, one block each."""
    return llama(**{**dict(architecture="nemotron_h", num_layers=6, layer_pattern="M*-M*-", mamba_num_heads=16,
                           mamba_head_dim=4, mamba_state_dim=8, mamba_num_groups=8), **kw})


def qwen3_next(**kw) -> ModelSpec:
    """Gated DeltaNet layers (8 key heads of 4, 16 value heads of 4) and gated attention, MoE with a shared expert."""
    return llama(**{**dict(architecture="qwen3_next", layer_pattern="GE*EGE*E", kv_channels=8, rotary_percent=0.5,
                           linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=4,
                           linear_value_head_dim=4, linear_conv_kernel_dim=4, num_moe_experts=4,
                           moe_shared_expert_intermediate_size=32), **kw})


SPECS = {
    "llama_untied": llama(tie=False),
    "llama_tied": llama(tie=True),
    "gpt2": gpt2(),
    "qwen2": llama(architecture="qwen2", tie=True),  # QKV biases
    "qwen3": llama(architecture="qwen3", kv_channels=8),  # per-head q/k norms, head_dim x heads != hidden
    "mixtral": llama(architecture="mixtral", num_moe_experts=4, moe_router_topk=2),  # router and experts
    "deepseek_v3": deepseek(),  # MLA, dense then MoE layers, a shared expert, an expert bias
    "gpt_oss": gpt_oss(),  # sinks split over TP by heads, biased router and experts
    "nemotron_h": nemotron_h(),  # Mamba-2's in_proj and conv1d blocked by parts, its per-head values by heads
    "qwen3_next": qwen3_next(),  # gated DeltaNet's in_proj and conv1d by parts, gated attention's QKV by groups
}


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert torch.is_tensor(a) and torch.is_tensor(b), what
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert tuple(a.shape) == tuple(b.shape), f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    iv = _INT_VIEW[a.dtype]
    assert torch.equal(a.contiguous().view(iv), b.contiguous().view(iv)), f"{what}: bits differ"


def random_full(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values plus a few special bit patterns (-0.0, +-inf) that a value compare would blur."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    flat = t.view(-1)
    flat[0] = -0.0
    if flat.numel() > 2:
        flat[1] = float("inf")
        flat[-1] = float("-inf")
    return t


def layer0(rule: layout.Rule) -> str:
    return rule.name.format(i=0, e=1)


def all_cases():
    for name, spec in SPECS.items():
        for pp in (1, 2):
            for tp in TPS:
                yield pytest.param(spec, pp, tp, id=f"{name}-pp{pp}-tp{tp}")


# a 4 x 4 gpt2 whose splits are written out by hand
SMALL_GPT2 = ModelSpec(architecture="gpt2", num_layers=1, hidden_size=4, num_attention_heads=2,
                       ffn_hidden_size=4, vocab_size=4, max_position_embeddings=2, tie_word_embeddings=True)
