"""The GPT model of one pipeline stage, built from megatron-core's tensor-parallel layers.

The module tree mirrors megatron-core's `GPTModel` with `get_gpt_layer_local_spec`, so that its
`state_dict()` holds the same keys, shapes and element order (DESIGN.md Contract 1). Activations
are [seq, batch, hidden] as in megatron-core. Megatron's GPTModel forward needs CUDA; these
layers run on CPU with gloo as well as on GPUs with NCCL.
"""
from __future__ import annotations

import math
import zlib
from functools import partial

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from ckpt_tools import layout, shard_ops
from ckpt_tools.errors import ConfigError
from ckpt_tools.spec import ModelSpec
from trainer import mcore_moe
from trainer.moe import MoE


def megatron_config(spec: ModelSpec, tp_size: int, pp_size: int, dtype: torch.dtype, on_cpu: bool,
                    sequence_parallel: bool = False, moe_aux_loss_coeff: float = 0.0) -> TransformerConfig:
    """The megatron-core config its parallel layers read (we initialize the weights ourselves)."""
    return TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads, num_query_groups=spec.num_query_groups,
        ffn_hidden_size=spec.ffn_hidden_size, kv_channels=spec.kv_channels,
        tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=on_cpu, perform_initialization=False,
        normalization=spec.normalization, gated_linear_unit=spec.gated_linear_unit,
        add_bias_linear=spec.add_bias_linear, add_qkv_bias=spec.add_qkv_bias, qk_layernorm=spec.qk_layernorm,
        layernorm_epsilon=spec.norm_epsilon, gradient_accumulation_fusion=False, sequence_parallel=sequence_parallel,
        moe_aux_loss_coeff=moe_aux_loss_coeff,
    )


