"""Kill -9 trials: a trainer save, `ckpt merge` and `ckpt reshard` killed at seeded random points.

After every kill the disk is checked against DESIGN.md Contract 2 and Contract 4:
- train: `latest` names a checkpoint whose meta.json records every file with its size and content hash
  (`check_files` == []); every `checkpoint-*` dir (no dot prefix) is complete in that sense; the next
  run resumes from `latest`, trains on and names every leftover `.checkpoint-N.tmp` in a note.
- merge / reshard: OUT does not exist, or it is byte-identical to a reference output made once (so
  its tensors are bit-equal; for reshard also `check_files` on OUT's checkpoint == []); the source
  checkpoint is unchanged; a rerun of the same command succeeds, names the leftover
  `.OUT.tmp-<pid>`, and its output equals the reference.

Kills are timed from what the disk shows (polled every ~0.5 ms), not only from the clock, so they
land inside the writes: a trial picks a trigger (process start, temp dir appears, meta.json appears,
rename done) and a random extra delay sized from a calibration run of the same command; the
landing point is then read back from the disk (`landed`).

Trainer trials run as a chain: every run resumes from the save dir the previous kill left, so its
startup is the previous trial's resume check ("resumed from ... at iteration K" and the leftover
notes, then at least one more iteration before its own save); a last run resumes for one more
iteration and must exit 0. `--resume-each` adds a separate resume run (exit 0) after every kill.

The trainer trials are here, the merge/reshard trials in crash_tools.py, the disk checks and the report in
crash_checks.py, process control in processes.py. tests/test_crash.py runs a few of each in CI. Usage:
    python benchmarks/crash_trials.py --trials 30 [--seed 0] [--workdir DIR] [--kinds train,merge,reshard]
        [--layout 2x2] [--torchrun] [--resume-each] [--rerun-subprocess] [--keep]
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import ClassVar

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ckpt_tools.errors import CkptError
from ckpt_tools.forms import checkpoint as fmt
from ckpt_tools.ports import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
from crash_checks import (  # noqa: E402
    STAGES,
    SaveWatch,
    Trial,
    checkpoint_problems,
    failures,
    latest_iteration,
    summary,
    table,
)
from crash_tools import SOURCES, ToolTrials, make_source  # noqa: E402
from processes import (  # noqa: E402
    POLL,
    child_env,
    kill_group,
    sleep_ms,
    start,
    tail,
    wait_until,
)

CONFIG = ROOT / "fixtures" / "configs" / "tiny_llama.yaml"


class TrainerTrials:
    """Tiny llama, TP1 x PP1, one process, save_interval=1, all runs on one save dir.

    A plain run resumes from `latest` (K) and is killed in its save of K+1 or K+2. A rollback run
    (`load` = checkpoint-(K-1)) is killed in its save of K, which replaces the checkpoint that
    `latest` names.
    """

    TRIGGERS: ClassVar[dict[str, int]] = {"temp dir appears": 1, "meta.json appears": 2, "rename done": 3}
    WEIGHTS = (0.6, 0.2, 0.2)
    ROLLBACK_EVERY = 4  # every 4th trial is a rollback run

    def __init__(self, work: Path, rng: random.Random, resume_each: bool = False, tp: int = 1, pp: int = 1,
                 torchrun: bool = False):
        self.work, self.rng, self.resume_each = work, rng, resume_each
        self.tp, self.pp, self.torchrun = tp, pp, torchrun or tp * pp > 1
        self.save, self.cache, self.logs = work / "train", work / "data-cache", work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.stage_ms: dict[int, float] = {}  # stage -> ms from it to `latest` updated (calibrated)
        self.runs = 0

    def command(self, train_iters: int, load: Path | None = None) -> tuple[list[str], dict]:
        port = free_port()
        launcher = ([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={self.tp * self.pp}",
                     f"--master-port={port}"] if self.torchrun else [sys.executable])
        cmd = launcher + ["-m", "trainer", "--config", str(CONFIG)]
        sets = [f"tp_degree={self.tp}", f"pp_degree={self.pp}", "save_interval=1", "log_interval=1",
                f"train_iters={train_iters}", f"save_dir={self.save}", f"data_cache_dir={self.cache}"]
        sets += [f"load={load}"] if load else []
        for item in sets:
            cmd += ["--set", item]
        return cmd, {**child_env(), "MASTER_PORT": str(port)}

    def launch(self, train_iters: int, load: Path | None = None) -> tuple[subprocess.Popen, Path]:
        self.runs += 1
        log = self.logs / f"train-{self.runs}.log"
        cmd, env = self.command(train_iters, load)
        return start(cmd, log, env), log

    def setup(self, iters: int = 3) -> None:
        """A complete first run (checkpoints 1..iters) that also times the stages of a save."""
        proc, log = self.launch(iters)
        times: dict[int, list[float]] = collections.defaultdict(list)
        for it in range(1, iters + 1):
            seen: dict[int, float] = {}
            watch = SaveWatch(self.save, it)
            while True:
                stage = watch.stage()
                now = time.perf_counter()
                for s in range(1, stage + 1):
                    seen.setdefault(s, now)
                if stage == 4 or proc.poll() is not None:
                    break
                time.sleep(POLL)
            if 4 not in seen:
                break
            for s in (1, 2, 3):
                if s in seen:
                    times[s].append((seen[4] - seen[s]) * 1000)
        if proc.wait(timeout=300) != 0 or latest_iteration(self.save) != iters:
            raise RuntimeError(f"the first training run failed (exit {proc.returncode}):\n{tail(log)}")
        full = max(times[1]) if times[1] else 50.0
        self.stage_ms = {1: full, 2: max(times[2]) if times[2] else full / 4, 3: max(times[3]) if times[3] else 2.0}

    def calibration(self) -> dict:
        return {"save: temp dir -> latest": round(self.stage_ms[1], 1),
                "meta.json -> latest": round(self.stage_ms[2], 1), "rename -> latest": round(self.stage_ms[3], 1)}

    def run(self, n: int) -> list[Trial]:
        trials: list[Trial] = []
        pending: tuple[Trial, list[str]] | None = None  # a kill whose leftovers the next run must name
        for i in range(n):
            t0 = time.perf_counter()
            k = latest_iteration(self.save)
            before = {p.name for p in self.save.iterdir() if p.name.startswith(".")}
            load = self.save / fmt.checkpoint_name(k - 1)
            rollback = i % self.ROLLBACK_EVERY == self.ROLLBACK_EVERY - 1 and (load / fmt.META).is_file()
            target = k if rollback else k + self.rng.choice([1, 1, 2])
            trigger = self.rng.choices(list(self.TRIGGERS), self.WEIGHTS)[0]
            stage = self.TRIGGERS[trigger]
            delay = self.rng.uniform(0, 1.2 * self.stage_ms[stage] + (1 if stage == 3 else 0))
            what = f"rollback to {k - 1}, re-save {k}" if rollback else f"save {target - k} of the run"
            trial = Trial("train", i, f"{trigger} ({what})", delay)
            watch = SaveWatch(self.save, target)
            proc, log = self.launch(target + 2, load if rollback else None)  # never its last save
            fired = wait_until(proc, lambda watch=watch, stage=stage: watch.stage() >= stage, timeout=600)
            if fired:
                sleep_ms(delay)
            kill_group(proc)
            # this run's startup is the previous kill's resume check
            start_dir, start_it = (load, k - 1) if rollback else (self.save / fmt.checkpoint_name(k), k)
            self._check_resume(trial, log, start_dir, start_it, pending)
            if not fired or proc.returncode != -signal.SIGKILL:
                trial.problems.append(f"the run ended (exit {proc.returncode}) before the kill:\n{tail(log)}")
            trial.landed = STAGES[watch.stage()]
            trial.problems += self.check_disk()
            leftovers = fmt.leftover_temps(self.save)
            stray = sorted(p.name for p in self.save.iterdir() if p.name.startswith(".") and p.name not in before)
            trial.leftover = ", ".join(n if n in leftovers else f"{n} (not named)" for n in stray)
            pending = (trial, leftovers)
            if self.resume_each or i == n - 1:  # a run that must finish: resume, one more iteration, exit 0
                k = latest_iteration(self.save)
                proc, log = self.launch(k + 1)
                try:
                    proc.wait(timeout=600)
                except subprocess.TimeoutExpired:
                    kill_group(proc)
                if proc.returncode != 0:
                    trial.problems.append(f"resume run failed (exit {proc.returncode}):\n{tail(log)}")
                self._check_resume(trial, log, self.save / fmt.checkpoint_name(k), k, pending)
                trial.problems += self.check_disk()
                pending = None
            trial.seconds = time.perf_counter() - t0
            trials.append(trial)
        return trials

    def check_disk(self) -> list[str]:
        problems = []
        try:
            latest = fmt.find_latest(self.save)
        except CkptError as e:
            return [f"latest: {e}"]
        if latest is None:
            return [f"{self.save}: `latest` is gone"]
        problems += [f"latest -> {latest.name}: {p}" for p in checkpoint_problems(latest)]
        for d in sorted(self.save.glob("checkpoint-*")):
            if d != latest:
                problems += [f"{d.name} (looks complete): {p}" for p in checkpoint_problems(d)]
        return problems

    def _check_resume(self, trial: Trial, log: Path, ckpt_dir: Path, it: int, pending: tuple | None) -> None:
        """The run logged in `log` resumed from ckpt_dir at iteration `it` and named the previous kill's leftovers."""
        text = log.read_text(errors="replace")
        if f"resumed from {ckpt_dir} at iteration {it}" not in text:
            trial.problems.append(f"the run did not resume from {ckpt_dir} at iteration {it}:\n{tail(log)}")
        if pending is None:
            return
        before, leftovers = pending
        notes = [line for line in text.splitlines() if line.startswith("note:")]
        for name in leftovers:
            if not any(str(self.save / name) in line for line in notes):
                before.problems.append(f"the next run did not name the leftover {name}:\n{tail(log)}")


