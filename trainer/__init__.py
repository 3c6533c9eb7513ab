"""The bundled GPT trainer on megatron-core: TP x PP x DP under torchrun."""
import warnings

# megatron-core announces at import that Transformer Engine / Apex are absent; the CPU path needs neither.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")


def _import_megatron_core() -> None:
    """Import megatron-core once, here, before any module of the trainer does. On a machine without CUDA its import
    wraps its fused kernels (bias + GeLU/SwiGLU, rope, ...) in torch.compile, which loads TorchDynamo and Inductor
    (3 s of a 6 s start, per process); none of those kernels runs in a CPU step (every fusion is off there), so
    they are left plain functions. With CUDA nothing changes. torch.compile itself stays as it is (the trainer's own
    `compile: true` uses it)."""
    import torch
    if torch.cuda.is_available():
        import megatron.core  # noqa: F401
        return
    compile_ = torch.compile
    torch.compile = lambda model=None, **kw: model if model is not None else (lambda f: f)
    try:
        import megatron.core  # noqa: F401
        from megatron.core import parallel_state, tensor_parallel  # noqa: F401
        from megatron.core.transformer import transformer_config  # noqa: F401
    finally:
        torch.compile = compile_


_import_megatron_core()
