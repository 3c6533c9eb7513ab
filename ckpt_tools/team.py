"""Several processes writing one output: `ckpt merge / reshard / import --nproc-per-node N [--nnodes M ...]`.

The verb runs in N x M processes. On one node the launcher starts them itself and they meet through it (`_Link`: process
0 listens on a local port, the others connect, authenticated by a key only the launcher's processes are given), with
no torch imported for it: a team starts about as fast as one process. Across nodes they run under torchrun (`python
-m ckpt_tools.team` is torchrun without its traceback) and meet through torch.distributed (gloo).
Every process plans the whole output from the layout table, as one process does, and writes the output files
`split` gives it: contiguous runs of the output's files, in the order one process writes them, balanced by their
bytes (each source byte is read by the process writing the file it goes to, so in total about once). The files of
the other processes are only counted (their sizes and offsets, for an index such as torch_dist's `.metadata`).
Process 0 writes what covers every file (meta.json with each file's hash, the index, config and tokenizer files)
after `share` has collected what each process wrote, and renames the staged output (output.staged) when every
process has said it succeeded: the output appears whole or not at all, as with one process.

The rendezvous serves these few small collectives only; the data goes through the filesystem, which must be the same
for every process (one machine, or a shared filesystem). A killed process ends the others (the launcher, or
torchrun) and leaves the staged `.OUT.tmp-*` dir, never a complete-looking OUT; a rerun writes it afresh.
"""
from __future__ import annotations

import datetime
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from ckpt_tools.errors import CkptError

ENV = "CKPT_TEAM"  # set to 1 by the launcher: the verb is one process of a team
ADDR, KEY = "CKPT_TEAM_ADDR", "CKPT_TEAM_KEY"  # one node: process 0's address, and the team's key (hex)
TIMEOUT = datetime.timedelta(days=1)  # across nodes, a process waits this long for the slowest one's files (gloo)
CONNECT = 120.0  # seconds a process tries to reach process 0 (which may still be starting)
GRACE = 1.0  # seconds the launcher gives the others to stop by themselves after a process fails
T = TypeVar("T")


class _Link:
    """The collectives of a team the launcher started on one node: process 0 listens at ADDR and every other process
    connects to it (multiprocessing.connection, authenticated by KEY: only the launcher's processes know it, so what
    they exchange comes from the team itself). A value goes to process 0, which sends each process what it must
    learn. A lost peer is a RuntimeError, as torch.distributed's collectives raise it; a peer alive but stuck is
    waited for (the launcher ends the team when a process fails)."""

    def __init__(self, rank: int, size: int, address: tuple[str, int], key: bytes):
        from multiprocessing.connection import AuthenticationError, Client, Listener
        self.rank, self.size = rank, size
        if rank == 0:
            try:
                listener = Listener(address, authkey=key)
            except OSError as e:
                raise CkptError(f"process 0 of {size}: cannot listen at {address[0]}:{address[1]} ({e}): pass a free "
                                f"port with --master-port") from None
            with listener:
                peers: dict[int, object] = {}
                while len(peers) < size - 1:
                    try:
                        conn = listener.accept()
                        peers[conn.recv()] = conn
                    except (AuthenticationError, EOFError, OSError):  # not one of the team's processes
                        continue
            self.peers = [peers[r] for r in range(1, size)]
            return
        deadline = time.monotonic() + CONNECT
        while True:
            try:
                self.lead = Client(address, authkey=key)
                break
            except OSError as e:  # process 0 is not listening yet
                if time.monotonic() > deadline:
                    raise CkptError(f"process {rank} of {size}: process 0 did not answer at {address[0]}:{address[1]} "
                                    f"within {CONNECT:.0f}s ({e})") from None
                time.sleep(0.01)
        self.lead.send(rank)

    def all_gather(self, value) -> list:
        """Every process's value, by rank, in every process."""
        try:
            if self.rank:
                self.lead.send(value)
                return self.lead.recv()
            values = [value] + [conn.recv() for conn in self.peers]
            for conn in self.peers:
                conn.send(values)
            return values
        except (EOFError, OSError) as e:
            raise RuntimeError(f"{type(e).__name__}: {e}") from None

    def gather(self, value) -> list | None:
        """Every process's value, by rank, in process 0 (None elsewhere)."""
        try:
            if self.rank:
                self.lead.send(value)
                return None
            return [value] + [conn.recv() for conn in self.peers]
        except (EOFError, OSError) as e:
            raise RuntimeError(f"{type(e).__name__}: {e}") from None


