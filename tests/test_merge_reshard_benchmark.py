"""Smoke run of benchmarks/merge_reshard.py --quick (no timing checks): every command runs (the script
exits non-zero when one fails) and stays inside the memory target; merge's torch-free path does not
load torch."""
from __future__ import annotations

import json
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


def test_matrix_quick_run_fills_every_cell(tmp_path):
    """benchmarks/matrix.py --quick: every input x operation cell runs (the script exits non-zero when a command
    fails), each has a ratio to cp of its own output, merge's path does not load torch, and merge stays in its
    memory target."""
    table = tmp_path / "m.md"
    proc = subprocess.run([sys.executable, "benchmarks/matrix.py", "--quick", "--markdown", str(table)],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    text = table.read_text()
    assert "merge's imports load torch: no" in text
    details = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
               if line.startswith("| ") and line.count("|") == 8 and not line.startswith("| operation")]
    cells = {(op, name): row for op, name, *row in details}
    expected = {("merge -> HF", n) for n in ("ours bf16", "ours fp32", "torch_dist", "torch")}
    expected |= {(op, n) for op in ("reshard TP2 -> TP1", "reshard TP2 -> TP4", "reshard TP2 -> TP3",
                                    "reshard PP2 -> PP3 (uneven)") for n in ("ours bf16", "ours fp32", "torch_dist", "torch")}
    expected |= {("export -> torch_dist", n) for n in ("ours bf16", "ours fp32", "torch")}
    expected |= {("export -> torch", n) for n in ("ours bf16", "ours fp32", "torch_dist")}
    expected |= {(f"import -> {t}", "HF") for t in ("ours TP3xPP2", "torch_dist TP2xPP2", "torch TP2xPP2")}
    assert set(cells) == expected, set(cells) ^ expected
    for (op, _), (wall, cp, out_mb, rss, big) in cells.items():
        assert float(wall) > 0 and float(cp) > 0 and float(out_mb.replace(",", "")) > 0, (op, wall, cp, out_mb)
        if op == "merge -> HF":
            assert float(rss.replace(",", "")) <= 2 * float(big.replace(",", "")) + 512, (op, rss, big)


def test_matrix_large_mode_makes_one_input_at_a_time_and_runs_team_cells(tmp_path):
    """benchmarks/matrix.py as the 20 GB run uses it (--inputs-by ckpt --cold --ops --procs), on the tiny model: the
    Megatron-LM inputs made by ckpt from the HF model, each chosen operation run by one process and by a team of two,
    nothing else."""
    table = tmp_path / "m.md"
    proc = subprocess.run([sys.executable, "benchmarks/matrix.py", "--quick", "--inputs-by", "ckpt", "--cold", "--only",
                           "HF,torch_dist,torch", "--ops", "import -> torch_dist,TP2 -> TP3", "--procs", "2",
                           "--markdown", str(table), "--json", str(tmp_path / "m.json")],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    details = [[c.strip() for c in line.strip("|").split("|")] for line in table.read_text().splitlines()
               if line.startswith("| ") and line.count("|") == 8 and not line.startswith("| operation")]
    cells = {(op, name) for op, name, *_ in details}
    ops = {"HF": ["import -> torch_dist TP2xPP2"], "torch_dist": ["reshard TP2 -> TP3"], "torch": ["reshard TP2 -> TP3"]}
    expected = {(o + extra, n) for n, names in ops.items() for o in names for extra in ("", " (2 processes)")}
    assert cells == expected, cells ^ expected
    assert "Megatron-LM forms written by ckpt" in table.read_text()
    runs = json.loads((tmp_path / "m.json").read_text())  # --json: the run's settings, every run's figures
    assert runs["run"]["inputs_by"] == "ckpt" and runs["run"]["cold"] and runs["run"]["repeats"] == 1, runs["run"]
    assert {(r["op"], r["input"]) for r in runs["cells"]} == expected
    assert all(len(r["wall"]) == len(r["cp"]) == len(r["rss"]) == 1 and r["bytes"] > 0 for r in runs["cells"]), runs
