"""megatron-core's own MoE layer as a layer's MLP (the trainer's `moe_layer: megatron_core`).

`MoELayer` from megatron-core's local layer spec: its TopKRouter (top-k of the logits and a softmax over those k, or
with moe_router_pre_softmax a softmax over every expert and its top-k), its alltoall token dispatcher (expert
parallelism over the data-parallel ranks), SequentialMLP experts and its load-balancing loss, which
MoEAuxLossAutoScaler feeds into backward with the scale the training loop sets (`set_aux_loss_scale`). Its state
dict is the same as trainer/moe.py's MoE (`mlp.router.weight`, `mlp.experts.local_experts.{j}.linear_fc{1,2}.weight`
under local expert indices), so checkpoints move between the two layers and through every tool unchanged.

Under TP megatron-core's MoE layer trains only with sequence parallelism (each TP rank routes its part of the
sequence; the router's gradients are summed over TP as the norms' are), so `moe_layer: megatron_core` with
tp_degree > 1 needs sequence_parallelism (trainer/config.py says so).

On CPU. megatron-core 0.16 reaches for CUDA in a few places of this path even with use_cpu_initialization. That
includes the collectives' output buffers, the router moving CPU weights to the GPU, the dispatcher's side stream
and the GPU-to-host copy of its split sizes. `_run_on_cpu` replaces those few places with their CPU equivalents,
once, in a process without CUDA; on GPUs they are left as they are. On both, the router's reference to Transformer
Engine's GEMM, unbound where Transformer Engine is absent, is bound to None (megatron-core's own fallback).
"""
from __future__ import annotations

import dataclasses
import functools
import operator

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn

from ckpt_tools.model.spec import ModelSpec


def set_aux_loss_scale(scale: float) -> None:
    """The gradient the load-balancing loss gets in backward (1 / micro-batches where the LM loss is divided by
    them), as megatron-core's schedules set it."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(float(scale)))


def build(spec: ModelSpec, config: TransformerConfig, ep_size: int) -> nn.Module:
    """megatron-core's MoELayer for `spec`'s experts (EP `ep_size`), its forward taking and giving one tensor."""
    _without_transformer_engine()
    if not torch.cuda.is_available():
        _run_on_cpu()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.moe_layer import MoELayer

    class Layer(MoELayer):
        def forward(self, x: torch.Tensor, selective: bool = False) -> torch.Tensor:  # noqa: ARG002
            out, bias = super().forward(x)
            return out if bias is None else out + bias

    moe_config = dataclasses.replace(
        config, num_moe_experts=spec.num_moe_experts, moe_router_topk=spec.moe_router_topk,
        moe_ffn_hidden_size=spec.moe_ffn_hidden_size, moe_router_pre_softmax=spec.moe_router_pre_softmax,
        moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
        moe_shared_expert_intermediate_size=spec.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=bool(spec.moe_shared_expert_gate),
        moe_router_score_function=spec.moe_router_score_function,
        moe_router_enable_expert_bias=bool(spec.moe_router_enable_expert_bias),
        moe_router_num_groups=spec.moe_router_num_groups, moe_router_group_topk=spec.moe_router_group_topk,
        moe_router_topk_scaling_factor=spec.moe_router_topk_scaling_factor,
        expert_model_parallel_size=ep_size, gated_linear_unit=spec.gated_linear_unit,
        activation_func=F.silu if spec.activation == "swiglu" else functools.partial(F.gelu, approximate="tanh"),
        bias_activation_fusion=False, moe_grouped_gemm=False)
    mlp = get_gpt_layer_local_spec(num_experts=spec.num_moe_experts, moe_grouped_gemm=False).submodules.mlp
    # a ModuleSpec up to megatron-core 0.18, functools.partial(MoELayer, submodules=...) since 0.19
    module, submodules = (mlp.func, mlp.keywords["submodules"]) if isinstance(mlp, functools.partial) else \
        (mlp.module, mlp.submodules)
    assert module is MoELayer, module
    layer = Layer(config=moe_config, submodules=submodules)
    for p in layer.experts.parameters():
        p.expert = True  # reduced over the expert-data-parallel ranks, not all data-parallel ones
    return layer


def _without_transformer_engine() -> None:
    """megatron-core 0.16's router names Transformer Engine's GEMM, bound only where Transformer Engine imports."""
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


@functools.cache
def _run_on_cpu() -> None:
    """megatron-core's MoE path with its CUDA-only places replaced by their CPU equivalents (see the docstring)."""
    from megatron.core import utils
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils, router, token_dispatcher

    class _Cuda:
        def __getattr__(self, name):
            return getattr(torch.cuda, name)

        @staticmethod
        def current_device() -> str:
            return "cpu"

    class _Torch:  # the collectives' outputs are allocated on torch.cuda.current_device()
        cuda = _Cuda()

        def __getattr__(self, name):
            return getattr(torch, name)

    mappings.torch = _Torch()

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        numel = functools.reduce(operator.mul, tensor_shape, 1)
        buffer = self.buffer.get((name, dtype))
        if buffer is None or buffer.numel() < numel:
            buffer = self.buffer[(name, dtype)] = torch.empty(numel, dtype=dtype)
        return buffer[:numel].view(*tensor_shape)

    utils.GlobalMemoryBuffer.get_tensor = get_tensor

    def gating(self, x: torch.Tensor) -> torch.Tensor:  # without moving the weights to a GPU
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, x.dtype)
        return moe_utils.router_gating_linear(x, self.weight, self.bias, dtype)

    router.Router.gating = gating
    alltoall = token_dispatcher.MoEAlltoAllTokenDispatcher
    alltoall.cuda_dtoh_stream = "cpu"  # not None: no CUDA stream is made

    def split_sizes_to_host(self, point, tokens_per_expert=None):
        # gloo's all_to_all takes the split sizes as lists, as the GPU path hands them over after its copy
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(self, name)
                if torch.is_tensor(value):
                    setattr(self, name, value.numpy())
        return tokens_per_expert

    alltoall._maybe_dtoh_and_synchronize = split_sizes_to_host