def _norm(spec: ModelSpec, config: TransformerConfig, size: int | None = None, partial: bool | None = None) -> nn.Module:
    """A norm in the weights' dtype (over `size`, default hidden); under sequence parallelism it sees 1/TP of
    the sequence, so its parameters are marked as megatron-core marks them, for the TP all-reduce of their
    gradients. A per-head q/k norm sees its own heads whole: its gradients are per rank, not reduced. `partial`
    False: a norm every TP rank applies to the same whole input before a column-parallel layer (whose input
    gradient is summed over TP), so each rank's gradient is already the whole one."""
    if spec.zero_centered_norm:
        norm = ZeroCenteredRMSNorm(size or spec.hidden_size, spec.norm_epsilon).to(config.params_dtype)
    else:
        cls = nn.RMSNorm if spec.normalization == "RMSNorm" else nn.LayerNorm
        norm = cls(size or spec.hidden_size, eps=spec.norm_epsilon).to(config.params_dtype)
    for p in norm.parameters():
        p.sequence_parallel = config.sequence_parallel and size is None
        p.partial_over_tp = size is not None if partial is None else partial  # megatron-core sums q/k norm
        # gradients over TP as well
    return norm


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm whose weight w scales by 1 + w (megatron-core's layernorm_zero_centered_gamma; Gemma), in fp32
    and cast back, as transformers' GemmaRMSNorm computes it."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class AcrossHeadsRMSNorm(nn.Module):
    """An RMSNorm over `width` features that TP splits (OLMoE's q/k norms over all heads): this rank holds its
    1/TP slice of the features and of the weight; the sum of squares is summed over TP (autograd through the
    all-reduce), then each rank scales its slice, as transformers' OlmoeRMSNorm does the whole: in fp32, cast
    back, times the weight. The weight's gradient is this rank's own (its slice), not summed."""

    def __init__(self, spec: ModelSpec, config: TransformerConfig, width: int, tp_size: int):
        super().__init__()
        self.width, self.eps, self.tp_size = width, spec.norm_epsilon, tp_size
        self.weight = nn.Parameter(torch.ones(width // tp_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        squares = x32.pow(2).sum(-1, keepdim=True)
        if self.tp_size > 1:
            from torch.distributed.nn.functional import all_reduce
            squares = all_reduce(squares, group=ps.get_tensor_model_parallel_group())
        return self.weight * (x32 * torch.rsqrt(squares / self.width + self.eps)).to(x.dtype)


def _tp_group():
    """The TP group, passed explicitly: megatron-core warns (and torch.compile breaks its graph) on
    every call of a layer built without one."""
    return ps.get_tensor_model_parallel_group() if ps.is_initialized() else None


class RowParallelLinear(tensor_parallel.RowParallelLinear):
    """megatron-core 0.16's RowParallelLinear.forward hands tp_group=None to its matmul, which then
    warns on every call on rank 0 (a graph break under torch.compile): hand it the layer's group."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        kwargs["tp_group"] = self.tp_group
        return super()._forward_impl(input, weight, *args, **kwargs)


def _no_init(weight: torch.Tensor) -> None:
    """Weights are set from full tensors by `initialize` (TP/PP-invariant), not by the layers."""


class Embedding(nn.Module):
    """megatron-core LanguageModelEmbedding: word (vocab-parallel) + optional learned positions."""

    def __init__(self, spec: ModelSpec, config: TransformerConfig, padded_vocab: int):
        super().__init__()
        self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
            padded_vocab, spec.hidden_size, init_method=_no_init, config=config, tp_group=_tp_group())
        self.sequence_parallel = config.sequence_parallel
        self.scale = spec.hidden_size ** 0.5 if spec.scale_embeddings else None  # Gemma: in the weights' dtype
        self.position_embeddings = None
        if spec.position_embedding_type == "learned_absolute":
            self.position_embeddings = nn.Embedding(spec.max_position_embeddings, spec.hidden_size,
                                                    dtype=config.params_dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(tokens)  # [b, s, h]
        if self.scale is not None:
            x = x * torch.tensor(self.scale, dtype=x.dtype, device=x.device)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(torch.arange(tokens.shape[1], device=tokens.device))[None]
        x = x.transpose(0, 1).contiguous()
        if self.sequence_parallel:  # this rank keeps its 1/TP of the sequence
            x = tensor_parallel.scatter_to_sequence_parallel_region(x)
        return x


def rope_tables(spec: ModelSpec, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [s, 1, 1, 1, d/2] for rotate-half RoPE, computed in fp32 as megatron-core does (its
    tables repeat these values for the second half of each head); d the head's rotary part (all of it, or
    multi-latent attention's qk_pos_emb_head_dim)."""
    d = spec.qk_pos_emb_head_dim if spec.multi_latent_attention else int(spec.kv_channels * spec.rotary_percent)
    inv_freq = 1.0 / (spec.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    if spec.rope_scaling == "llama3":
        inv_freq = llama3_scaling(inv_freq, spec)
    if spec.rope_scaling == "yarn":
        inv_freq = yarn_scaling(inv_freq, d, spec)
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)[:, None, None, None, :]
    if spec.rope_scaling == "yarn":  # the concentration factor on cos and sin
        factor = yarn_mscale(spec.rope_scaling_factor, spec.rope_mscale) / yarn_mscale(spec.rope_scaling_factor,
                                                                                          spec.rope_mscale_all_dim)
        return freqs.cos() * factor, freqs.sin() * factor
    return freqs.cos(), freqs.sin()


def yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_scaling(inv_freq: torch.Tensor, d: int, spec: ModelSpec) -> torch.Tensor:
    """YaRN's frequencies (megatron-core's YarnRotaryEmbedding, transformers' yarn rope type): the interpolated
    (divided by the factor) and the original ones blended by a linear ramp over the dims between the beta_fast and
    beta_slow rotations of the original context (the range rounded outwards unless rope_truncate is false)."""
    def dim_of(rotations: float) -> float:
        return d * math.log(spec.rope_original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(spec.rotary_base))
    low, high = dim_of(spec.rope_beta_fast), dim_of(spec.rope_beta_slow)
    if spec.rope_truncate:  # rounded outwards to whole dims (GPT-OSS keeps the range as it is)
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float32, device=inv_freq.device) - low)
            / ((high + 0.001 if low == high else high) - low)).clamp(0, 1)
    keep = 1.0 - ramp  # the share of the original frequency
    pos = spec.rotary_base ** (torch.arange(0, d, 2, dtype=torch.float32, device=inv_freq.device) / d)
    return 1.0 / (spec.rope_scaling_factor * pos) * (1 - keep) + 1.0 / pos * keep


