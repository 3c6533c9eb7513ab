"""Child processes for the kill -9 trials (benchmarks/crash_trials.py): start one in its own session,
poll the disk until a trigger, kill it and everything below it (torchrun's workers included)."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POLL = 0.0005  # seconds between two looks at the disk


def child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return env


def start(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    """A child in its own session (process group), stdout + stderr to `log`."""
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env or child_env(), cwd=ROOT,
                                start_new_session=True)


def descendants(pid: int) -> list[int]:
    """Every process below pid (Linux /proc/<pid>/task/<tid>/children), parents first."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                kids = [int(x) for x in task.read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group and every process below it, then wait until all are gone.

    The group alone is not enough under torchrun: its agent starts each worker in a session of its
    own (start_new_session=True), and a worker whose agent was killed trains and saves on.
    """
    pids = descendants(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    end = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.01)


def wait_until(proc: subprocess.Popen, ready, timeout: float) -> bool:
    """Poll `ready()` until true; False when the process exits first or time runs out."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if ready():
            return True
        if proc.poll() is not None:
            return bool(ready())
        time.sleep(POLL)
    return False


def sleep_ms(ms: float) -> None:
    end = time.perf_counter() + ms / 1000
    while (left := end - time.perf_counter()) > 0:
        time.sleep(min(left, POLL))


def tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""
