"""Shared fixtures: tiny training runs under torchrun, made once per test session."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckpt_tools import io, ports
from ckpt_tools.forms import checkpoint as fmt
from ckpt_tools.model.ranks import Rank
from ckpt_tools.ports import free_port
from ckpt_tools.team import die_with_parent, kill_running

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "fixtures" / "configs"

# Under pytest-xdist each worker draws rendezvous ports from a range of its own, below the kernel's ephemeral ports
# (ckpt_tools.ports.free_port): two workers' processes never race for one port. Children inherit it.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
_ONE_PROCESS = "18000-19999"  # pytest without workers (the gpu groups): below the ephemeral ports, which NCCL's take
if _WORKER.startswith("gw") and _WORKER[2:].isdigit():
    if os.environ.get(ports.PORT_RANGE) in (None, _ONE_PROCESS):  # a worker inherits the controller's: its own instead
        os.environ[ports.PORT_RANGE] = f"{20000 + 2000 * int(_WORKER[2:])}-{21999 + 2000 * int(_WORKER[2:])}"
else:
    os.environ.setdefault(ports.PORT_RANGE, _ONE_PROCESS)


# scripts/test.sh runs the suite on two pytest-xdist workers, a test module to each at a time, in the order collected
# (--no-loadscope-reorder). Modules go out heaviest first (longest-processing-time first), so that the run does not end
# on one worker alone in a long module: a module's weight is its multi-process (`slow`) tests, ~15 s each, and its
# others, ~0.3 s each (the measured averages).
SLOW_S, FAST_S = 15.0, 0.3


@pytest.hookimpl(trylast=True)  # after -m / -k deselected what does not run
def pytest_collection_modifyitems(config, items) -> None:
    weight: dict[Path, float] = {}
    first: dict[Path, int] = {}
    for i, item in enumerate(items):
        weight[item.path] = weight.get(item.path, 0.0) + (SLOW_S if item.get_closest_marker("slow") else FAST_S)
        first.setdefault(item.path, i)
    items.sort(key=lambda item: (-weight[item.path], first[item.path]))  # stable: each module's order, together


_PER_RUN = ("RANK", "LOCAL_RANK", "ROLE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME", "OMP_NUM_THREADS", "PYTHONWARNINGS")


def _lasting(env: dict) -> dict:
    """An environment less the launch's own variables, pytest's current test and an outer torchrun's agent."""
    return {k: v for k, v in env.items()
            if k not in _PER_RUN and k != "PYTEST_CURRENT_TEST" and not k.startswith("TORCHELASTIC_")}