def llama3_scaling(inv_freq: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """Llama 3.1's frequency scaling (megatron-core's RotaryEmbedding._apply_scaling, transformers'
    llama3 rope type): long wavelengths divided by the factor, short ones kept, a smooth blend between."""
    factor, low, high = spec.rope_scaling_factor, spec.rope_low_freq_factor, spec.rope_high_freq_factor
    old = spec.rope_original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) * ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


# cuDNN's fused attention is ~1.6x flash-attention 2 for forward + backward on Hopper at head dim 64
# (0.44 vs 0.69 ms for a 2 x 32 heads x 2048 causal GQA block on an H200), but torch tries it last.
# Ask for it first; where it does not apply (CPU, fp32, odd shapes) torch falls through the list.
ATTENTION_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                      SDPBackend.MATH]


def apply_rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [s, b, groups, heads, d]: the same operations, in the same order, as
    `t * cos + cat(-t2, t1) * sin` with full-width tables, without building the rotated copy."""
    t1, t2 = t.unflatten(-1, (2, -1)).unbind(-2)
    c, s = cos.to(t.dtype), sin.to(t.dtype)
    return torch.cat([t1 * c - t2 * s, t2 * c + t1 * s], dim=-1)


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
            spec.num_attention_heads * spec.kv_channels, spec.hidden_size, config=config, tp_group=_tp_group(), init_method=_no_init,
            bias=spec.add_bias_linear, input_is_parallel=True, skip_bias_add=False)
        self.linear_qkv = tensor_parallel.ColumnParallelLinear(
            spec.hidden_size, qkv_rows, config=config, tp_group=_tp_group(), init_method=_no_init, bias=spec.qkv_bias,
            gather_output=False)
        if spec.qk_norm_across_heads:  # OLMoE: this rank's slice of norms over every head
            self.q_layernorm = AcrossHeadsRMSNorm(spec, config, spec.num_attention_heads * spec.kv_channels, tp_size)
            self.k_layernorm = AcrossHeadsRMSNorm(spec, config, spec.num_query_groups * spec.kv_channels, tp_size)
        elif spec.qk_layernorm:  # megatron-core's order: after linear_qkv
            self.q_layernorm = _norm(spec, config, spec.kv_channels)
            self.k_layernorm = _norm(spec, config, spec.kv_channels)

    def rotate(self, t: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """RoPE on each head's first dims (all of them, or rotary_percent's share: megatron-core's and transformers'
        partial rotary), the rest as they are."""
        d = 2 * rope[0].shape[-1]
        if d == t.shape[-1]:
            return apply_rope(t, *rope)
        return torch.cat([apply_rope(t[..., :d], *rope), t[..., d:]], dim=-1)

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


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """megatron-core's quick_gelu: x * sigmoid(1.702 x)."""
    return x * torch.sigmoid(1.702 * x)


