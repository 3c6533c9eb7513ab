"""CUDA graphs over the transformer layers (Megatron-LM's `--external-cuda-graph` / `--cuda-graph-scope`).

A layer's forward and its backward are each captured once and then replayed every micro-batch: one launch where the
layer had dozens of kernels, so the GPU no longer waits for a host that is behind. All of a stage's captured layers are
captured in one `torch.cuda.make_graphed_callables` call and share one memory pool, which is safe because a step
replays them in the order captured: every layer's forward, then every backward in reverse. The weights' gradients
leave the backward graph as autograd gradients (or, with the GEMM-fused accumulation of trainer/wgrad.py, already
added into the optimizer's buffer inside it), so the optimizer's per-parameter hooks and the data-parallel buckets
work as without graphs; the distributed optimizer's wait for new weights runs before each layer, outside its graph.
The embedding, the final norm, the output layer, the loss and multi-token prediction stay eager.

Tensor parallelism is captured: the layers' all-reduces (sequence parallelism's gathers and reduce-scatters) are NCCL
kernels inside the graphs. The graphs are dropped before the process group is destroyed (`release`): a communicator
is not destroyed while a live graph holds its collectives, and TP runs hung there before. Where
`PYTORCH_CUDA_ALLOC_CONF` (or `PYTORCH_ALLOC_CONF`) asks for expandable segments, the trainer turns NCCL's
registration of captured buffers off (`NCCL_GRAPH_REGISTER=0`, trainer/train.py), as Megatron-LM requires for its
graphs on such memory.

Pipeline parallelism is captured too. The 1F1B schedule runs up to PP - rank forwards of a stage before their
backwards, and a captured layer keeps one micro-batch's activations in its graphs' buffers, which the next forward
would overwrite. So a stage captures as many copies of its layers' graphs as it keeps micro-batches in flight
(`copies`), each copy in one `make_graphed_callables` call of its own (its own memory pool: its replays interleave with
the other copies' in 1F1B's order, not in the order captured), and micro-batches take the copies in turn (`Turns`):
1F1B runs the backwards in the order of their forwards, so a micro-batch's copy is free again when the micro-batch
PP - rank forwards later comes. A copy taken again before its micro-batch's backward has run is refused (an error, not
wrong gradients). tests/test_graphs_plan.py checks the copies against torch's own Schedule1F1B on the CPU.

Where the layers are not captured, and why (`plan` says which, the trainer prints it):
- no CUDA, or `cuda_graphs: false`;
- activation recompute (selective or full): it frees activations to recompute them in backward, and a captured
  layer keeps its activations in its pool whatever the schedule; a run that needs recompute for memory has none to
  spare for graphs;
- MoE layers: how many tokens each expert gets depends on the routing (data-dependent shapes, a host sync);
- Mamba-2 and gated DeltaNet mixers: not captured (their scans' shapes are static, but no run has checked them
  under capture), they run eagerly between the captured layers.
"""
from __future__ import annotations

import gc

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ckpt_tools.errors import ConfigError
from trainer import wgrad
from trainer.layers import rope_tables


class _Layer(nn.Module):
    """One layer as a function of its input alone: the rotary tables are fixed for a run's sequence length."""

    def __init__(self, layer: nn.Module, rope: tuple[torch.Tensor, torch.Tensor] | None):
        super().__init__()
        self.layer, self.rope = layer, rope

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x, self.rope, False)


def copies(pp_size: int, pp_rank: int, micro_batches: int) -> int:
    """How many micro-batches a stage keeps in flight, each needing a copy of its graphs: 1F1B's warm-up forwards,
    PP - rank (torch.distributed.pipelining's Schedule1F1B), at most the step's micro-batches; 1 without PP."""
    return max(1, min(micro_batches, pp_size - pp_rank)) if pp_size > 1 else 1


