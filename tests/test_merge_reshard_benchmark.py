"""Smoke run of benchmarks/merge_reshard.py --quick (no timing checks): every command runs (the script
exits non-zero when one fails) and stays inside the memory target; merge's torch-free path does not
load torch."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow


def test_quick_run_prints_the_table(tmp_path):
    table = tmp_path / "t.md"
    proc = subprocess.run([sys.executable, "benchmarks/merge_reshard.py", "--quick", "--markdown", str(table)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows: dict[tuple[str, str], list[str]] = {}
    for line in table.read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and cells[0].isdigit():
            rows[cells[0], cells[1]] = cells
    depths = sorted({int(layers) for layers, _ in rows})
    assert len(depths) == 2 and depths[1] == 2 * depths[0], rows.keys()
    for layers in map(str, depths):
        ops = {op: cells for (n, op), cells in rows.items() if n == layers}
        assert len(ops) == 9, ops.keys()
        for op in ("ckpt merge --format hf", "ckpt merge, torch path", "ckpt reshard --tp 4 --pp 1",
                   "ckpt reshard --tp 1 --pp 1 --format torch_dist", "the same, torch path (copy_bytes=False)"):
            assert ops[op][-1] == "yes", ops[op]  # peak RSS <= 2 x largest tensor + 512 MiB
            assert float(ops[op][4]) > 0, ops[op]  # a wall / cp ratio was measured
        # the torch-free merge stays far below a process that has imported torch
        with_torch = float(ops["python startup (imports only)"][5].replace(",", ""))
        for op in ("ckpt merge --format hf", "ckpt reshard --tp 1 --pp 1 --format torch_dist"):
            torch_free = float(ops[op][5].replace(",", ""))
            assert torch_free < with_torch / 3, (op, torch_free, with_torch)
