"""Smoke run of benchmarks/train_throughput.py on CPU (no timing checks): both rows train."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow


def test_quick_run_prints_a_row_per_model(tmp_path):
    table = tmp_path / "t.md"
    proc = subprocess.run([sys.executable, "benchmarks/train_throughput.py", "--quick", "--rows", "hf ours:compile=0",
                           "--steps", "1", "--warmup", "1", "--markdown", str(table)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [l for l in table.read_text().splitlines() if l.startswith("| HF") or l.startswith("| trainer")]
    assert len(rows) == 2, table.read_text()
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert "failed" not in row and float(cells[3].replace(",", "")) > 0, row
        loss = float(cells[-1])  # two steps of a freshly initialised model: near ln(vocab)
        assert abs(loss - math.log(4096)) < 1.5, row
