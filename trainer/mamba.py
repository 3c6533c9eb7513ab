"""Mamba-2 layers of a hybrid model (megatron-core's MambaLayer and MambaMixer, the same tensors and TP split).

A mixer's in_proj is column-parallel over its parts (each rank [z_r; x_r; B_r; C_r; dt_r]: its heads and their
groups), the convolution, step bias, A and D are the rank's own channels and heads, the gated norm normalises each
group (whole on a rank), out_proj is row-parallel. The scan is the state-space model's quadratic ("attention") form,
exact in fp32:

    y_t = sum_{s <= t} exp(sum_{s < k <= t} dt_k A) dt_s (C_t . B_s) x_s + D x_t

over the whole sequence at once (memory O(seq^2) per head: these are the layers of small proofs and tests, not of
long-context training, for which megatron-core's own chunked kernels exist).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn

from ckpt_tools.model import layout
from ckpt_tools.model.spec import ModelSpec


class MambaMixer(nn.Module):
    def __init__(self, spec: ModelSpec, config: TransformerConfig, tp_size: int, tp_group, no_init):
        super().__init__()
        self.heads, self.head_dim = spec.mamba_num_heads // tp_size, spec.mamba_head_dim
        self.groups, self.state = spec.mamba_num_groups // tp_size, spec.mamba_state_dim
        self.inner = self.heads * self.head_dim
        rows = 2 * spec.mamba_num_heads * spec.mamba_head_dim + 2 * spec.mamba_num_groups * spec.mamba_state_dim \
            + spec.mamba_num_heads
        dtype = config.params_dtype
        self.in_proj = tensor_parallel.ColumnParallelLinear(
            spec.hidden_size, rows, config=config, tp_group=tp_group, init_method=no_init, bias=False,
            gather_output=False)
        channels = self.inner + 2 * self.groups * self.state
        self.conv1d = nn.Conv1d(channels, channels, layout.MAMBA_CONV, groups=channels, padding=layout.MAMBA_CONV - 1,
                                bias=True, dtype=dtype)
        self.dt_bias = nn.Parameter(torch.empty(self.heads, dtype=dtype))
        self.A_log = nn.Parameter(torch.empty(self.heads, dtype=dtype))
        self.D = nn.Parameter(torch.empty(self.heads, dtype=dtype))
        self.norm = GatedRMSNorm(self.inner, self.inner // self.groups, dtype)
        self.out_proj = tensor_parallel.RowParallelLinear(
            spec.mamba_num_heads * spec.mamba_head_dim, spec.hidden_size, config=config, tp_group=tp_group,
            init_method=no_init, bias=False, input_is_parallel=True, skip_bias_add=False)
        for p in (self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log, self.D, self.norm.weight):
            p.partial_over_tp = False  # each rank's own channels: its gradient is whole on it, never summed over TP

    def scan(self, x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """x [b, s, heads, head_dim], dt [b, s, heads] (after softplus), b / c [b, s, groups, state] -> y like x."""
        per_group = self.heads // self.groups
        b, c = (t.repeat_interleave(per_group, dim=2) for t in (b, c))  # each head its group's B and C
        a = (dt * -torch.exp(self.A_log.float())).transpose(1, 2)  # [b, h, s]
        seq = x.shape[1]
        # each sum over s < k <= t summed on its own (a difference of running sums loses the short ones' digits)
        below = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril(-1)
        sums = a.unsqueeze(-1).expand(*a.shape, seq).masked_fill(~below, 0).cumsum(-2)  # [b, h, t, s]
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
        decay = sums.masked_fill(~causal, float("-inf")).exp()  # [b, h, t, s]
        scores = torch.einsum("bthn,bshn->bhts", c, b) * decay * dt.transpose(1, 2).unsqueeze(-2)
        y = torch.einsum("bhts,bshp->bthp", scores, x)
        return y + x * self.D.float()[:, None]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [s, b, h] -> [s, b, h]."""
        proj, _ = self.in_proj(hidden)
        seq, batch = proj.shape[:2]
        gn = self.groups * self.state
        z, xbc, dt = proj.float().split([self.inner, self.inner + 2 * gn, self.heads], dim=-1)
        xbc = xbc.permute(1, 2, 0)  # [b, channels, s]: the causal depthwise convolution, its last positions cut
        xbc = F.silu(F.conv1d(xbc, self.conv1d.weight.float(), self.conv1d.bias.float(), padding=self.conv1d.padding,
                              groups=self.conv1d.groups)[..., :seq]).transpose(1, 2)  # [b, s, channels]
        x, b, c = xbc.split([self.inner, gn, gn], dim=-1)
        dt = F.softplus(dt.transpose(0, 1) + self.dt_bias.float())  # [b, s, heads]
        y = self.scan(x.reshape(batch, seq, self.heads, self.head_dim), dt,
                      b.reshape(batch, seq, self.groups, self.state), c.reshape(batch, seq, self.groups, self.state))
        y = self.norm(y.reshape(batch, seq, self.inner).transpose(0, 1), z)
        out, _ = self.out_proj(y.to(hidden.dtype))
        return out


class GatedRMSNorm(nn.Module):
    """megatron-core's gated norm after the scan (norm_before_gate False): RMS-normalise y * silu(z) over each group
    of `group` channels, eps 1e-5, then scale."""

    def __init__(self, size: int, group: int, dtype: torch.dtype):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        g = (y.float() * F.silu(z.float())).unflatten(-1, (-1, self.group))
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + 1e-5)
        return g.flatten(-2) * self.weight.float()


def full_init(key: str, spec: ModelSpec) -> torch.Tensor | None:
    """A Mamba tensor's full initial value where it is not Megatron's N(0, std): A = 1 ... heads (A_log their logs),
    D ones, the step bias the inverse softplus of steps log-spaced over [0.001, 0.1] (megatron-core draws them
    between the same bounds), the convolution uniform in +-1/sqrt(width) (PyTorch's default); None: the default."""
    name = key.rsplit("mixer.", 1)[-1]
    n = spec.mamba_num_heads
    if name == "A_log":
        return torch.log(torch.arange(1, n + 1, dtype=torch.float32))
    if name == "D":
        return torch.ones(n)
    if name == "dt_bias":
        dt = torch.exp(torch.linspace(torch.log(torch.tensor(1e-3)), torch.log(torch.tensor(0.1)), n))
        return dt + torch.log(-torch.expm1(-dt))
    if name == "conv1d.weight":
        g = torch.Generator().manual_seed(n)
        shape = layout.full_shape(key, spec, 0, None)
        return (torch.rand(shape, generator=g) * 2 - 1) / layout.MAMBA_CONV ** 0.5
    return None
