"""Under torchrun (world = PP, gloo, CPU): drive torch.distributed.pipelining's real Schedule1F1B over stand-in stages
that take a copy of the CUDA graphs (trainer/graphs.py `Turns`) where the trainer's stage does, at the input of its
first captured layer, and count the forwards that would have found their copy still busy. With `graphs.copies` copies
there must be none; with one fewer (where a stage has more than one), some. Rank 0 prints one JSON line holding every
rank's counts (ranks printing their own lines could interleave them on one line of torchrun's output).

    torchrun --nproc-per-node PP tests/pipeline_turns_check.py MICRO_BATCHES
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from trainer import graphs

WIDTH, BATCH = 8, 2


class Counting(graphs.Turns):
    """Turns that count a busy copy instead of refusing it (a refusal on one rank would leave the others waiting)."""

    def __init__(self, n: int):
        super().__init__(n)
        self.busy = 0

    def take(self, x: torch.Tensor) -> int:
        c = self.forwards % self.n
        if self.pending[c]:
            self.busy += 1
            self.pending[c] = False
        return super().take(x)


class Stand(nn.Module):
    def __init__(self, turns: Counting):
        super().__init__()
        self.first, self.second, self.turns = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), turns

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)  # the embedding, or the received hidden state: the captured layers' input
        if torch.is_grad_enabled():
            self.turns.take(h)
        return self.second(h)


def run(pp: int, rank: int, micro_batches: int, spare: int) -> int:
    n = graphs.copies(pp, rank, micro_batches) - spare
    turns = Counting(max(n, 1))
    meta = torch.empty(BATCH, WIDTH, device="meta", requires_grad=True)
    stage = PipelineStage(Stand(turns), rank, pp, torch.device("cpu"), input_args=meta, output_args=meta)
    schedule = Schedule1F1B(stage, n_microbatches=micro_batches, loss_fn=lambda out, y: ((out - y) ** 2).mean())
    torch.manual_seed(0)
    x, y = torch.randn(BATCH * micro_batches, WIDTH), torch.randn(BATCH * micro_batches, WIDTH)
    for _ in range(2):  # two steps: the copies' turns start again at each
        turns.start_step()
        if rank == 0:
            schedule.step(x)
        elif rank == pp - 1:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()
    return turns.busy


def main() -> None:
    micro_batches = int(sys.argv[1])
    dist.init_process_group("gloo")
    rank, pp = dist.get_rank(), dist.get_world_size()
    out = {"rank": rank, "copies": graphs.copies(pp, rank, micro_batches)}
    out["busy"] = run(pp, rank, micro_batches, 0)
    fewer = run(pp, rank, micro_batches, 1)  # every rank runs the second pipeline (a stage of one copy keeps one)
    out["busy_with_one_fewer"] = fewer if out["copies"] > 1 else None
    everyone = [None] * pp
    dist.all_gather_object(everyone, out)
    if rank == 0:
        print("TURNS " + json.dumps(everyone), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
