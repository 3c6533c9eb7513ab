"""Cross entropy over vocab-parallel logits without materialising fp32 logits or softmax.

Megatron's `vocab_parallel_cross_entropy` keeps an fp32 softmax of the whole [tokens x vocab/TP]
logits for backward (0.5 GB at 4096 tokens x 32k vocab) and makes several full passes over it.
Here the loss is written as log(sum exp(l - m)) - (l_label - m), with m the (detached) row max
over all TP ranks: the per-rank sums and the label logit are plain reductions that torch.compile
fuses into one pass forward and one backward, recomputing exp from the bf16 logits. The TP sums go
through megatron-core's reduce_from_tensor_model_parallel_region, whose backward is the identity,
which is exactly d(loss)/d(local logits) = softmax_local - onehot_local.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel


def _local_terms(logits: torch.Tensor, labels: torch.Tensor, row_max: torch.Tensor | None,
                 vocab_start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over this rank's vocab of exp(l - m), l_label - m if the label is on this rank else 0);
    without TP the row max m is taken here, in the same fused pass."""
    if row_max is None:
        row_max = logits.detach().amax(dim=-1).float()
    shifted = logits.float() - row_max.unsqueeze(-1)
    sum_exp = shifted.exp().sum(-1)
    local = labels - vocab_start
    inside = (local >= 0) & (local < logits.shape[-1])
    picked = shifted.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    return sum_exp, torch.where(inside, picked, 0.0)


class VocabParallelLoss:
    """Mean token loss from vocab-parallel logits [s, b, V/TP] and labels [b, s]."""

    def __init__(self, compile: bool = False):
        self.terms = torch.compile(_local_terms, dynamic=False) if compile else _local_terms

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        labels = labels.t().contiguous()
        row_max = None
        if ps.get_tensor_model_parallel_world_size() > 1:
            row_max = logits.detach().amax(dim=-1).float()
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
        vocab_start = ps.get_tensor_model_parallel_rank() * logits.shape[-1]
        sum_exp, picked = self.terms(logits, labels, row_max, vocab_start)
        # contiguous: megatron-core all-reduces `x.contiguous()` and returns x, a no-op on a strided x
        sum_exp = tensor_parallel.reduce_from_tensor_model_parallel_region(sum_exp.contiguous())
        picked = tensor_parallel.reduce_from_tensor_model_parallel_region(picked.contiguous())
        return (sum_exp.log() - picked).mean()
