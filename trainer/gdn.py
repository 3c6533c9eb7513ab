"""Gated DeltaNet layers (megatron-core's GatedDeltaNet: Qwen3-Next's linear attention), the same tensors and TP split.

in_proj is column-parallel over its parts (each rank [q_r; k_r; v_r; z_r; b_r; a_r]: its key heads and the value heads
they serve), the convolution over [q_r; k_r; v_r] and the step bias and A per value head are the rank's own, the gated
norm over each value head is whole on every rank, out_proj is row-parallel. The recurrence, in fp32, per value head
(its key head's q and k, L2-normalised, q scaled by 1/sqrt(head dim)):

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - S'_t k_t))^T      (S'_t = exp(g_t) S_{t-1})      o_t = S_t^T q_t
    g_t = -exp(A_log) softplus(a_t + dt_bias)      beta_t = sigmoid(b_t)

token by token (the layers of proofs and small runs: megatron-core's chunked kernels are for long sequences); the output
RMS-normalised per head, scaled, times silu(z), then out_proj.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn

from ckpt_tools.model.spec import ModelSpec
from trainer.layers import RowParallelLinear, make_norm, no_init, tp_group


class GatedDeltaNet(nn.Module):
    def __init__(self, spec: ModelSpec, config: TransformerConfig, tp_size: int):
        super().__init__()
        self.key_heads, self.value_heads = spec.linear_num_key_heads // tp_size, spec.linear_num_value_heads // tp_size
        self.dk, self.dv = spec.linear_key_head_dim, spec.linear_value_head_dim
        qk, v = spec.linear_num_key_heads * self.dk, spec.linear_num_value_heads * self.dv
        self.in_proj = tensor_parallel.ColumnParallelLinear(
            spec.hidden_size, 2 * qk + 2 * v + 2 * spec.linear_num_value_heads, config=config, tp_group=tp_group(),
            init_method=no_init, bias=False, gather_output=False)
        channels = (2 * qk + v) // tp_size
        self.conv1d = nn.Conv1d(channels, channels, spec.linear_conv_kernel_dim, groups=channels,
                                padding=spec.linear_conv_kernel_dim - 1, bias=False, dtype=config.params_dtype)
        self.dt_bias = nn.Parameter(torch.empty(self.value_heads, dtype=config.params_dtype))
        self.A_log = nn.Parameter(torch.empty(self.value_heads, dtype=config.params_dtype))
        self.out_norm = make_norm(spec, config, self.dv)  # each rank's heads: its gradient summed over TP
        self.out_proj = RowParallelLinear(v, spec.hidden_size, config=config, tp_group=tp_group(), init_method=no_init,
                                          bias=False, input_is_parallel=True, skip_bias_add=False)

    def forward(self, x: torch.Tensor, rope=None, selective: bool = False) -> torch.Tensor:
        """x [s, b, h] -> [s, b, h] (no positions: the recurrence orders the tokens)."""
        proj, _ = self.in_proj(x)
        s, b = proj.shape[:2]
        qk, v, nv = self.key_heads * self.dk, self.value_heads * self.dv, self.value_heads
        q, k, val, z, beta, a = proj.float().split([qk, qk, v, v, nv, nv], dim=-1)
        mixed = torch.cat([q, k, val], dim=-1).permute(1, 2, 0)  # [b, channels, s]: the causal depthwise convolution
        mixed = F.silu(F.conv1d(mixed, self.conv1d.weight.float(), padding=self.conv1d.padding,
                                groups=self.conv1d.groups)[..., :s]).permute(2, 0, 1)
        q, k, val = mixed.split([qk, qk, v], dim=-1)
        per = self.value_heads // self.key_heads
        q, k = (_l2norm(t.unflatten(-1, (self.key_heads, self.dk))) for t in (q, k))
        q, k = (t.repeat_interleave(per, dim=2) for t in (q, k))
        q = q * self.dk ** -0.5
        val = val.unflatten(-1, (nv, self.dv))
        g = -torch.exp(self.A_log.float()) * F.softplus(a + self.dt_bias.float())  # [s, b, nv]
        beta = torch.sigmoid(beta)
        state = proj.new_zeros((b, nv, self.dk, self.dv), dtype=torch.float32)
        out = []
        for t in range(s):
            state = state * torch.exp(g[t])[..., None, None]
            delta = (val[t] - (state * k[t][..., None]).sum(-2)) * beta[t][..., None]
            state = state + k[t][..., None] * delta[..., None, :]
            out.append((state * q[t][..., None]).sum(-2))
        o = torch.stack(out)  # [s, b, nv, dv]
        o = self.out_norm(o.to(x.dtype)).float() * F.silu(z.unflatten(-1, (nv, self.dv)))
        out, _ = self.out_proj(o.flatten(-2).to(x.dtype))
        return out


def _l2norm(t: torch.Tensor) -> torch.Tensor:
    """Each head's vector over sqrt(its squared sum + 1e-6) (flash-linear-attention's, megatron-core's and
    transformers' l2norm)."""
    return t * torch.rsqrt(t.square().sum(-1, keepdim=True) + 1e-6)


def full_init(key: str, spec: ModelSpec) -> torch.Tensor | None:
    """A gated DeltaNet tensor's full initial value where it is not Megatron's N(0, std): A = 1 ... value heads (A_log
    their logs), the step bias ones, the convolution uniform in +-1/sqrt(width); None: the default."""
    n = spec.linear_num_value_heads
    if key.endswith("self_attention.A_log"):
        return torch.log(torch.arange(1, n + 1, dtype=torch.float32))
    if key.endswith("self_attention.dt_bias"):
        return torch.ones(n)
    if key.endswith("self_attention.conv1d.weight"):
        from ckpt_tools.model import layout
        g = torch.Generator().manual_seed(n)
        return (torch.rand(layout.full_shape(key, spec, 0, None), generator=g) * 2 - 1) / spec.linear_conv_kernel_dim ** 0.5
    return None
