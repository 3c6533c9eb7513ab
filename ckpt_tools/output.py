"""Outputs appear whole or not at all: written under a temp name beside OUT, renamed when complete.

An existing OUT is refused unless `force`; then it is replaced only after the new one is complete.
A failure (or Ctrl-C) removes the temp output; a kill -9 leaves `.<name>.tmp-<pid>`, which never
looks like a finished output and which `leftovers()` names.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from ckpt_tools import durable
from ckpt_tools.errors import CkptError
from ckpt_tools.team import SOLO, Team


def check_target(out: str | Path, force: bool) -> Path:
    out = Path(out)
    if out.exists() and not force:
        raise CkptError(f"{out}: already exists: choose another output path or pass --force to replace it")
    return out


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


@contextlib.contextmanager
def staged(out: str | Path, force: bool, directory: bool = True, team: Team = SOLO) -> Iterator[Path]:
    """Yield a temp path beside OUT (a fresh dir, or a file path); rename it to OUT on success. In a team (several
    processes writing parts of OUT, ckpt_tools.team) process 0 makes the temp dir and renames it once every
    process has said it succeeded; a failure anywhere removes it, and every process waits for that removal."""
    out = check_target(out, force)
    tmp = out.parent / team.first(lambda: f".{out.name}.tmp-{os.getpid()}")

    def make() -> None:
        if team.lead:
            out.parent.mkdir(parents=True, exist_ok=True)
            _remove(tmp)
            if directory:
                tmp.mkdir()
    team.share(make)  # the others write into tmp only once it exists
    try:
        yield tmp
        if directory and team.lead:
            durable.fsync_dir(tmp)
        team.share(lambda: None)  # every process has written its part
    except BaseException as e:
        team.announce(e)  # the others hear of it where they wait (at the end of their part)
        if team.lead:
            _remove(tmp)
        team.settle()  # no process ends (and torchrun ends the rest) before the removal is done
        raise
    if not team.lead:
        return
    old = None
    if out.exists() or out.is_symlink():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
    os.replace(tmp, out)
    durable.fsync_dir(out.parent)
    if old is not None:
        _remove(old)


def leftovers(out: str | Path) -> list[Path]:
    """Temp outputs that an interrupted run left beside OUT."""
    out = Path(out)
    if not out.parent.is_dir():
        return []
    return sorted(p for p in out.parent.iterdir()
                  if p.name.startswith(f".{out.name}.tmp-") or p.name.startswith(f".{out.name}.old-"))


def preflight(out: Path, nbytes: int, skip: bool) -> None:
    """Refuse before writing when the filesystem of OUT has not room for ~nbytes (+2% and 64 MiB)."""
    if skip:
        return
    where = Path(out).absolute()
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    need = int(nbytes * 1.02) + (64 << 20)
    if need > free:
        raise CkptError(f"{out}: needs about {need / 2**30:.2f} GiB, {free / 2**30:.2f} GiB free on that filesystem: "
                        f"free space or choose another OUT (--no-preflight skips this check)")


def note_leftovers(out: Path) -> str | None:
    names = [p.name for p in leftovers(out)]
    if not names:
        return None
    return (f"note: {', '.join(names)} beside {out} {'is' if len(names) == 1 else 'are'} left by an interrupted "
            f"run (never a complete output): remove {'it' if len(names) == 1 else 'them'}")


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress(total: int, desc: str, quiet: bool, unit: str = "B"):
    """A tqdm bar over bytes; off when quiet or when stderr is not a terminal (then tqdm, whose import
    costs a fast merge a noticeable part of its time, is not imported)."""
    if quiet or not sys.stderr.isatty():
        return _NoBar()
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, unit_divisor=1024, leave=False, file=sys.stderr)