class Turns:
    """Which copy of the graphs each forward replays: the copies in turn, a copy taken again only after the backward
    of the micro-batch that last took it has passed the graphed layers (a hook on that forward's input to them)."""

    def __init__(self, n: int):
        self.n, self.forwards, self.pending = n, 0, [False] * n
        # each copy's last hook, removed when the copy is next taken and when the graphs go (a pipeline schedule's
        # receive buffers are the same tensors every step: their hooks would pile up)
        self.hooks: list[RemovableHandle | None] = [None] * n

    def start_step(self) -> None:
        """A step's first forward takes copy 0 (the previous step's backwards have all run)."""
        self.forwards, self.pending = 0, [False] * self.n
        for c in range(self.n):
            self._unhook(c)

    def _unhook(self, c: int) -> None:
        if self.hooks[c] is not None:
            self.hooks[c].remove()
            self.hooks[c] = None

    def take(self, x: torch.Tensor) -> int:
        """The copy this micro-batch's forward replays (`x`: its input to the first captured layer)."""
        c = self.forwards % self.n
        if self.pending[c]:
            raise ConfigError(f"CUDA graphs: micro-batch {self.forwards} would replay copy {c} of the layers' graphs "
                               f"while the micro-batch {self.forwards - self.n} it holds has not run its backward "
                               f"({self.n} copies for the micro-batches in flight): set cuda_graphs: false for this "
                               f"schedule")
        self.forwards += 1
        self.pending[c] = True
        self._unhook(c)
        self.hooks[c] = x.register_hook(lambda grad, c=c: self._freed(c))
        return c

    def _freed(self, c: int) -> None:
        self.pending[c] = False


def plan(stage: nn.Module, enabled: bool, device: torch.device, recompute: str | None) -> tuple[list[int], str]:
    """(the local indices of the layers to capture, a line saying what is captured or why nothing is)."""
    if not enabled:
        return [], "CUDA graphs: off (cuda_graphs: false)"
    if device.type != "cuda":
        return [], "CUDA graphs: off (no CUDA)"
    if recompute is not None:
        return [], f"CUDA graphs: off with {recompute} recompute (graphs keep each layer's activations)"
    spec, first = stage.spec, sum(stage.layer_counts[: stage.pp_rank])
    chosen, skipped = [], []
    for i in range(len(stage.decoder.layers)):
        symbols = spec.layer_symbols(first + i)
        eager = spec.moe_layer(first + i) or any(s in ("M", "G", "E") for s in symbols)
        (skipped if eager else chosen).append(i)
    line = f"CUDA graphs: {len(chosen)} of {len(chosen) + len(skipped)} layers captured"
    if skipped:
        line += " (MoE, Mamba and gated DeltaNet layers run eagerly)"
    return chosen, line


def capture(stage: nn.Module, indices: list[int], shape: tuple[int, ...], dtype: torch.dtype, n: int = 1) -> None:
    """Capture `n` copies (`copies`) of the stage's layers `indices` for inputs of `shape` [s, b, h] and `dtype`; the
    stage's forward replays them while training (`stage.graphed`: local index -> its graphed copies). The graphs read
    and write the weights' and their gradient buffer's addresses: the trainer's Stepper captures before the first step
    and again after a new optimizer has moved them."""
    if not indices:
        return
    device = next(stage.parameters()).device
    rope = None
    if stage.spec.position_embedding_type == "rope":
        seq = shape[0] * (stage.tp_size if stage.sequence_parallel else 1)
        rope = rope_tables(stage.spec, seq, device)
    sets = []
    for _ in range(n):  # one call, and memory pool, per copy
        layers = tuple(_Layer(stage.decoder.layers[i], rope) for i in indices)
        samples = tuple((torch.randn(shape, dtype=dtype, device=device, requires_grad=True),) for _ in indices)
        sets.append(torch.cuda.make_graphed_callables(layers, samples))
    for i in indices:
        wgrad.mark_captured(stage.decoder.layers[i])
    if stage.graph_turns is not None:  # graphs captured again: the old copies' hooks go with them
        stage.graph_turns.start_step()
    stage.graphed = {i: tuple(s[k] for s in sets) for k, i in enumerate(indices)}
    stage.graphed_shape = (tuple(shape), dtype)
    stage.graph_turns = Turns(n)


def release(stage: nn.Module) -> None:
    """Drop the stage's graphs and wait for them to go, before the process group is destroyed: a communicator whose
    collectives a live graph holds is not destroyed until that graph is (the trainer's TP runs hung in
    destroy_process_group otherwise)."""
    if stage.graphed:
        stage.graph_turns.start_step()  # its hooks on the pipeline's receive buffers
        stage.graphed, stage.graphed_shape, stage.graph_turns = {}, None, None
        stage.mtp_logits = []  # the last forward's, whose autograd history holds the graphed layers' graphs
        gc.collect()
        torch.cuda.synchronize()
