"""The one entry of each rewriting verb, `ckpt reshard` and `ckpt import`, for the command line and the Python API
alike (reshard.reshard, importer.import_hf): one writer per target form, over one source.

The writers: verbs/dist_copy.py (reshard into Megatron-LM's forms), verbs/ours_copy.py (reshard and import into our
format), verbs/hf_copy.py (import into Megatron-LM's forms). The source: the checkpoint's bytes (`by_bytes`:
byte_ranges.ByteSource, each tensor a byte range of its files or made by the form's torch reader one by one where its
bytes are not the layout table's; an HF model's tensors' row ranges), or, where those do not do, the checkpoint read
through its torch reader (ByteSource.through) or the HF model read through torch (importer.checked), which word what is
wrong with the input. torch is imported only where a tensor is made. `tuned`: the command line's process settings for
a source read through torch (copying_process).
"""
from __future__ import annotations

from pathlib import Path

from ckpt_tools import output
from ckpt_tools.team import SOLO, Team
from ckpt_tools.verbs.request import Request


def reshard(src: str | Path, out: str | Path, want: Request, vocab_size: int | None = None, force: bool = False,
            quiet: bool = False, check_hashes: bool = False, no_preflight: bool = False, team: Team = SOLO,
            copy_bytes: bool = True, tuned: bool = False) -> str:
    """Rewrite `src` as `want` says into OUT: one writer per target form (verbs/dist_copy.py for Megatron-LM's,
    verbs/ours_copy.py for ours) over the source's bytes (`by_bytes`), or over its torch reader where the byte index
    declines it or the copy does not take what it holds (`copy_bytes` False: the torch reader alone)."""
    want.check()
    summary = by_bytes(src, out, want, vocab_size, force, quiet, check_hashes, no_preflight, team) if copy_bytes \
        else None
    if summary is not None:
        return summary
    if tuned:
        copying_process()
    from ckpt_tools.forms.byte_ranges import ByteSource
    from ckpt_tools.forms.shards import open_checked
    output.check_target(out, force)  # an existing OUT is refused before the source is read
    source = ByteSource.through(open_checked(src, vocab_size, check_hashes, team))
    try:
        summary = _copier(want)(source, out, want, force, quiet, check_hashes, no_preflight, team)
    finally:
        source.close()
    assert summary is not None, "a source read through its torch reader is always written"
    return summary


def by_bytes(src: str | Path, out: str | Path, want: Request, vocab_size: int | None = None, force: bool = False,
             quiet: bool = False, check_hashes: bool = False, no_preflight: bool = False,
             team: Team = SOLO) -> str | None:
    """The reshard from the source's bytes (byte_ranges.ByteSource: byte ranges, and the tensors its torch reader
    makes one by one); None, having written nothing, where the byte index declines the source or the copy does not take
    what it holds."""
    from ckpt_tools.forms.byte_index import Declined
    from ckpt_tools.forms.byte_ranges import ByteSource
    source = None
    try:
        source = ByteSource.open(src, vocab_size, False, carry_optimizer=want.optimizer)
    except Declined:
        pass
    try:
        if not team.all(source is not None):  # one path for all: a process that declined sends every one through torch
            return None
        return _copier(want)(source, out, want, force, quiet, check_hashes, no_preflight, team)
    finally:
        if source is not None:
            source.close()


def _copier(want: Request):
    from ckpt_tools.verbs import dist_copy, ours_copy
    return dist_copy.reshard if want.megatron else ours_copy.reshard


def import_hf(hf_dir: str | Path, out: str | Path, want: Request, dtype: str | None = None, force: bool = False,
              quiet: bool = False, team: Team = SOLO, copy_bytes: bool = True, tuned: bool = False) -> str:
    """Import the HF model in `hf_dir` as `want` says into OUT; `dtype` the weights' dtype name ("bfloat16"; None: the
    HF weights' own). One writer per target form (verbs/hf_copy.py for Megatron-LM's, verbs/ours_copy.py for ours)
    over the HF tensors' bytes, or over the model read through torch where the copy does not read them
    (`copy_bytes` False: through torch alone)."""
    from ckpt_tools.verbs import hf_copy, ours_copy
    want.check()
    copier = hf_copy.import_hf if want.megatron else ours_copy.import_hf
    summary = copier(hf_dir, out, want, dtype, force, quiet, team) if copy_bytes else None
    if summary is not None:
        return summary
    if tuned:
        copying_process()
    return copier(hf_dir, out, want, dtype, force, quiet, team, through=True)


def copying_process() -> None:
    """The torch path's process settings. Reshard and import through torch copy bytes (memory-bound): a second OpenMP
    thread in each copy only adds waits on a busy core, while the background hash and fsync threads already use it
    (merge sets the same through its `torch_threads`, where it uses torch); the full tensors made one after another
    reuse freed memory; and the soft limit of open files is raised to the hard one (a stage's files are open
    together, each also read by its hash)."""
    import resource

    import torch

    from ckpt_tools import memory
    torch.set_num_threads(1)
    memory.reuse_freed_memory()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):  # an unlimited hard limit the kernel does not take as a soft one: left as it is
        pass