_LINK: _Link | None = None  # this process's link to its team (one node)


class PeerFailed(CkptError):
    """Another process of the team failed (it printed why); this one stops without writing more."""


class Alone(CkptError):
    """A failure of process 0 after the team's shared work, when the others have ended: said as by one process."""
    announced = True


@dataclass(frozen=True)
class Team:
    rank: int = 0
    size: int = 1

    @classmethod
    def from_env(cls) -> Team:
        """This process's place in a team started by the launcher; one process alone otherwise."""
        global _LINK
        if os.environ.get(ENV) != "1" or int(os.environ.get("WORLD_SIZE", "1")) == 1:
            return SOLO
        if os.environ.get(ADDR):  # started by the launcher on one node
            if _LINK is None:
                host, port = os.environ[ADDR].rsplit(":", 1)
                _LINK = _Link(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), (host, int(port)),
                              bytes.fromhex(os.environ[KEY]))
            return cls(_LINK.rank, _LINK.size)
        import torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=TIMEOUT)
        return cls(dist.get_rank(), dist.get_world_size())

    @property
    def lead(self) -> bool:
        """Process 0: it writes what covers every file, and prints the summary."""
        return self.rank == 0

    def split(self, sizes: Sequence[int]) -> list[int]:
        """The process writing each unit (an output file) of sizes in bytes, in order: contiguous runs whose
        largest total is the smallest possible (the same answer in every process)."""
        return split(sizes, self.size)

    def share(self, fn: Callable[[], T], to_lead: bool = False) -> list[T]:
        """Run fn here, then learn every process's value (a list by rank; with `to_lead`, process 0 alone gets the
        values, the others a list of None: for large values only process 0 uses). If fn failed anywhere, every
        process raises: the one that failed its own error, the others PeerFailed. Every process must call it, in
        the same order: it is where they wait for each other."""
        try:
            value, error = fn(), None
        except BaseException as e:  # noqa: BLE001 (re-raised below, after the others have heard of it)
            value, error = None, e
        if self.size == 1:
            if error is not None:
                raise error
            return [value]
        mine = (error is None, None if error is not None else None if to_lead else value,
                None if error is None else _words(error))
        try:
            results = _all_gather(mine, self.size)
            failed = [(r, words) for r, (ok, _, words) in enumerate(results) if not ok]
            values = [v for _, v, _ in results]
            if to_lead and not failed:
                values = _gather(value, self.size) or [None] * self.size
        except RuntimeError as e:  # a process is gone (killed): torchrun ends the team and names it
            lost = PeerFailed(f"lost contact with another process: {e}")
            lost.announced = True
            raise (error or lost) from None
        if error is not None:
            error.announced, error.failures = True, failed
            raise error
        if failed:
            peer = PeerFailed(f"process {failed[0][0]} of {self.size} failed: {failed[0][1]}")
            peer.announced = True
            raise peer
        return values

    def all(self, flag: bool) -> bool:
        """Whether flag holds in every process: a choice they must make alike (which path writes the output)."""
        return all(self.share(lambda: flag))

    def settle(self) -> None:
        """After a failure every process knows of: wait for the others here (a lost process ends the wait)."""
        if self.size > 1:
            try:
                self.share(lambda: None)
            except BaseException:  # noqa: BLE001 (only a wait: its failures are those already being raised)
                pass

    def announce(self, error: BaseException) -> None:
        """Tell the others of a failure they have not heard of yet (at the team's next `share`, where they wait)."""
        if self.size > 1 and not getattr(error, "announced", False):
            try:
                self.share(lambda: _raise(error))
            except BaseException:  # noqa: BLE001 (it is error itself, now announced)
                pass

    def first(self, fn: Callable[[], T]) -> T:
        """fn's value in process 0, known to every process (fn runs in process 0 only)."""
        return self.share(lambda: fn() if self.lead else None)[0]


SOLO = Team()


def _all_gather(value, size: int) -> list:
    if _LINK is not None:
        return _LINK.all_gather(value)
    import torch.distributed as dist
    results: list = [None] * size
    dist.all_gather_object(results, value)
    return results