class MLP(nn.Module):
    """The dense MLP, or one expert of an MoE layer (`width` its ffn size)."""

    def __init__(self, spec: ModelSpec, config: TransformerConfig, width: int | None = None):
        super().__init__()
        width = width or spec.ffn_hidden_size
        self.gated = spec.gated_linear_unit
        self.gate_act = {"swiglu": F.silu, "quick_geglu": quick_gelu}.get(spec.activation,
                                                                          partial(F.gelu, approximate="tanh"))
        self.clamp, self.offset = spec.activation_clamp, spec.glu_linear_offset
        self.approximate = "tanh" if spec.activation == "gelu_tanh" else "none"
        self.squared = spec.activation == "squared_relu"
        fc1_rows = width * (2 if self.gated else 1)
        self.linear_fc1 = tensor_parallel.ColumnParallelLinear(
            spec.hidden_size, fc1_rows, config=config, tp_group=_tp_group(), init_method=_no_init, bias=spec.add_bias_linear,
            gather_output=False)
        self.linear_fc2 = RowParallelLinear(
            width, spec.hidden_size, config=config, tp_group=_tp_group(), init_method=_no_init,
            bias=spec.add_bias_linear, input_is_parallel=True, skip_bias_add=False)

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = x.chunk(2, dim=-1)  # this rank's [gate_r; up_r]
            if self.clamp is not None:  # GPT-OSS: the gate clamped above, the up half on both sides
                gate, up = gate.clamp(max=self.clamp), up.clamp(-self.clamp, self.clamp)
            return self.gate_act(gate) * (up + self.offset) if self.offset else self.gate_act(gate) * up
        if self.squared:
            return F.relu(x).square()
        return F.gelu(x, approximate=self.approximate)

    def forward(self, x: torch.Tensor, selective: bool = False) -> torch.Tensor:
        x, _ = self.linear_fc1(x)
        x = checkpoint(self.activation, x, use_reentrant=False) if selective else self.activation(x)
        x, _ = self.linear_fc2(x)
        return x


class TransformerLayer(nn.Module):
    """Selective recompute (Megatron-LM's --recompute-activations) recomputes the attention core and
    the MLP activation in backward: the big, cheap activations; full recompute wraps the layer."""

    def __init__(self, spec: ModelSpec, config: TransformerConfig, tp_size: int, ep: tuple[int, int] | None = None,
                 moe_layer: str = "ours", index: int = 0):
        """`index`: the layer's global number (the layer pattern says whether its MLP is an MoE layer)."""
        super().__init__()
        self.input_layernorm = _norm(spec, config)
        if spec.multi_latent_attention:
            from trainer.mla import MLASelfAttention  # it builds on this module's layers
            self.self_attention = MLASelfAttention(spec, config, tp_size)
        elif spec.layer_symbols(index)[0] == "G":
            from trainer.gdn import GatedDeltaNet  # it builds on this module's layers
            self.self_attention = GatedDeltaNet(spec, config, tp_size)
        else:
            self.self_attention = SelfAttention(spec, config, tp_size, index)
        self.pre_mlp_layernorm = _norm(spec, config)
        if not spec.moe_layer(index):
            self.mlp = MLP(spec, config)
        elif moe_layer == "megatron_core":  # megatron-core's MoELayer itself (trainer/mcore_moe.py)
            self.mlp = mcore_moe.build(spec, config, ep[1] if ep is not None else 1)
        else:
            self.mlp = MoE(spec, config, MLP, ep)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                selective: bool = False) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x), rope, selective)
        return x + self.mlp(self.pre_mlp_layernorm(x), selective)


class HybridLayer(nn.Module):
    """A hybrid model's layer: one block by its pattern symbol (megatron-core HybridModel's MambaLayer, or a
    TransformerLayer of attention or of an MLP only), behind its own norm, added to the residual."""

    def __init__(self, spec: ModelSpec, config: TransformerConfig, tp_size: int, index: int):
        super().__init__()
        self.symbol = spec.layer_symbols(index)
        if self.symbol == "M":
            from trainer.mamba import MambaMixer
            self.norm = _norm(spec, config)
            self.mixer = MambaMixer(spec, config, tp_size, _tp_group(), _no_init)
        elif self.symbol == "*":
            self.input_layernorm = _norm(spec, config)
            self.self_attention = SelfAttention(spec, config, tp_size, index)
        else:
            self.pre_mlp_layernorm = _norm(spec, config)
            self.mlp = MLP(spec, config)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                selective: bool = False) -> torch.Tensor:
        if self.symbol == "M":
            return x + self.mixer(self.norm(x))
        if self.symbol == "*":
            return x + self.self_attention(self.input_layernorm(x), rope, selective)
        return x + self.mlp(self.pre_mlp_layernorm(x), selective)


