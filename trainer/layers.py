"""The trainer's building blocks (megatron-core's terms): its TransformerConfig for the parallel layers, the norms
(plain, zero-centred, over all heads), the tensor-parallel group and linear layers, the embedding, and the rotary
tables (RoPE, llama3 and YaRN scaling). trainer.model builds the layers of them."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn

from ckpt_tools.model.spec import ModelSpec


def megatron_config(spec: ModelSpec, tp_size: int, pp_size: int, dtype: torch.dtype, on_cpu: bool,
                    sequence_parallel: bool = False, moe_aux_loss_coeff: float = 0.0) -> TransformerConfig:
    """The megatron-core config its parallel layers read (we initialize the weights ourselves). The linear layers'
    `gradient_accumulation_fusion` is turned on per layer by the optimizer (trainer/wgrad.py)."""
    return TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads, num_query_groups=spec.num_query_groups,
        ffn_hidden_size=spec.ffn_hidden_size, kv_channels=spec.kv_channels,
        tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=pp_size,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=on_cpu, perform_initialization=False,
        normalization=spec.normalization, gated_linear_unit=spec.gated_linear_unit,
        add_bias_linear=spec.add_bias_linear, add_qkv_bias=spec.add_qkv_bias, qk_layernorm=spec.qk_layernorm,
        layernorm_epsilon=spec.norm_epsilon, gradient_accumulation_fusion=False,
        sequence_parallel=sequence_parallel,
        moe_aux_loss_coeff=moe_aux_loss_coeff,
    )


def make_norm(spec: ModelSpec, config: TransformerConfig, size: int | None = None, partial: bool | None = None) -> nn.Module:
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


def tp_group():
    """The TP group, passed explicitly: megatron-core warns (and torch.compile breaks its graph) on
    every call of a layer built without one."""
    return ps.get_tensor_model_parallel_group() if ps.is_initialized() else None


class RowParallelLinear(tensor_parallel.RowParallelLinear):
    """megatron-core 0.16's RowParallelLinear.forward hands tp_group=None to its matmul, which then
    warns on every call on rank 0 (a graph break under torch.compile): hand it the layer's group."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        kwargs["tp_group"] = self.tp_group
        return super()._forward_impl(input, weight, *args, **kwargs)


def no_init(weight: torch.Tensor) -> None:
    """Weights are set from full tensors by `initialize` (TP/PP-invariant), not by the layers."""


class Embedding(nn.Module):
    """megatron-core LanguageModelEmbedding: word (vocab-parallel) + optional learned positions."""

    def __init__(self, spec: ModelSpec, config: TransformerConfig, padded_vocab: int):
        super().__init__()
        self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
            padded_vocab, spec.hidden_size, init_method=no_init, config=config, tp_group=tp_group())
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
    """cos/sin [s, 1, 1, 1, d/2], frequency j's at j, computed in fp32 as megatron-core does (its tables repeat these
    values for the second half of each head, or for each pair's second dim where the rotary is interleaved); d the
    head's rotary part (all of it, or multi-latent attention's qk_pos_emb_head_dim)."""
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
