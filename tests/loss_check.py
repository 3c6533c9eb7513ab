"""Run under torchrun (world = TP, gloo): the trainer's VocabParallelLoss against megatron-core's own
vocab_parallel_cross_entropy and against torch's cross entropy of the full logits, loss and
gradient. Writes a JSON report to argv[1] (rank 0)."""
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
import trainer  # noqa: F401,I001 (megatron-core imported as the trainer imports it: no CPU torch.compile wrappers)
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel

from rank_reports import write_reports
from trainer.loss import VocabParallelLoss


def main(out: str) -> None:
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    tp, rank = dist.get_world_size(), dist.get_rank()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    s, b, vocab = 24, 3, 96
    gen = torch.Generator().manual_seed(5)
    full = (torch.randn(s, b, vocab, generator=gen) * 4).double()
    labels = torch.randint(0, vocab, (b, s), generator=gen)
    local = full.chunk(tp, dim=-1)[rank].clone().requires_grad_(True)
    ours = VocabParallelLoss()(local, labels)
    ours.backward()
    theirs_in = full.chunk(tp, dim=-1)[rank].clone().requires_grad_(True)
    theirs = tensor_parallel.vocab_parallel_cross_entropy(theirs_in, labels.t().contiguous()).mean()
    theirs.backward()
    ref_in = full.clone().requires_grad_(True)
    ref = F.cross_entropy(ref_in.reshape(-1, vocab), labels.t().reshape(-1))
    ref.backward()
    ref_grad = ref_in.grad.chunk(tp, dim=-1)[rank]
    report = {"rank": rank, "tp": tp, "ours": ours.item(), "megatron": theirs.item(), "torch": ref.item(),
              "grad_vs_megatron": (local.grad - theirs_in.grad).abs().max().item(),
              "grad_vs_torch": (local.grad - ref_grad).abs().max().item(),
              "grad_max": ref_grad.abs().max().item()}
    write_reports(report, out)


if __name__ == "__main__":
    main(sys.argv[1])
