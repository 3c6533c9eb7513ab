"""Megatron-LM's legacy `--ckpt-format torch`: one `mp_rank_TT[_PPP]/model_optim_rng.pt` per TP x PP rank
(megatron_lm.py finds the dir and reads its args). The model state dict has the layout table's keys with
stage-local layer numbers, in megatron-core's local-spec names or Transformer Engine's (names.py), which are
read as the table's.
"""
from __future__ import annotations

from pathlib import Path

from ckpt_tools import megatron_lm
from ckpt_tools.shards import MODEL, ShardSet


class LegacyShards(ShardSet):
    def path(self, kind: str, tp_rank: int, pp_rank: int) -> Path:
        return megatron_lm.model_path(self.meta.dir, tp_rank, pp_rank, self.meta.pp_size)

    def _loaded(self, path: Path, kind: str, obj) -> dict:
        obj[MODEL] = megatron_lm.model_state(obj)
        return obj

    def _extra_files(self) -> list[str]:
        return []  # rank dirs beyond the layout are refused when the meta is read

    def has_optimizer(self) -> bool:
        return False

    def unread_optimizer(self) -> str | None:
        first = self.file(MODEL, 0, 0)
        if (self.meta.dir / self.path(MODEL, 0, 0).parent.name / "distrib_optim.pt").is_file():
            return "distributed-optimizer state (distrib_optim.pt)"
        if first.get("optimizer"):
            return "optimizer state (model_optim_rng.pt['optimizer'])"
        return None