def _gather(value, size: int) -> list | None:
    if _LINK is not None:
        return _LINK.gather(value)
    import torch.distributed as dist
    lead = dist.get_rank() == 0
    values: list | None = [None] * size if lead else None
    dist.gather_object(value, values, dst=0)
    return values


def said_by(error: BaseException, team: Team) -> tuple[str, str] | None:
    """(where, words) of this process's failure: None where another process says it (PeerFailed: the one that
    failed; the same words: the lowest-ranked process failing with them); `where` names the process where the words
    are its own, and is empty where every process failed alike (an input all of them refuse)."""
    if isinstance(error, PeerFailed):
        return None
    words = _words(error)
    if isinstance(error, Alone):
        return "", words
    failures = getattr(error, "failures", None) or [(team.rank, words)]
    if any(r < team.rank and w == words for r, w in failures):
        return None
    alike = len(failures) == team.size and all(w == words for _, w in failures)
    return ("" if alike or team.size == 1 else f" (process {team.rank} of {team.size})"), words


def _raise(error: BaseException) -> None:
    raise error


def _words(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if not isinstance(error, CkptError) else str(error)


def split(sizes: Sequence[int], parts: int) -> list[int]:
    """Owners (0..parts-1) of consecutive units: the contiguous split minimising the largest part's bytes, found by
    bisecting that largest total (each unit weighs at least 1, so empty files are spread too)."""
    weights = [max(int(s), 1) for s in sizes]
    if parts <= 1 or not weights:
        return [0] * len(weights)

    def owners(cap: int) -> list[int] | None:
        out, part, used = [], 0, 0
        for w in weights:
            if used + w > cap and used:
                part, used = part + 1, 0
            if part >= parts:
                return None
            out.append(part)
            used += w
        return out
    lo, hi = max(weights), sum(weights)
    while lo < hi:
        mid = (lo + hi) // 2
        if owners(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    return owners(lo)


# ---------------------------------------------------------------- the launcher
OPTIONS = ("--nproc-per-node", "--nnodes", "--node-rank", "--master-addr", "--master-port")


def run_worker(main: Callable[[], object]) -> None:
    """Run the `ckpt` command in one process of a team, and end the process at once when it returns: its rendezvous
    (across nodes gloo's threads) is never torn down (a teardown racing the other processes' exits can abort the
    process after its work is done and its files are synced)."""
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 (a bug: its traceback, then the same quick end)
        import traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def worker_argv(argv: Sequence[str]) -> list[str]:
    """The command line without the launcher's options (`--opt V` or `--opt=V`): what each process runs."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in OPTIONS:
            skip = True
        elif not arg.startswith(tuple(f"{o}=" for o in OPTIONS)):
            out.append(arg)
    return out


def launch(argv: Sequence[str], nproc: int, nnodes: int, node_rank: int, master_addr: str | None,
           master_port: int | None) -> int:
    """Run `ckpt ARGV` (the launcher's options taken out) as nproc processes on this node of nnodes; the exit code.
    One node: started here (`spawn`); several: under torchrun, which every node runs."""
    import subprocess

    from ckpt_tools.ports import free_port
    import importlib.util
    if nnodes == 1 and nproc >= 1 and node_rank == 0:
        return spawn(argv, nproc, master_port or free_port())
    if nproc < 1 or nnodes < 1 or not 0 <= node_rank < nnodes:
        raise CkptError(f"--nproc-per-node {nproc} --nnodes {nnodes} --node-rank {node_rank}: give at least one "
                        f"process and one node, and a node rank below --nnodes")
    if nnodes > 1 and (master_port is None or master_addr is None):
        raise CkptError("--nnodes > 1 needs --master-addr and --master-port: the address and a free port of node 0, "
                        "the same on every node")
    if importlib.util.find_spec("torch") is None:
        raise CkptError("--nproc-per-node / --nnodes start the processes with torchrun, which comes with torch: "
                        "pip install torch (its CPU build is enough), or run in one process")
    cmd = [sys.executable, "-m", "ckpt_tools.team", f"--nnodes={nnodes}", f"--node-rank={node_rank}",
           f"--nproc-per-node={nproc}", f"--master-addr={master_addr or '127.0.0.1'}",
           f"--master-port={master_port or free_port()}", "-m", "ckpt_tools.cli", *worker_argv(argv)]
    return subprocess.call(cmd, env={**os.environ, ENV: "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
                                     "LOGLEVEL": "ERROR"})


def spawn(argv: Sequence[str], nproc: int, port: int) -> int:
    """Run `ckpt ARGV` as nproc processes of one team on this node, meeting at 127.0.0.1:port (`_Link`); the exit
    code. When a process fails the others are given GRACE seconds to stop by themselves (the one that failed says
    why, the others hear of it at their next meeting point), then ended (SIGTERM), as torchrun ends them. A process
    that exited with code 1 said why itself; one killed or crashed is named here. A SIGTERM, SIGHUP or SIGINT to
    the launcher goes to every process, and a process whose launcher is gone is ended by the kernel (Linux)."""
    import secrets
    import signal
    import subprocess
    env = {**os.environ, ENV: "1", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "WORLD_SIZE": str(nproc),
           "LOCAL_WORLD_SIZE": str(nproc), ADDR: f"127.0.0.1:{port}", KEY: secrets.token_hex(16)}
    cmd = [sys.executable, "-m", "ckpt_tools.cli", *worker_argv(argv)]
    procs: list = []
    received: list[int] = []

    def forward(signum, frame) -> None:  # the team goes with the launcher
        received.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)
    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    try:
        procs += [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, preexec_fn=die_with_parent)
                  for r in range(nproc)]
        failed: list[tuple[int, int]] = []  # (rank, exit code) of those that ended with an error on their own
        ended: set[int] = set()  # the ranks this launcher ended
        since = None  # when the first failure was seen
        while any(p.returncode is None for p in procs):
            for rank, p in enumerate(procs):
                if p.returncode is None and p.poll() is not None and p.returncode != 0:
                    failed.append((rank, p.returncode))
                    since = since or time.monotonic()
            if since is not None and time.monotonic() - since > GRACE:
                for rank, p in enumerate(procs):
                    if p.poll() is None and rank not in ended:
                        ended.add(rank)
                        p.send_signal(signal.SIGTERM)
            time.sleep(0.005)
    finally:
        kill_running(procs)
        for s, handler in previous.items():
            signal.signal(s, handler)
    if received:
        return 128 + received[0]
    for rank, code in failed:
        if code != 1 and not (rank in ended and code == -signal.SIGTERM):  # code 1: it printed why
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            print(f"error: process {rank} {how}: the output was not written", file=sys.stderr, flush=True)
    return 1 if failed else 0


def kill_running(procs: list) -> None:
    """SIGKILL every process of `procs` (subprocess.Popen, or what has its poll, kill and wait) still running, and
    wait for it: what a launcher leaves of its ranks when it ends."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def die_with_parent() -> None:
    """In a process of the team, before it runs: the kernel ends it (SIGKILL) if its launcher dies (Linux)."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):  # not Linux: the launcher's handlers are all there is
        pass


def torchrun(argv: list[str], quiet_errors: bool = False) -> int:
    """torchrun, except that a failed rank ends it with exit code 1 and no traceback of torchrun's own: the
    ranks have printed their one-line error messages, which say what went wrong. `quiet_errors`: say nothing of
    a rank that exited with code 1 (it printed why); a rank killed or crashed is named."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main
    if quiet_errors:
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        main(argv)
    except ChildFailedError as e:
        failures = sorted(e.failures.items())
        if quiet_errors:  # a process that exited with 1 printed why (or stopped as another failed), and torchrun
            printed = any(f.exitcode == 1 for _, f in failures)  # ends the others with SIGTERM: not news, unless
            failures = [(r, f) for r, f in failures if f.exitcode != 1]  # nothing else explains the end
            rest = [(r, f) for r, f in failures if f.exitcode != -15]
            failures = rest if rest or printed else failures
        for rank, failure in failures:
            how = f"was killed by signal {-failure.exitcode}" if failure.exitcode < 0 else \
                f"exited with code {failure.exitcode}"
            print(f"{'error: process' if quiet_errors else 'torchrun: rank'} {rank} {how}"
                  f"{': the output was not written' if quiet_errors else ''}", file=sys.stderr, flush=True)
            if not quiet_errors:
                break
        return 1
    return 0


if __name__ == "__main__":  # `python -m ckpt_tools.team ARGS` = `torchrun ARGS` for the ckpt verbs
    sys.exit(torchrun(sys.argv[1:], quiet_errors=True))
