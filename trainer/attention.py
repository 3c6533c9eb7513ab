"""Grouped-query self-attention (megatron-core's SelfAttention, local spec: the same tensors, TP split and order): the
rotary embedding on each head's first dims, q/k norms per head or over all heads, sliding windows and learned softmax
offsets computed eagerly in fp32, an output gate per head (attention_output_gate), else PyTorch's fused attention."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from ckpt_tools.model.spec import ModelSpec
from trainer.layers import AcrossHeadsRMSNorm, RowParallelLinear, make_norm, no_init, tp_group


ATTENTION_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                      SDPBackend.MATH]


def apply_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [s, b, groups, heads, d]: the same operations, in the same order, as
    `t * cos + cat(-t2, t1) * sin` with full-width tables, without building the rotated copy."""
    t1, t2 = t.unflatten(-1, (2, -1)).unbind(-2)
    c, s = cos.to(t.dtype), sin.to(t.dtype)
    return torch.cat([t1 * c - t2 * s, t2 * c + t1 * s], dim=-1)


def apply_rope_interleaved(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on adjacent pairs (megatron-core's rotary_interleaved, ERNIE 4.5): dims 2j and 2j + 1 turned by frequency
    j, the same operations as megatron-core's `t * cos + rotate_half(t, interleaved) * sin` with its doubled tables."""
    t1, t2 = t.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos.to(t.dtype), sin.to(t.dtype)
    return torch.stack([t1 * c - t2 * s, t2 * c + t1 * s], dim=-1).flatten(-2)


class CoreAttention(nn.Module):
    """GPT-OSS's learned softmax offset (megatron-core's DotProductAttention with softmax_type learnable): a sink
    logit per head, this rank's heads', in each softmax's denominator."""

    def __init__(self, spec: ModelSpec, config: TransformerConfig, tp_size: int):
        super().__init__()
        self.softmax_offset = nn.Parameter(torch.zeros(spec.num_attention_heads // tp_size, dtype=config.params_dtype))


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
                    sink: torch.Tensor | None) -> torch.Tensor:
    """Causal softmax attention on [b, heads, s, d] (keys and values [b, groups, s, d]) in fp32, as megatron-core's
    local DotProductAttention computes it: the keys more than `window - 1` positions back masked too, and with a
    `sink` [heads] one more logit per head in the denominator (its SoftmaxOne; transformers' GPT-OSS alike)."""
    hpg, s = q.shape[1] // k.shape[1], q.shape[2]
    k, v = k.repeat_interleave(hpg, dim=1), v.repeat_interleave(hpg, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    i = torch.arange(s, device=q.device)
    back = i[:, None] - i[None, :]
    hidden = (back < 0) if window is None else (back < 0) | (back >= window)
    scores = scores.masked_fill(hidden, float("-inf"))
    if sink is not None:
        scores = torch.cat([scores, sink.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
    probs = torch.softmax(scores - scores.amax(dim=-1, keepdim=True), dim=-1)
    if sink is not None:
        probs = probs[..., :-1]
    return torch.matmul(probs, v.float()).to(q.dtype)


class SelfAttention(nn.Module):
    def __init__(self, spec: ModelSpec, config: TransformerConfig, tp_size: int, index: int = 0):
        """`index`: the layer's global number (whether it attends by the sliding window)."""
        super().__init__()
        self.spec = spec
        self.groups = spec.num_query_groups // tp_size
        self.window = spec.sliding_window if spec.windowed(index) else None
        gate = spec.num_attention_heads if spec.attention_output_gate else 0  # gate heads after each group's q heads
        qkv_rows = (spec.num_attention_heads + gate + 2 * spec.num_query_groups) * spec.kv_channels
        # megatron-core builds the core attention (its softmax offset) first
        self.core_attention = CoreAttention(spec, config, tp_size) if spec.softmax_type == "learnable" else None
        # Registration order = megatron-core's state-dict order: linear_proj before linear_qkv.
        self.linear_proj = RowParallelLinear(
            spec.num_attention_heads * spec.kv_channels, spec.hidden_size, config=config, tp_group=tp_group(), init_method=no_init,
            bias=spec.add_bias_linear, input_is_parallel=True, skip_bias_add=False)
        self.linear_qkv = tensor_parallel.ColumnParallelLinear(
            spec.hidden_size, qkv_rows, config=config, tp_group=tp_group(), init_method=no_init, bias=spec.qkv_bias,
            gather_output=False)
        if spec.qk_norm_across_heads:  # OLMoE: this rank's slice of norms over every head
            self.q_layernorm = AcrossHeadsRMSNorm(spec, config, spec.num_attention_heads * spec.kv_channels, tp_size)
            self.k_layernorm = AcrossHeadsRMSNorm(spec, config, spec.num_query_groups * spec.kv_channels, tp_size)
        elif spec.qk_layernorm:  # megatron-core's order: after linear_qkv
            self.q_layernorm = make_norm(spec, config, spec.kv_channels)
            self.k_layernorm = make_norm(spec, config, spec.kv_channels)

    def rotate(self, t: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """RoPE on each head's first dims (all of them, or rotary_percent's share: megatron-core's and transformers'
        partial rotary), the rest as they are; in pairs of adjacent dims where the model's rotary is interleaved."""
        d = 2 * rope[0].shape[-1]
        turn = apply_rope_interleaved if self.spec.rotary_interleaved else apply_rope
        if d == t.shape[-1]:
            return turn(t, *rope)
        return torch.cat([turn(t[..., :d], *rope), t[..., d:]], dim=-1)

    def core(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """[s, b, this rank's (q, k, v) per group] -> attention output [s, b, this rank's heads x d]."""
        s, b = qkv.shape[:2]
        hpg, d = self.spec.heads_per_group, self.spec.kv_channels
        if self.spec.attention_output_gate:  # megatron-core's per group [q heads; gate heads; k; v]
            q, gate, k, v = qkv.view(s, b, self.groups, 2 * hpg + 2, d).split([hpg, hpg, 1, 1], dim=3)
            return self.attend(q, k, v, rope) * torch.sigmoid(gate.float()).to(qkv.dtype).reshape(s, b, -1)
        q, k, v = qkv.view(s, b, self.groups, hpg + 2, d).split([hpg, 1, 1], dim=3)
        return self.attend(q, k, v, rope)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """q [s, b, groups, heads per group, d], k and v [s, b, groups, 1, d] -> [s, b, this rank's heads x d]."""
        s, b, _, hpg, d = q.shape
        if self.spec.qk_norm_across_heads:  # over all of this rank's heads at once, before the rotation
            q = self.q_layernorm(q.reshape(s, b, -1)).view(s, b, self.groups, hpg, d)
            k = self.k_layernorm(k.reshape(s, b, -1)).view(s, b, self.groups, 1, d)
        elif self.spec.qk_layernorm:  # per head, before the rotation (megatron-core and transformers alike)
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rope is not None:
            q, k = self.rotate(q, rope), self.rotate(k, rope)
        q, k, v = (t.reshape(s, b, -1, d) for t in (q, k, v))
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        if self.window is not None or self.core_attention is not None:
            sink = self.core_attention.softmax_offset if self.core_attention is not None else None
            return eager_attention(q, k, v, self.window, sink).permute(2, 0, 1, 3).reshape(s, b, -1)
        with sdpa_kernel(ATTENTION_BACKENDS, set_priority=True):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hpg > 1)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                selective: bool = False) -> torch.Tensor:
        qkv, _ = self.linear_qkv(x)
        out = checkpoint(self.core, qkv, rope, use_reentrant=False) if selective else self.core(qkv, rope)
        out, _ = self.linear_proj(out)
        return out
