"""Run under torchrun (2 processes, gloo): the trainer's q/k norm over all heads (OLMoE) split over TP2 against
transformers' OlmoeRMSNorm over the whole width. Each rank holds its half of the features and of the weight; the
loss is the sum over ranks of each rank's output times a fixed random cotangent. Writes to argv[1] (rank 0) the
relative L2 errors of the output, the input gradient and the weight gradient, each rank's half against the
reference's."""
import sys
import types

import torch
import torch.distributed as dist
import trainer  # noqa: F401,I001 (megatron-core imported as the trainer imports it: no CPU torch.compile wrappers)
from megatron.core import parallel_state as ps
from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm

from rank_reports import write_reports
from trainer.layers import AcrossHeadsRMSNorm

WIDTH, EPS = 96, 1e-5


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def main(out: str) -> None:
    dist.init_process_group("gloo")
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    x, cotangent = torch.randn(5, 3, WIDTH, generator=gen), torch.randn(5, 3, WIDTH, generator=gen)
    weight = 1 + 0.3 * torch.randn(WIDTH, generator=gen)

    ref = OlmoeRMSNorm(WIDTH, eps=EPS)
    with torch.no_grad():
        ref.weight.copy_(weight)
    x_full = x.clone().requires_grad_()
    y_full = ref(x_full)
    (y_full * cotangent).sum().backward()

    half = slice(rank * WIDTH // 2, (rank + 1) * WIDTH // 2)
    spec, config = types.SimpleNamespace(norm_epsilon=EPS), types.SimpleNamespace(params_dtype=torch.float32)
    ours = AcrossHeadsRMSNorm(spec, config, WIDTH, tp_size=2)
    with torch.no_grad():
        ours.weight.copy_(weight[half])
    x_part = x[..., half].clone().requires_grad_()
    y_part = ours(x_part)
    (y_part * cotangent[..., half]).sum().backward()

    errors = {"output": rel(y_part.detach(), y_full.detach()[..., half]),
              "input_grad": rel(x_part.grad, x_full.grad[..., half]),
              "weight_grad": rel(ours.weight.grad, ref.weight.grad[half])}
    write_reports(errors, out)


if __name__ == "__main__":
    main(sys.argv[1])