class Decoder(nn.Module):
    def __init__(self, spec: ModelSpec, config: TransformerConfig, tp_size: int, num_layers: int, post_process: bool,
                 ep: tuple[int, int] | None = None, moe_layer: str = "ours", first: int = 0):
        super().__init__()
        self.layers = nn.ModuleList(
            HybridLayer(spec, config, tp_size, first + i) if spec.hybrid else
            TransformerLayer(spec, config, tp_size, ep, moe_layer, first + i) for i in range(num_layers))
        self.final_layernorm = _norm(spec, config) if post_process else None


def ready(module: nn.Module) -> None:
    """The weights of `module` are in place (always, unless an optimizer says otherwise)."""


class GPTStage(nn.Module):
    """One pipeline stage: embedding on the first, layers, final norm + output layer on the last.

    forward: tokens [b, s] (first stage) or hidden [s, b, h] -> hidden [s, b, h] or, on the last
    stage, vocab-parallel logits [s, b, padded_vocab / TP].
    """

    def __init__(self, spec: ModelSpec, config: TransformerConfig, *, tp_size: int, pp_rank: int,
                 layer_counts: list[int], padded_vocab: int, recompute: str | None = None,
                 ep: tuple[int, int] | None = None, moe_layer: str = "ours"):
        """`ep`: (EP rank, EP size) when an MoE model's experts are split over expert-parallel ranks. `moe_layer`:
        an MoE model's MLPs, trainer/moe.py's ("ours") or megatron-core's MoELayer ("megatron_core")."""
        super().__init__()
        self.ep = ep
        self.spec, self.padded_vocab, self.recompute = spec, padded_vocab, recompute
        self.sequence_parallel = config.sequence_parallel
        self.tp_size, self.pp_rank, self.layer_counts = tp_size, pp_rank, list(layer_counts)
        self.pre_process = pp_rank == 0
        self.post_process = pp_rank == len(layer_counts) - 1
        if self.pre_process:
            self.embedding = Embedding(spec, config, padded_vocab)
        self.decoder = Decoder(spec, config, tp_size, layer_counts[pp_rank], self.post_process, ep, moe_layer,
                               sum(layer_counts[:pp_rank]))
        self.share_weight = self.pre_process and spec.tie_word_embeddings
        # called with each module before its forward: the distributed optimizer waits there for the new weights'
        # all-gathers it left running (trainer/optim.py)
        self.params_ready = ready
        self.mtp_logits: list[torch.Tensor] = []  # the last forward's multi-token prediction logits, depth by depth
        if self.post_process and spec.mtp_num_layers:  # megatron-core's MTP block, between decoder and output layer
            if not self.pre_process:
                raise ConfigError("multi-token prediction layers need the embedding on the last pipeline stage, which "
                                  "this trainer keeps only at PP 1: train or run it at pp_degree 1")
            from trainer.mtp import MTPBlock  # it builds on this module's layers
            self.mtp = MTPBlock(spec, config, tp_size, ep, moe_layer)
        if self.post_process:
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                spec.hidden_size, padded_vocab, config=config, tp_group=_tp_group(), init_method=_no_init, bias=False,
                gather_output=False, skip_weight_param_allocation=self.share_weight)

    def units(self) -> list[nn.Module]:
        """The modules the forward runs, in its order; `params_ready` is called with each before it runs."""
        units = [self.embedding] if self.pre_process else []
        units += list(self.decoder.layers)
        return units + ([self.decoder.final_layernorm] + ([self.mtp] if self.spec.mtp_num_layers else []) +
                        [self.output_layer] if self.post_process else [])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x
        if self.pre_process:
            self.params_ready(self.embedding)
            x = self.embedding(x)
        rope = None
        if self.spec.position_embedding_type == "rope":  # over the whole sequence, also under SP
            seq = x.shape[0] * (self.tp_size if self.sequence_parallel else 1)
            rope = rope_tables(self.spec, seq, x.device)
        mode = self.recompute if self.training else None
        for layer in self.decoder.layers:
            self.params_ready(layer)
            if mode == "full":
                x = checkpoint(layer, x, rope, use_reentrant=False)
            else:
                x = layer(x, rope, mode == "selective")
        if not self.post_process:
            return x
        self.params_ready(self.decoder.final_layernorm)
        self.params_ready(self.output_layer)
        x = self.decoder.final_layernorm(x)
        weight = self.embedding.word_embeddings.weight if self.share_weight else None
        if self.spec.mtp_num_layers:
            self.params_ready(self.mtp)
            self.mtp_logits = [self.output_layer(h, weight=weight)[0]
                               for h in self.mtp(x, tokens, self.embedding, rope, mode == "selective")]
        logits, _ = self.output_layer(x, weight=weight)
        return logits

    def global_keys(self) -> dict[str, str]:
        """Stage-local state-dict key -> global key (layer numbers re-based over all stages)."""
        ep_rank, ep_size = self.ep or (None, 1)
        return dict(layout.stage_keys(self.spec, self.layer_counts, self.pp_rank, ep_rank, ep_size))


