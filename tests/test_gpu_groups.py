"""scripts/gpu_groups.sh splits the gpu-marked tests into groups that each fit one command on a GPU machine: every
gpu test is in exactly one group (a new gpu test that no group selects fails here, on any machine)."""
from __future__ import annotations

import collections
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_gpu_test_is_in_exactly_one_group():
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    grouped = subprocess.run(["bash", "scripts/gpu_groups.sh", "--collect"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=300)
    assert grouped.returncode == 0, grouped.stderr[-2000:]
    ids = collections.Counter(line.split(" ", 1)[1] for line in grouped.stdout.splitlines() if "::" in line)
    marked = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests").glob("test_*.py"))
              if "mark.gpu" in p.read_text()]  # the modules that can hold a gpu test (collecting all takes long)
    every = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "gpu", *marked], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=300)
    gpu = {line for line in every.stdout.splitlines() if "::" in line}
    assert gpu, every.stdout[-2000:]
    assert set(ids) == gpu, (sorted(gpu - set(ids)), sorted(set(ids) - gpu))
    assert [i for i, n in ids.items() if n > 1] == []
