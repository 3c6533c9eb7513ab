"""Kill -9 trials of `ckpt merge` and `ckpt reshard` (benchmarks/crash_trials.py runs them): a source
checkpoint, a reference output made once, then each trial kills the command at a seeded point and checks
what the disk holds (crash_checks.py), reruns it and compares with the reference."""
from __future__ import annotations

import random
import shutil
import signal
import sys
import time
from pathlib import Path

from crash_checks import Trial, checkpoint_problems, diff_trees, tree_digest
from processes import kill_group, sleep_ms, start, tail, wait_until

from ckpt_tools import output
from ckpt_tools.errors import CkptError
from ckpt_tools.forms import checkpoint as fmt
from ckpt_tools.model.spec import ModelSpec

ROOT = Path(__file__).resolve().parent.parent
CKPT = [sys.executable, "-m", "ckpt_tools.cli"]


def make_source(save: Path, layers: int, hidden: int, ffn: int, vocab: int) -> Path:
    """A synthetic TP2 x PP2 checkpoint written by benchmarks/merge_reshard.py's generate()."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from merge_reshard import generate
    if not (save / fmt.LATEST).is_file():
        spec = ModelSpec("llama", num_layers=layers, hidden_size=hidden, num_attention_heads=8, num_query_groups=4,
                         ffn_hidden_size=ffn, vocab_size=vocab)
        generate(save, spec)
    return fmt.resolve(save)


# sizes so that the work (after ~3 s of imports) takes ~1-2 s here: merge reads only the bf16
# model shards, reshard reads and writes model + fp32 optimizer state
SOURCES = {"merge": {"layers": 8, "hidden": 512, "ffn": 1408, "vocab": 8000},
           "reshard": {"layers": 4, "hidden": 256, "ffn": 704, "vocab": 4000}}


class ToolTrials:
    """`ckpt merge SRC OUT -q` (hf dir or one safetensors file) or `ckpt reshard SRC OUT --tp 1 --pp 1 -q`."""

    TRIGGERS = ("process start", "temp output appears")
    WEIGHTS = (0.3, 0.7)

    def __init__(self, kind: str, work: Path, rng: random.Random, src: Path, rerun_subprocess: bool = False):
        self.kind, self.rng, self.src, self.rerun_subprocess = kind, rng, src, rerun_subprocess
        self.outs, self.logs = work / f"{kind}-out", work / "logs"
        self.outs.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.formats = ["hf", "safetensors"] if kind == "merge" else ["checkpoint"]
        self.refs: dict[str, dict[str, str]] = {}
        self.timing: dict[str, tuple[float, float]] = {}  # format -> (ms to temp output, ms temp -> OUT)
        self.src_digest: dict[str, str] = {}

    def args(self, out: Path, form: str) -> list[str]:
        if self.kind == "merge":
            return ["merge", str(self.src), str(out), "-q"] + (["--format", form] if form != "hf" else [])
        return ["reshard", str(self.src), str(out), "--tp", "1", "--pp", "1", "-q"]

    def out_path(self, name: str, form: str) -> Path:
        return self.outs / (f"{name}.safetensors" if form == "safetensors" else name)

    def setup(self) -> None:
        """Reference outputs (one clean run per format), timed to size the kill delays."""
        problems = checkpoint_problems(self.src)
        if problems:
            raise RuntimeError(f"source checkpoint is not complete: {problems}")
        self.src_digest = {f.name: f"{f.stat().st_size}" for f in self.src.iterdir()}
        for form in self.formats:
            out = self.out_path(f"reference-{form}", form)
            proc = start(CKPT + self.args(out, form), self.logs / f"{self.kind}-reference-{form}.log")
            t0 = time.perf_counter()
            tmp = out.parent / f".{out.name}.tmp-{proc.pid}"
            wait_until(proc, lambda tmp=tmp, out=out: tmp.exists() or out.exists(), timeout=600)
            t1 = time.perf_counter()
            wait_until(proc, out.exists, timeout=600)
            t2 = time.perf_counter()
            if proc.wait(timeout=600) != 0 or not out.exists():
                log = self.logs / f"{self.kind}-reference-{form}.log"
                raise RuntimeError(f"reference {self.kind} failed:\n{tail(log)}")
            self.timing[form] = ((t1 - t0) * 1000, max((t2 - t1) * 1000, 1.0))
            self.refs[form] = tree_digest(out)
            if self.kind == "reshard":
                problems = checkpoint_problems(fmt.resolve(out))
                if problems:
                    raise RuntimeError(f"reference reshard is not complete: {problems}")

    def landing(self, out: Path, tmp: Path) -> str:
        if out.exists():
            return "renamed to OUT (complete)"
        if not tmp.exists():
            return "before temp output"
        if self.kind == "reshard":
            if (tmp / fmt.LATEST).exists():
                return "temp complete, before rename"
            if any(tmp.glob(f"*/{fmt.META}")):
                return "meta.json written, before latest"
            return "writing shards"
        if tmp.is_dir() and (tmp / "config.json").exists():
            return "writing config/tokenizer"
        return "writing tensors"

    def rerun(self, args: list[str], i: int) -> tuple[int, str]:
        if self.rerun_subprocess:
            log = self.logs / f"{self.kind}-{i}-rerun.log"
            proc = start(CKPT + args, log)
            return proc.wait(timeout=600), log.read_text(errors="replace")
        from click.testing import CliRunner

        from ckpt_tools.cli import main
        result = CliRunner().invoke(main, args)
        return result.exit_code, result.output + (repr(result.exception) if result.exit_code not in (0,) else "")

    def calibration(self) -> dict:
        return {f"{form}: start -> temp, temp -> OUT": tuple(round(x) for x in t) for form, t in self.timing.items()}

    def run(self, n: int) -> list[Trial]:
        trials = []
        for i in range(n):
            t0 = time.perf_counter()
            form = self.rng.choice(self.formats)
            trigger = self.rng.choices(self.TRIGGERS, self.WEIGHTS)[0]
            to_tmp, writing = self.timing[form]
            # from the start: anywhere up to the expected end; from the temp output: inside the writes
            delay = self.rng.uniform(0, to_tmp + writing if trigger == self.TRIGGERS[0] else 1.2 * writing)
            label = f"{trigger}{f' ({form})' if self.kind == 'merge' else ''}"
            trial = Trial(self.kind, i, label, delay)
            out = self.out_path(f"out-{i}", form)
            args = self.args(out, form)
            proc = start(CKPT + args, self.logs / f"{self.kind}-{i}.log")
            began = time.perf_counter()
            tmp = out.parent / f".{out.name}.tmp-{proc.pid}"
            if trigger == self.TRIGGERS[0]:
                sleep_ms(delay)
            elif wait_until(proc, lambda tmp=tmp, out=out: tmp.exists() or out.exists(), timeout=600):
                to_tmp = min(to_tmp, (time.perf_counter() - began) * 1000)
                sleep_ms(delay)
            kill_group(proc)
            if proc.returncode == 0:  # faster than the calibration run: aim earlier from now on
                writing = max(1.0, min(writing, delay if trigger != self.TRIGGERS[0] else delay - to_tmp))
            self.timing[form] = (to_tmp, writing)
            if proc.returncode not in (-signal.SIGKILL, 0):
                trial.problems.append(f"the command failed (exit {proc.returncode}) before the kill:\n"
                                      f"{tail(self.logs / f'{self.kind}-{i}.log')}")
            trial.landed = self.landing(out, tmp) if proc.returncode else "finished before the kill"
            left = [p.name for p in output.leftovers(out)]
            trial.leftover = ", ".join(left + [f"{p.name} (not named)" for p in self.outs.iterdir()
                                               if p.name.startswith(".") and p.name not in left])
            trial.problems += self.check_out(out, form, "after the kill")
            trial.problems += self.check_source()
            # the same command again (with --force when OUT is already there): succeeds, names leftovers
            code, text = self.rerun(args + (["--force"] if out.exists() else []), i)
            if code != 0:
                trial.problems.append(f"rerun failed (exit {code}): {text[-1500:]}")
            else:
                for name in left:
                    if name not in text:
                        trial.problems.append(f"rerun did not name the leftover {name}: {text[-800:]}")
                trial.problems += self.check_out(out, form, "after the rerun", must_exist=True)
            for p in [out, *output.leftovers(out)]:
                shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
            trial.seconds = time.perf_counter() - t0
            trials.append(trial)
        return trials

    def check_out(self, out: Path, form: str, when: str, must_exist: bool = False) -> list[str]:
        if not out.exists():
            return [f"{out.name} missing {when}"] if must_exist else []
        problems = []
        if self.kind == "reshard":
            try:
                problems += [f"{out.name} {when}: {p}" for p in checkpoint_problems(fmt.resolve(out))]
            except CkptError as e:
                problems.append(f"{out.name} {when}: {e}")
        # byte-equal files => every tensor bit-equal to the reference's
        return problems + diff_trees(tree_digest(out), self.refs[form], f"{out.name} {when}")

    def check_source(self) -> list[str]:
        """The source is untouched: the same files, each with the size and content hash meta.json records."""
        now = {f.name: f"{f.stat().st_size}" for f in self.src.iterdir()}
        return (diff_trees(now, self.src_digest, f"source {self.src}")
                + [f"source: {p}" for p in checkpoint_problems(self.src)])


# ---------------------------------------------------------------- all of it
