"""The tests' rank starter (conftest.torchrun): a process that has imported what every rank imports, and forks ranks
from itself, so a rank starts in milliseconds instead of importing torch anew (~3 s of CPU on the test VM, for
hundreds of ranks a suite). conftest starts one per rank index (each Python process its own hash seed, as ranks
started anew have) and environment (the run's, less the launch's own variables: what torch reads at import is read
here), keeping those of the last few environments.

What it imports is what does not depend on the version of megatron-core a rank picks (tests/mcore_newest.py puts
0.19.2 first on sys.path): torch and the parts of it megatron-core's import pulls in (DTensor, dynamo, inductor's
lowerings, export), torch.distributed.checkpoint, and transformers. megatron-core itself is imported by each rank.

Protocol, one line each way on stdin and on the descriptor that was stdout (fd 1 is then the zygote's stderr): a JSON
request per rank, {"argv", "env", "cwd", "out", "err"} (argv as after `python -u`: a script and its arguments, or
`-m module ...`), answered `started <pid>` once the rank is forked and `exited <pid> <code>` when it has ended (its
exit code as subprocess gives it: negative for a signal). The rank runs as `python -u` runs it: its environment,
working directory, sys.argv, sys.path[0] and absolute __file__, stdout and stderr appended unbuffered to the files
named, torch's RNG seeded anew (the RNGs of `random` and numpy too), and at the end its threads joined and atexit
handlers run (`_exit`: not its modules' teardown). It dies with this process, and this process with the test process.
"""
from __future__ import annotations

import importlib
import io
import json
import os
import runpy
import sys
import threading
import time
import traceback

import torch
import torch._dynamo  # noqa: F401
import torch._higher_order_ops.triton_kernel_wrap  # noqa: F401
import torch._inductor.decomposition  # noqa: F401
import torch._inductor.lowering  # noqa: F401
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.tensor  # noqa: F401
import torch.export  # noqa: F401

try:
    importlib.import_module("transformers")
except ImportError:
    pass

REPLY = os.dup(1)  # the answers; fd 1 becomes stderr, so that nothing printed here reaches the protocol
os.dup2(2, 1)
_lock = threading.Lock()


def _say(line: str) -> None:
    with _lock:
        os.write(REPLY, (line + "\n").encode())


def _reap() -> None:
    """Every rank's exit, as it happens."""
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:  # none running
            time.sleep(0.02)
            continue
        _say(f"exited {pid} {os.waitstatus_to_exitcode(status)}")


def _die_with_parent() -> None:
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass


def _become(request: dict) -> None:
    """In the forked child: the rank's process state, as `python -u` would start it."""
    _die_with_parent()
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, request["out"]), (2, request["err"])):
        f = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.dup2(f, fd)
        os.close(f)
    os.close(REPLY)
    sys.stdin = open(os.devnull)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True, line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, line_buffering=True)
    torch.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _run(request: dict) -> int:
    """Run the rank's script or module as __main__; its exit code."""
    argv = request["argv"]
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(os.path.abspath(argv[0]), run_name="__main__")
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def _exit(code: int) -> None:
    """End the rank as the interpreter's exit does, less the teardown of its modules (which costs ~1 s of CPU a process
    with torch and megatron-core imported): its threads joined and its atexit handlers run (CPython's own functions
    for both steps of its exit), its output flushed; never back into the zygote's loop. A file the rank left open is
    not flushed, as in a rank that crashed."""
    import atexit
    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def main() -> None:
    _die_with_parent()
    threading.Thread(target=_reap, daemon=True).start()
    _say("ready")
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                _become(request)
            except BaseException:
                traceback.print_exc()
                os._exit(1)
            _exit(_run(request))
        _say(f"started {pid}")


if __name__ == "__main__":
    main()