# ---------------------------------------------------------------- merge / reshard trials
KINDS = ("train", "merge", "reshard")


def run_trials(work: Path, counts: dict[str, int], seed: int = 0, resume_each: bool = False,
               rerun_subprocess: bool = False, layout: tuple[int, int] = (1, 1), torchrun: bool = False,
               log=print) -> list[Trial]:
    """Run counts[kind] trials of each kind under `work`; every kind has its own seeded RNG."""
    work.mkdir(parents=True, exist_ok=True)
    trials: list[Trial] = []
    for kind in KINDS:
        n = counts.get(kind, 0)
        if not n:
            continue
        rng = random.Random(f"{seed}-{kind}")
        t0 = time.perf_counter()
        if kind == "train":
            runner = TrainerTrials(work / kind, rng, resume_each, *layout, torchrun=torchrun)
        else:
            src = make_source(work / kind / "src", **SOURCES[kind])
            runner = ToolTrials(kind, work / kind, rng, src, rerun_subprocess)
        runner.setup()
        log(f"{kind}: setup {time.perf_counter() - t0:.1f}s, calibration (ms) {runner.calibration()}")
        done = runner.run(n)
        log(f"{kind}: {n} trials in {sum(t.seconds for t in done):.1f}s, "
            f"{sum(not t.ok for t in done)} failed")
        trials += done
    return trials


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=30, help="trials per kind (default 30)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma list of train, merge, reshard")
    ap.add_argument("--workdir", type=Path, default=None, help="scratch dir (default: a temp dir, removed after)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch dir")
    ap.add_argument("--resume-each", action="store_true",
                    help="after every trainer kill, a separate resume run that must exit 0 (slower)")
    ap.add_argument("--layout", default="1x1",
                    help="trainer TPxPP (default 1x1; more than one rank runs under torchrun)")
    ap.add_argument("--torchrun", action="store_true", help="launch the trainer with torchrun even at 1x1")
    ap.add_argument("--rerun-subprocess", action="store_true",
                    help="rerun merge/reshard as a new process (default: the same CLI in this process)")
    args = ap.parse_args()
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    try:
        layout = tuple(int(x) for x in args.layout.lower().split("x"))
        assert len(layout) == 2 and min(layout) >= 1
    except (ValueError, AssertionError):
        ap.error(f"--layout {args.layout!r}: expected TPxPP, e.g. 2x2")
    if bad := [k for k in kinds if k not in KINDS]:
        ap.error(f"unknown kind(s) {bad}: choose from {', '.join(KINDS)}")
    work = Path(tempfile.mkdtemp(prefix="crash-trials-", dir=args.workdir))
    start_time = time.perf_counter()
    try:
        trials = run_trials(work, {k: args.trials for k in kinds}, args.seed, args.resume_each,
                            args.rerun_subprocess, layout, args.torchrun,
                            log=lambda s: print(s, file=sys.stderr, flush=True))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(table(trials) + "\n")
    print(summary(trials) + f"; {time.perf_counter() - start_time:.0f}s, seed {args.seed}, {os.cpu_count()} CPUs")
    if any(not t.ok for t in trials):
        print("\n" + failures(trials))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
