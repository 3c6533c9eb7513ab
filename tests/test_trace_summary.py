"""benchmarks/trace_summary.py's gap and kernel tables, on a chrome trace made here with known kernels and gaps."""
from __future__ import annotations

import json
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import trace_summary  # noqa: E402


def _trace(path, kernels):
    """A chrome trace of kernels (name, start us, duration us), with a CPU event that is no kernel."""
    events = [{"cat": "kernel", "name": n, "ts": t, "dur": d} for n, t, d in kernels]
    events.append({"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 10_000})
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_gaps_are_summed_by_the_kernels_around_them(tmp_path):
    # gemm 0-100, gap 20 us, norm 120-150, gap 2000 us (an NCCL kernel inside it is not compute), gemm 2150-2250,
    # a kernel inside the gemm (overlapping: no gap), gap 3 us (under the 5 us floor), norm 2253-2260
    path = _trace(tmp_path / "r0.json", [
        ("gemm<float>", 0, 100), ("rms_norm(x)", 120, 30), ("ncclDevKernel_SendRecv", 300, 1500),
        ("gemm<float>", 2150, 100), ("copy", 2160, 10), ("rms_norm(x)", 2253, 7)])
    text = trace_summary.gaps(path)
    assert "5-50 us 0.0 ms, 50-150 us 0.0 ms, 0.15-1 ms 0.0 ms, >1 ms 2.0 ms" in text, text
    lines = text.splitlines()[1:]
    assert len(lines) == 2, text
    assert "2.00 ms in     1 gaps  after rms_norm  before gemm" in lines[0], text
    assert "0.02 ms in     1 gaps  after gemm  before rms_norm" in lines[1], text


def test_kernel_table_has_one_column_per_trace_in_ms_a_step(tmp_path):
    a = _trace(tmp_path / "a.json", [("gemm<half>", 0, 4000), ("gemm<float>", 5000, 2000), ("softmax", 8000, 1000)])
    b = _trace(tmp_path / "b.json", [("gemm<half>", 0, 1000), ("ncclKernel", 2000, 4000)])
    lines = trace_summary.kernel_table([a, b]).splitlines()
    assert lines[0].split(": ")[1].split(" | ") == ["a", "b"]
    rows = {line.split("  ")[-1].strip(): [float(x) for x in line.split("  ")[0].split(" | ")] for line in lines[1:]}
    # the traces hold 2 steps: ms a step is half the summed microseconds / 1000; template arguments dropped
    assert rows["gemm"] == [3.0, 0.5]
    assert rows["ncclKernel"] == [0.0, 2.0]
    assert rows["softmax"] == [0.5, 0.0]
    assert rows["(all kernels)"] == [3.5, 2.5]
    assert lines[1].endswith("gemm")  # largest first