def _init_std(key: str, spec: ModelSpec, std: float) -> float | None:
    """Megatron's init: N(0, std) weights, output projections scaled by 1/sqrt(2L), norms 1, biases 0."""
    if key.endswith((".bias", ".expert_bias")):
        return None
    if "layernorm" in key or key.endswith("norm.weight"):
        return None if spec.zero_centered_norm else -1.0  # a scale of one: ones, or zeros when zero-centred
    if key.endswith(("linear_proj.weight", "linear_fc2.weight", "out_proj.weight")):
        return std / (2.0 * spec.num_layers) ** 0.5
    return std


def full_init(key: str, spec: ModelSpec, padded_vocab: int, seed: int, std: float = 0.02) -> torch.Tensor:
    """The full (TP=1) fp32 initial tensor of a global key, the same whatever the TP/PP layout."""
    shape = layout.full_shape(key, spec, padded_vocab, pp_size=None)
    if ".mixer." in key or spec.linear_num_key_heads is not None:  # Mamba's and gated DeltaNet's own inits
        from trainer.gdn import full_init as gdn_init
        from trainer.mamba import full_init as mamba_init
        own = mamba_init(key, spec) if ".mixer." in key else gdn_init(key, spec)
        if own is not None:
            return own
    kind = _init_std(key, spec, std)
    if kind is None:
        return torch.zeros(shape)
    if kind < 0:
        return torch.ones(shape)
    name = "embedding.word_embeddings.weight" if key == "output_layer.weight" and spec.tie_word_embeddings else key
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    full = torch.empty(shape).normal_(0.0, kind, generator=gen)
    if layout.has_padded_rows(key, spec, None):
        full[spec.vocab_size:] = 0.0  # padding rows start at zero
    return full


@torch.no_grad()
def initialize(stage: GPTStage, seed: int, tp_rank: int) -> None:
    """Fill every parameter (and persistent buffer) from its full init tensor split by the layout table."""
    keys = stage.global_keys()
    pp_size = len(stage.layer_counts)
    for local, param in (*stage.named_parameters(), *((k, b) for k, b in stage.named_buffers() if k in keys)):
        g = keys[local]
        full = full_init(g, stage.spec, stage.padded_vocab, seed)
        shard = shard_ops.split(g, full, stage.spec, stage.tp_size, pp_size)[tp_rank]
        param.copy_(shard)
