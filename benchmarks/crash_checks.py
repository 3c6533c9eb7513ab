"""What the crash trials read back from the disk: the trial record, the completeness checks of a checkpoint
and of an output tree, how far a killed trainer save got, and the report (benchmarks/crash_trials.py)."""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from pathlib import Path

from ckpt_tools import hashing
from ckpt_tools.errors import CkptError
from ckpt_tools.forms import checkpoint as fmt


@dataclass
class Trial:
    kind: str            # train | merge | reshard
    index: int
    trigger: str         # what the kill was timed from
    delay_ms: float      # extra delay after the trigger
    landed: str = "?"    # where the kill landed, read back from the disk
    leftover: str = ""   # what this kill left beside the output (the next run names it)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems


# ---------------------------------------------------------------- shared checks
def checkpoint_problems(ckpt_dir: Path) -> list[str]:
    """A checkpoint dir is complete: meta.json reads and every file it records is intact."""
    try:
        return fmt.check_files(fmt.Meta.read(ckpt_dir))
    except CkptError as e:
        return [str(e)]


def tree_digest(path: Path) -> dict[str, str]:
    """relative name -> content hash of every file under path (or of path itself when it is a file)."""
    if path.is_file():
        return {"<file>": hashing.hash_file(path)}
    return {str(f.relative_to(path)): hashing.hash_file(f) for f in sorted(path.rglob("*")) if f.is_file()}


def diff_trees(got: dict[str, str], want: dict[str, str], label: str) -> list[str]:
    if got == want:
        return []
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    changed = sorted(k for k in set(got) & set(want) if got[k] != want[k])
    parts = [f"missing {missing[:3]}" if missing else "", f"unexpected {extra[:3]}" if extra else "",
             f"different bytes {changed[:3]}" if changed else ""]
    return [f"{label}: differs from the reference: {'; '.join(p for p in parts if p)}"]


# ---------------------------------------------------------------- trainer trials
STAGES = ["before save", "writing files", "meta.json written, before rename", "renamed, before latest",
          "latest updated (save complete)"]


def latest_iteration(save: Path) -> int:
    try:
        name = (save / fmt.LATEST).read_text().strip()
        return int(name.rsplit("-", 1)[1])
    except (OSError, ValueError, IndexError):
        return -1


def _ident(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns


class SaveWatch:
    """How far a new run's save of iteration `it` got, from the disk: an index into STAGES.

    A temp dir, checkpoint-N or `latest` that was there before the watch began does not count: only
    one that is new or changed since (inode or ctime differ) is this run's.
    """

    def __init__(self, save: Path, it: int):
        self.save, self.it = save, it
        self.tmp, self.final, self.latest = save / fmt.temp_name(it), save / fmt.checkpoint_name(it), save / fmt.LATEST
        self.base = {p: _ident(p) for p in (self.tmp, self.final, self.latest)}

    def _fresh(self, path: Path) -> bool:
        now = _ident(path)
        return now is not None and now != self.base[path]

    def stage(self) -> int:
        if self._fresh(self.latest) and latest_iteration(self.save) >= self.it:
            return 4
        if self._fresh(self.final):
            return 3
        if self._fresh(self.tmp):
            return 2 if (self.tmp / fmt.META).exists() else 1
        return 0


# ---------------------------------------------------------------- report
def table(trials: list[Trial]) -> str:
    head = ["kind", "#", "kill timed from", "+ms", "landed", "leftover", "result"]
    rows = [[t.kind, str(t.index), t.trigger, f"{t.delay_ms:.1f}", t.landed, t.leftover or "-",
             "ok" if t.ok else "FAIL"] for t in trials]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    lines = [head, ["-" * w for w in widths]] + rows
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip() for cells in lines)


def summary(trials: list[Trial]) -> str:
    parts = []
    for kind in dict.fromkeys(t.kind for t in trials):
        mine = [t for t in trials if t.kind == kind]
        if mine:
            landed = collections.Counter(t.landed for t in mine)
            parts.append(f"{kind} {len(mine)} [" + ", ".join(f"{k}: {v}" for k, v in landed.items()) + "]")
    return (f"crash trials: {len(trials)} ({'; '.join(parts)}); kills that left a temp output "
            f"{sum(bool(t.leftover) for t in trials)}; failures = {sum(not t.ok for t in trials)}")


def failures(trials: list[Trial]) -> str:
    return "\n\n".join(f"{t.kind} #{t.index} ({t.trigger} +{t.delay_ms:.1f} ms, landed {t.landed}):\n  "
                       + "\n  ".join(t.problems) for t in trials if not t.ok)
