"""Weight gradients added into the optimizer's gradient buffer by the GEMM that computes them (megatron-core's
`gradient_accumulation_fusion`, Megatron-LM's default on GPUs).

Without it, the backward of each linear layer writes its weight gradient in the weights' dtype, and the optimizer's
hook then adds it into the flat fp32 buffer (trainer/optim.py): per parameter and micro-batch, one more pass over the
gradient and a read-modify-write of the fp32 buffer. With it, megatron-core's linear layers call
`wgrad_gemm_accum_fp32(input, grad_output, main_grad)`, the GEMM accumulating into `main_grad` in its epilogue
(beta = 1), and hand autograd a placeholder gradient so that the parameter's hooks still run. megatron-core takes
that kernel from APEX's `fused_weight_gradient_mlp_cuda` extension; torch has the same GEMM (bf16 x bf16 ->
fp32, in place: aten `addmm.dtype_out`), and `install()` gives megatron-core's layers a module of that name made of
it when APEX is not installed.

A parameter whose weight gradient goes that way is marked `fused_wgrad`: the optimizer's hook then drops the
placeholder and only counts the arrival. The tied embedding's weight gets both kinds of gradient (the output layer's
fused, the lookup's through autograd): megatron-core's `zero_out_wgrad` makes its placeholder zeros, so autograd's
sum is the lookup's alone and the hook adds it as usual (megatron-core's LanguageModule does the same).
"""
from __future__ import annotations

import types

import torch
from megatron.core import tensor_parallel


def _accumulate(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad [out, in] += grad_output^T [out, tokens] @ total_input [tokens, in], accumulated in main_grad's
    dtype inside the GEMM."""
    x = total_input.reshape(-1, total_input.shape[-1])
    g = grad_output.reshape(-1, grad_output.shape[-1])
    if main_grad.dtype == x.dtype:
        main_grad.addmm_(g.t(), x)
    else:
        torch.addmm(main_grad, g.t(), x, out_dtype=main_grad.dtype, out=main_grad)


TORCH_WGRAD = types.SimpleNamespace(wgrad_gemm_accum_fp32=_accumulate, wgrad_gemm_accum_fp16=_accumulate)


def install() -> None:
    """Give megatron-core's linear layers the accumulating GEMM where APEX's extension is missing (before they are
    built with `gradient_accumulation_fusion=True`, which they refuse without one)."""
    from megatron.core.tensor_parallel import layers
    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = TORCH_WGRAD
        layers._grad_accum_fusion_available = True


def available(device: torch.device) -> bool:
    """The fused path is a CUDA GEMM (torch has the mixed-dtype accumulate on CUDA only)."""
    return device.type == "cuda"


def mark(stage: torch.nn.Module, compiled: bool = False) -> int:
    """Mark the weights of the stage's megatron-core linear layers built with the fusion: their weight gradients
    reach `main_grad` inside the GEMM. Returns how many. The tied embedding (the output layer's weight on the first
    stage) gets zeros as its placeholder. `compiled`: the layers are torch.compile'd, and these linear layers' matmul
    runs outside the compiled graphs (torch.compile traces megatron-core's autograd function, whose backward writes
    into `main_grad`, a tensor outside its graph, and trains on wrong gradients: measured on a GPU, 1.1B model, the
    loss rose where the eager run's fell). Under CUDA graphs the breaks cost no launches."""
    marked = 0
    for module in stage.modules():
        if not isinstance(module, (tensor_parallel.ColumnParallelLinear, tensor_parallel.RowParallelLinear)):
            continue
        if not module.gradient_accumulation_fusion or module.weight is None:
            continue
        module.weight.fused_wgrad = True
        if compiled:
            module._forward_impl = torch._dynamo.disable(module._forward_impl)
        module.weight.grad_added_to_main_grad = False  # megatron-core then hands autograd a placeholder
        marked += 1
    embedding = getattr(stage, "embedding", None)
    if embedding is not None and getattr(stage, "share_weight", False):
        weight = embedding.word_embeddings.weight
        weight.zero_out_wgrad = True  # the output layer's placeholder is zeros: autograd sums in the lookup's only
        weight.grad_added_to_main_grad = False
    return marked
