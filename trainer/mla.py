"""Multi-latent attention (DeepSeek-V2/V3) for the trainer's layers: megatron-core's MLASelfAttention as its local
spec holds and computes it (trainer/model.py builds a layer's attention from here where the model has MLA)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn
from torch.nn.attention import sdpa_kernel
from torch.utils.checkpoint import checkpoint

from ckpt_tools.model.spec import ModelSpec
from trainer.attention import ATTENTION_BACKENDS, apply_rope
from trainer.layers import RowParallelLinear, make_norm, no_init, tp_group, yarn_mscale


class GatherLastDim(torch.autograd.Function):
    """megatron-core's gather_output of a column-parallel layer (every TP rank the whole output; backward each rank's
    own columns of the gradient, which the next column-parallel layer has already summed over TP), on any device."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        n, r = torch.distributed.get_world_size(ctx.group), torch.distributed.get_rank(ctx.group)
        return grad.chunk(n, dim=-1)[r].contiguous(), None


class MLASelfAttention(nn.Module):
    """Multi-latent attention as megatron-core's MLASelfAttention with its local spec holds and computes it: the
    down projections are column-parallel layers whose output is gathered (every TP rank the whole latent), their norms
    replicated; the up projections column-parallel over heads; the rotary part of each head's query and the keys'
    shared rotary part rotated in megatron-core's MLA layout (even lanes, then odd, then rotate-half: transformers'
    rope_interleave); softmax scale 1 / sqrt(qk_head_dim + qk_pos_emb_head_dim), times YaRN's mscale squared."""

    def __init__(self, spec: ModelSpec, config: TransformerConfig, tp_size: int):
        super().__init__()
        self.spec, self.heads = spec, spec.num_attention_heads // tp_size
        n, h, q_head = spec.num_attention_heads, spec.hidden_size, spec.qk_head_dim + spec.qk_pos_emb_head_dim
        # 1 / sqrt(head dim), times YaRN's mscale(factor, mscale_all_dim)^2 (1 without YaRN)
        mscale = yarn_mscale(spec.rope_scaling_factor, spec.rope_mscale_all_dim) if spec.rope_scaling == "yarn" else 1.0
        self.scale = mscale * mscale / math.sqrt(q_head)

        def column(rows_in: int, rows_out: int) -> nn.Module:
            return tensor_parallel.ColumnParallelLinear(rows_in, rows_out, config=config, tp_group=tp_group(),
                                                        init_method=no_init, bias=False, gather_output=False)
        self.tp_size = tp_size
        # Registration order = megatron-core's state-dict order.
        self.linear_proj = RowParallelLinear(n * spec.v_head_dim, h, config=config, tp_group=tp_group(),
                                             init_method=no_init, bias=False, input_is_parallel=True,
                                             skip_bias_add=False)
        if spec.q_lora_rank is None:
            self.linear_q_proj = column(h, n * q_head)
        else:
            self.linear_q_down_proj = column(h, spec.q_lora_rank)
            self.linear_q_up_proj = column(spec.q_lora_rank, n * q_head)
        self.linear_kv_down_proj = column(h, spec.kv_lora_rank + spec.qk_pos_emb_head_dim)
        self.linear_kv_up_proj = column(spec.kv_lora_rank, n * (spec.qk_head_dim + spec.v_head_dim))
        if spec.q_lora_rank is not None:
            self.q_layernorm = make_norm(spec, config, spec.q_lora_rank, partial=False)
        self.kv_layernorm = make_norm(spec, config, spec.kv_lora_rank, partial=False)

    def _gathered(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        y, _ = layer(x)
        return y if self.tp_size == 1 else GatherLastDim.apply(y, layer.tp_group)

    def core(self, q: torch.Tensor, kv: torch.Tensor, k_pe: torch.Tensor,
             rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        s, b = q.shape[:2]
        sp = self.spec
        q_nope, q_pe = q.view(s, b, self.heads, -1).split([sp.qk_head_dim, sp.qk_pos_emb_head_dim], dim=-1)
        k_nope, v = kv.view(s, b, self.heads, -1).split([sp.qk_head_dim, sp.v_head_dim], dim=-1)

        def rotate(t: torch.Tensor) -> torch.Tensor:  # [s, b, heads, d]: even lanes, odd lanes, then rotate-half
            return apply_rope(torch.cat([t[..., 0::2], t[..., 1::2]], dim=-1)[:, :, None], *rope)[:, :, 0]
        q = torch.cat([q_nope, rotate(q_pe)], dim=-1)
        k = torch.cat([k_nope, rotate(k_pe.view(s, b, 1, -1)).expand(s, b, self.heads, -1)], dim=-1)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, d]
        with sdpa_kernel(ATTENTION_BACKENDS, set_priority=True):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                selective: bool = False) -> torch.Tensor:
        sp = self.spec
        if sp.q_lora_rank is None:
            q, _ = self.linear_q_proj(x)
        else:
            q, _ = self.linear_q_up_proj(self.q_layernorm(self._gathered(self.linear_q_down_proj, x)))
        latent, k_pe = self._gathered(self.linear_kv_down_proj, x).split([sp.kv_lora_rank, sp.qk_pos_emb_head_dim],
                                                                         dim=-1)
        kv, _ = self.linear_kv_up_proj(self.kv_layernorm(latent))
        out = checkpoint(self.core, q, kv, k_pe, rope, use_reentrant=False) if selective else \
            self.core(q, kv, k_pe, rope)
        out, _ = self.linear_proj(out)
        return out