class _Zygote:
    """tests/rank_zygote.py for one rank index, started once per test process: a rank forked from a process that has
    imported torch (and what else every rank imports) instead of a `python -u` that imports it anew."""

    def __init__(self, rank: int, lasting: dict):
        import tempfile
        import threading
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"rank-zygote-{rank}-", suffix=".log", delete=False)
        env = {**lasting, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        env.pop("PYTHONHASHSEED", None)  # each zygote its own, as each rank started anew has
        self.proc = subprocess.Popen([sys.executable, "-u", str(ROOT / "tests" / "rank_zygote.py")], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     preexec_fn=die_with_parent)
        self.codes: dict[int, int] = {}
        self.ready: bool | None = None
        self._started: list[int] = []
        self._event = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        with self._event:
            if not self._event.wait_for(lambda: self.ready is not None, timeout=120) or not self.ready:
                self.close()
                raise RuntimeError("the rank zygote did not start")

    def _read(self) -> None:
        for line in self.proc.stdout:
            word, *rest = line.split() or [""]
            with self._event:
                if word == "ready":
                    self.ready = True
                elif word == "started" and len(rest) == 1:
                    self._started.append(int(rest[0]))
                elif word == "exited" and len(rest) == 2:
                    self.codes[int(rest[0])] = int(rest[1])
                self._event.notify_all()
        with self._event:  # it ended: its ranks died with it (PR_SET_PDEATHSIG)
            self.ready = False
            self._event.notify_all()

    def start(self, argv: list[str], env: dict, out: str, err: str) -> int:
        with self._event:
            self.proc.stdin.write(json.dumps({"argv": argv, "env": env, "cwd": str(ROOT), "out": out,
                                              "err": err}) + "\n")
            self.proc.stdin.flush()
            if not self._event.wait_for(lambda: self._started or not self.ready, timeout=60) or not self._started:
                self.close()
                raise RuntimeError(f"the rank zygote did not fork (its log: {self.log.name})")
            return self._started.pop(0)

    def close(self) -> None:
        self.ready = False
        if self.proc.poll() is None:
            self.proc.kill()


class _Forked:
    """A rank forked by a zygote, as much of subprocess.Popen as torchrun() uses. Signals go through a pidfd (the pid
    cannot be another process's by then); a rank whose zygote is gone is gone too (it died with it)."""

    def __init__(self, zygote: _Zygote, pid: int):
        self.zygote, self.pid, self.returncode = zygote, pid, None
        try:
            self.fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            self.fd = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.codes.pop(self.pid, None)
            if self.returncode is None and not self.zygote.ready:
                self.returncode = -9
            if self.returncode is not None and self.fd is not None:
                os.close(self.fd)
                self.fd = None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        import signal
        if self.poll() is None:
            try:
                if self.fd is not None:
                    signal.pidfd_send_signal(self.fd, sig)
                else:
                    os.kill(self.pid, sig)
            except (ProcessLookupError, OSError):
                pass

    def kill(self) -> None:
        import signal
        self.send_signal(signal.SIGKILL)

    def wait(self) -> int:
        import time
        deadline = time.monotonic() + 60
        while self.poll() is None:
            if time.monotonic() > deadline:  # its zygote has stopped answering: end it, and its ranks with it
                self.zygote.close()
            time.sleep(0.01)
        return self.returncode


_zygotes: dict[frozenset, dict[int, _Zygote | None]] = {}  # this test process's: by environment, then rank index
_ENVIRONMENTS = 3  # the environments zygotes are kept for (the least recently used one's are ended)


def _rank_starter(rank: int, env: dict) -> _Zygote | None:
    """The zygote of rank index `rank` for the run's environment (less the launch's own variables: what torch and
    transformers read at import is read in the zygote), or None: the rank is started anew. Anew with
    CKPT_TEST_FORK=0, and on a machine with a GPU: a process forked after the CUDA driver was initialised (as torch's
    imports may do, asking for the devices) cannot use it."""
    if os.environ.get("CKPT_TEST_FORK", "1") == "0" or torch.cuda.is_available():
        return None
    lasting = _lasting(env)
    key = frozenset(lasting.items())
    zygotes = _zygotes.pop(key, {})
    _zygotes[key] = zygotes  # the most recently used last
    while len(_zygotes) > _ENVIRONMENTS:
        for old in _zygotes.pop(next(iter(_zygotes))).values():
            if old is not None:
                old.close()
    zygote = zygotes.get(rank)
    if rank not in zygotes or (zygote is not None and not zygote.ready):
        try:
            zygotes[rank] = _Zygote(rank, lasting)
        except (OSError, RuntimeError):
            zygotes[rank] = None
    return zygotes[rank]


def torchrun(nproc: int, args: list[str], timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    """Run `torchrun --nproc-per-node N <args>` (args: a script and its arguments, or -m module ...); output captured.

    The N processes are started as torchrun starts them on one node: `python -u`, the same environment (RANK,
    LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...; rank 0 hosts the rendezvous store, which torchrun's agent
    would), and when one fails the others are ended (SIGTERM, SIGKILL 30 s later) after a moment to say why, as
    torchrun ends them. Without torchrun's own process, which imports torch and its elastic agent (~1.5 s of CPU a
    run on this VM, hundreds of runs a suite); and each rank forked from tests/rank_zygote.py, which has imported torch
    already (~3 s of CPU a rank), or started anew (_rank_starter says when). `ckpt train`,
    `ckpt verify` and the GPU scripts launch the real torchrun; the tests of `ckpt train` run it."""
    import signal
    import tempfile
    import time
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}  # an outer torchrun's agent
    base.update({"PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                 "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(nproc)})
    cmd = [sys.executable, "-u", *args]
    with tempfile.NamedTemporaryFile("w+") as out, tempfile.NamedTemporaryFile("w+") as err:
        procs: list = []
        deadline, failed, ending, timed_out, ended = time.monotonic() + timeout, None, None, False, 0
        try:
            for r in range(nproc):
                env = {**base, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)}
                zygote = _rank_starter(r, env)
                if zygote is not None:
                    procs.append(_Forked(zygote, zygote.start(list(args), env, out.name, err.name)))
                else:
                    procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=err, cwd=ROOT, text=True,
                                                  preexec_fn=die_with_parent))
            while None in (codes := [p.poll() for p in procs]):
                now = time.monotonic()
                if failed is None and any(c not in (None, 0) for c in codes):
                    failed = next(c for c in codes if c not in (None, 0))
                    ending = now + 2.0  # the others' own messages first
                if ending is not None and now > ending:  # SIGTERM, then SIGKILL to what is still running
                    for p in procs:
                        if p.poll() is None:
                            p.send_signal(signal.SIGKILL if ended else signal.SIGTERM)
                    ended, ending = ended + 1, now + 30
                if now > deadline:
                    timed_out = True
                    break
                time.sleep(0.01)
        finally:
            kill_running(procs)
        code = failed if failed is not None else next((p.returncode for p in procs if p.returncode), 0)
        out.seek(0)
        err.seek(0)
        proc = subprocess.CompletedProcess(cmd, 1 if code or timed_out else 0, out.read(), err.read())
    if timed_out:
        raise AssertionError(f"torchrun ran past {timeout} s:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({code}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def train(config: str, save_dir: Path, nproc: int, launcher: str | None = None, **overrides) -> list[dict]:
    """Train with the bundled trainer; returns the metrics.jsonl records written by this run. `launcher`: a script
    that runs the trainer's command line in its own way (tests/trainer_newest.py: on megatron-core 0.19)."""
    cache = save_dir.parent.parent / "data-cache"  # one tokenized corpus per test session (keyed by content)
    sets = [f"save_dir={save_dir}", f"data_cache_dir={cache}", "log_interval=1"]
    sets += [f"{k}={json.dumps(v) if isinstance(v, (list, bool)) else v}" for k, v in overrides.items()]
    metrics = save_dir / "metrics.jsonl"
    before = len(metrics.read_text().splitlines()) if metrics.exists() else 0
    args = [launcher] if launcher else ["-m", "trainer"]
    args += ["--config", str(CONFIGS / config)]
    for s in sets:
        args += ["--set", s]
    torchrun(nproc, args)
    return [json.loads(line) for line in metrics.read_text().splitlines()[before:]]


def assert_same_curve(a: list[dict], b: list[dict], rel: float) -> None:
    assert [m["iteration"] for m in a] == [m["iteration"] for m in b]
    for x, y in zip(a, b):
        for field in ("loss", "grad_norm"):
            assert abs(x[field] - y[field]) <= rel * abs(x[field]), (field, x, y)


def assert_same_files(a, b, kind: str, tp: int, pp: int, atol: float) -> None:
    for t in range(tp):
        for p in range(pp):
            name = fmt.model_file(Rank(t, p)) if kind == "model" else fmt.optimizer_file(Rank(t, p))
            x, y = io.load_file(a / name)[kind], io.load_file(b / name)[kind]
            assert set(x) == set(y), name
            for key in x:
                fields = x[key].items() if isinstance(x[key], dict) else [("", x[key])]
                for field, tensor in fields:
                    other = y[key][field] if field else y[key]
                    if torch.is_tensor(tensor):
                        assert tensor.shape == other.shape and tensor.dtype == other.dtype, (name, key, field)
                        assert torch.allclose(tensor.double(), other.double(), rtol=0, atol=atol), (name, key, field)


def sharded_logits(ckpt: Path, tokens: torch.Tensor, tmp: Path, tp: int, pp: int) -> torch.Tensor:
    """Logits of a checkpoint run at TP x PP by the trainer's own model (trainer.forward)."""
    tok = tmp / "tokens.pt"
    torch.save(tokens, tok)
    out = tmp / f"logits_tp{tp}pp{pp}.pt"
    torchrun(tp * pp, ["-m", "trainer.forward", str(ckpt), "--tokens", str(tok), "--out", str(out),
                       "--tp", str(tp), "--pp", str(pp)])
    return torch.load(out)


@pytest.fixture(scope="session")
def llama_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    """tiny llama, TP2 x PP2 x DP1, 8 iterations, checkpoints at 4 and 8."""
    save = tmp_path_factory.mktemp("llama") / "run"
    return save, train("tiny_llama.yaml", save, 4, train_iters=8, save_interval=4)


@pytest.fixture(scope="session")
def gpt2_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    """tiny gpt2 (tied embeddings), TP2 x PP2 x DP1, 6 iterations."""
    save = tmp_path_factory.mktemp("gpt2") / "run"
    return save, train("tiny_gpt2.yaml", save, 4, train_iters=6)


@pytest.fixture(scope="session")
def bases(tmp_path_factory):
    """The good checkpoints (and their merges) that bad-input tests damage copies of (bad_inputs.Bases)."""
    from bad_inputs import make_bases
    return make_bases(tmp_path_factory.mktemp("bad-input-bases"))


def same_objects(a, b, where: str) -> None:
    """Two loaded torch.save objects equal: the same keys in the same order, tensors bit-exact in dtype and shape."""
    if torch.is_tensor(b):
        assert torch.is_tensor(a) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)), where
    elif isinstance(b, dict):
        assert isinstance(a, dict) and list(a) == list(b), where
        for k in b:
            same_objects(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, where
