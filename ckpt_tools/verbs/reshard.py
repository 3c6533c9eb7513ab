"""`ckpt reshard`: any TP/PP layout -> any other, optimizer state included (`ckpt import` is importer.py): the
Python API, which paths.reshard runs as the command line does.

Into our format it writes a save dir OUT holding `checkpoint-<iteration>/` and `latest`, so the trainer resumes from
it with `load: OUT` (or `save_dir: OUT`); into Megatron-LM's forms, a Megatron-LM save dir. One writer per form
(verbs/ours_copy.py, verbs/dist_copy.py), one file at a time: each target shard is the pieces of the source shards that
`shard_ops.reshard_pieces` names, copied from the source's files (or made by its torch reader where its bytes are not
the table's), the same bytes as the layout table's split of the join, so a round trip is bit-exact.
"""
from __future__ import annotations

from pathlib import Path

from ckpt_tools.team import SOLO, Team
from ckpt_tools.verbs.request import Request


def reshard(src: str | Path, out: str | Path, tp: int, pp: int, layers: list[int] | None = None,
            vocab_size: int | None = None, force: bool = False, quiet: bool = False, check_hashes: bool = False,
            no_preflight: bool = False, copy_bytes: bool = True, team: Team = SOLO, **asked) -> str:
    """`asked`: the rest of the target, request.Request's fields (form, optimizer, ep, vpp, model). `copy_bytes`
    False: the source read through its torch reader alone (paths.reshard)."""
    from ckpt_tools.verbs import paths
    return paths.reshard(src, out, Request(tp, pp, layers, **asked), vocab_size, force, quiet, check_hashes,
                         no_preflight, team, copy_bytes)
