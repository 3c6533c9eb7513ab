"""Rendezvous ports for the processes a verb, the trainer or the tests start (torchrun, a team)."""
from __future__ import annotations

import os
import re

from ckpt_tools.errors import CkptError

PORT_RANGE = "CKPT_PORT_RANGE"  # LO-HI: the range free_port draws from (several jobs on one machine: a range each)


def free_port() -> int:
    """A TCP port free on this machine now, for a torchrun rendezvous: the kernel's choice, or a free one drawn from
    $CKPT_PORT_RANGE (LO-HI) where it is set. Jobs that start processes side by side on one machine (the test suite's
    workers) each take their own range below the kernel's ephemeral ports: a port one job found free is then never
    the one another job's process is given meanwhile."""
    import random
    import socket
    span = os.environ.get(PORT_RANGE)
    if not span:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    m = re.fullmatch(r"(\d+)-(\d+)", span.strip())
    lo, hi = (int(m.group(1)), int(m.group(2))) if m else (0, -1)
    if not 1024 <= lo <= hi <= 65535:
        raise CkptError(f"{PORT_RANGE}={span!r} is not a port range LO-HI within 1024-65535: set it like 20000-23999 or "
                        f"unset it")
    for port in random.sample(range(lo, hi + 1), min(256, hi - lo + 1)):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise CkptError(f"no free port in {PORT_RANGE}={span}: widen the range or unset it")
