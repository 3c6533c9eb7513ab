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

The optimizer turns it on (`enable`, from `make_optimizer`), once every parameter has its `main_grad`: a stage
without an optimizer (a forward, a reference backward) keeps plain autograd gradients. Megatron-core then flags each
weight whose GEMM accumulated (`grad_added_to_main_grad`, set in its backward) and the optimizer's hook drops that
weight's placeholder and only counts the arrival; a weight that got a real gradient instead (the MoE experts' grouped
GEMM reads the experts' weights without their linear layers) is added as before. The tied embedding's weight gets
both kinds (the output layer's fused, the lookup's through autograd): megatron-core's `zero_out_wgrad` makes the
output layer's placeholder zeros, so autograd's sum is the lookup's alone and the hook adds it (megatron-core's
LanguageModule and DDP hook do the same). A layer captured as a CUDA graph (trainer/graphs.py) replays its backward
without running megatron-core's Python, which sets no flag: its weights are marked `wgrad_in_graph` once captured.
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


def fused(p: torch.nn.Parameter) -> bool:
    """Whether the gradient autograd has just handed `p` is a placeholder (its GEMM added the real one into
    `main_grad`); the flag megatron-core set is cleared for the next backward."""
    flagged = getattr(p, "grad_added_to_main_grad", False)
    if flagged:
        p.grad_added_to_main_grad = False
    return getattr(p, "wgrad_in_graph", False) or (flagged and not getattr(p, "zero_out_wgrad", False))


def linears(module: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in module.modules()
            if isinstance(m, (tensor_parallel.ColumnParallelLinear, tensor_parallel.RowParallelLinear))]


def enable(stage: torch.nn.Module, compiled: bool = False) -> int:
    """Turn the fusion on for the stage's megatron-core linear layers (after the optimizer has given each parameter
    its `main_grad`); returns how many weights it covers. The tied embedding (the output layer's weight on the first
    stage) gets zeros as its placeholder. `compiled`: the layers are torch.compile'd, and these linear layers' matmul
    runs outside the compiled graphs (torch.compile traces megatron-core's autograd function, whose backward writes
    into `main_grad`, a tensor outside its graph, and trains on wrong gradients: measured on a GPU, 1.1B model, the
    loss rose where the eager run's fell). Under CUDA graphs the breaks cost no launches."""
    install()
    covered = 0
    for module in linears(stage):
        module.gradient_accumulation_fusion = True
        if compiled and not getattr(module, "matmul_uncompiled", False):
            module._forward_impl = torch._dynamo.disable(module._forward_impl)
            module.matmul_uncompiled = True
        if module.weight is not None:  # None: a tied output layer, which is handed the embedding's weight
            module.weight.grad_added_to_main_grad = False  # megatron-core then hands autograd a placeholder
            covered += 1
    embedding = getattr(stage, "embedding", None)
    if embedding is not None and getattr(stage, "share_weight", False):
        weight = embedding.word_embeddings.weight
        weight.zero_out_wgrad = True
        weight.grad_added_to_main_grad = False
    return covered


def mark_captured(layer: torch.nn.Module) -> None:
    """A layer now captured as CUDA graphs: its fused weights' gradients are placeholders on every replay, and their
    `main_grad` holds what the capture's warm-up passes added (zeroed here)."""
    for module in linears(layer):
        if module.gradient_accumulation_fusion and module.weight is not None:
            module.weight.wgrad_in_graph = True
            module.weight.grad_added_to_main_grad = False
    for p in layer.parameters():
        if hasattr(p, "main_grad"):
            p.main_grad.zero_()
