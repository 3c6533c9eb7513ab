"""Megatron-FSDP's `--ckpt-format fsdp_dtensor`, written (weights only) by `ckpt reshard/import --format fsdp_dtensor`:
torch.distributed.checkpoint's files as the torch_dist writer (formats/megatron_write.py) streams them, under the
model's own keys. What Megatron-LM's load_checkpoint reads with --use-megatron-fsdp --ckpt-format fsdp_dtensor
--no-load-optim --no-load-rng (PP 1; the reader is formats/torch_dist.py)."""
from __future__ import annotations

from ckpt_tools import layout, megatron_lm
from ckpt_tools.errors import LayoutError
from ckpt_tools.formats.megatron_write import CHECKPOINT_VERSION, DistWriter
from ckpt_tools.formats.torch_dist import FSDP_HALVES, Placed, dcp_candidates
from ckpt_tools.ranks import Rank
from ckpt_tools.rules import GATED


class FsdpWriter(DistWriter):
    """Each tensor global (one chunk per TP shard's piece) under `model.module.<name>`, per layer: the local spec's
    names, and Transformer Engine's (fused norms; grouped experts `mlp.experts.linear_fc1.weight<e>`) as second
    index entries over the same bytes, so that either spec's run finds its keys; a SwiGLU fc1 as its halves
    `<name>_w` (gate) and `<name>_v` (up), as Megatron-FSDP's handle_swiglu_in_state_dict names them; the common state
    as bytes entries (args, iteration, checkpoint_version), no common.pt or metadata.json; no `_extra_state`
    (Megatron-FSDP drops it on save and load)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._aliases: dict[str, str] = {}  # every stored name -> the other spec's (the same in every process)
        for p in range(self.pp):
            for _, key in layout.stage_keys(self.spec, self.counts, p):
                names = dcp_candidates(key, self.spec, megatron_lm.FSDP_MODEL)
                if len(names) > 1:
                    self._aliases[names[0][0]] = names[1][0]

    def stored(self, key: str) -> tuple[str, Placed]:
        return dcp_candidates(key, self.spec, megatron_lm.FSDP_MODEL)[0]

    def alias(self, fqn: str) -> str | None:
        for half in FSDP_HALVES:  # a SwiGLU half: its whole tensor's other name, the half's suffix after it
            if fqn.endswith(half) and fqn[:-len(half)] in self._aliases:
                return self._aliases[fqn[:-len(half)]] + half
        return self._aliases.get(fqn)

    def placed(self, key, fqn, layer, full, p):
        if layout.find_rule(key, self.spec, self.pp).split != GATED or self.spec.activation != "swiglu":
            return super().placed(key, fqn, layer, full, p)
        half = full[0] // 2
        second = p.start >= half
        if p.stop > half and not second:
            raise LayoutError(f"{key}: rows {p.start}-{p.stop} cross its SwiGLU halves: not a piece Megatron-FSDP saves")
        offsets = (p.start - half * second,) + (0,) * (len(full) - 1)
        return (fqn + FSDP_HALVES[second], offsets, (p.stop - p.start,) + tuple(full[1:]),
                (half,) + tuple(full[1:]))

    def put_extra(self, pp_rank: int, key: str) -> None:
        return  # Megatron-FSDP saves and loads no _extra_state

    def end_stage(self, pp_rank: int, iteration: int) -> None:
        if pp_rank == 0:  # the common state, in the first rank's file (as Megatron-LM's rank 0 saves it)
            for name, obj in (("args", self.args), ("checkpoint_version", CHECKPOINT_VERSION),
                              ("iteration", iteration)):
                self.put_object(Rank(0, 0), name, obj)
        super().end_stage(pp_rank, iteration)

    def write_common(self, iteration: int, common: dict | None) -> None:
        return  # the common state is bytes entries of the index
