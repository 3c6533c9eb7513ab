"""benchmarks/trace_summary.py's gap and kernel tables, on chrome traces made here with known kernels and gaps."""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import trace_summary  # noqa: E402


def _trace(path: Path, kernels: list[tuple[str, float, float]]) -> Path:
    """A chrome trace of kernels (name, start us, duration us), with a CPU event that is no kernel; gzipped when the
    name ends in .gz."""
    events = [{"cat": "kernel", "name": n, "ts": t, "dur": d} for n, t, d in kernels]
    events.append({"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 10_000})
    data = json.dumps({"traceEvents": events}).encode()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)
    return path


def test_gaps_are_summed_by_the_kernels_around_them(tmp_path):
    # gemm 0-100, gap 20 us, norm 120-150, gap 2000 us (an NCCL kernel inside it is not compute), gemm 2150-2250 with
    # a copy inside it (the gap after is the gemm's), gap 8 us, norm 2258-2265, gap 3 us (under the 5 us floor), norm
    path = _trace(tmp_path / "r0.json", [
        ("gemm<float>", 0, 100), ("rms_norm(x)", 120, 30), ("ncclDevKernel_SendRecv", 300, 1500),
        ("gemm<float>", 2150, 100), ("copy", 2160, 10), ("rms_norm(x)", 2258, 7), ("rms_norm(x)", 2268, 2)])
    text = trace_summary.gaps(path)
    assert "5-50 us 0.03 ms, 50-150 us 0.00 ms, 0.15-1 ms 0.00 ms, >1 ms 2.00 ms" in text, text
    lines = text.splitlines()[1:]
    assert len(lines) == 2, text
    assert "2.00 ms in     1 gaps  after rms_norm  before gemm" in lines[0], text
    assert "0.03 ms in     2 gaps  after gemm  before rms_norm" in lines[1], text  # 20 us and 8 us, not after copy


def test_kernel_names_lose_arguments_templates_and_anonymous_namespaces():
    assert trace_summary.short("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float>"
                               "(float*, float const*, int)") == "at::native::cunn_SoftMaxForward"
    assert trace_summary.short("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
                               "std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)"
                               ) == "at::native::vectorized_elementwise_kernel"
    assert trace_summary.short("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == \
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT"
    assert trace_summary.short("void at::native::(anonymous namespace)::a<1>(int)") != \
        trace_summary.short("void at::native::(anonymous namespace)::b<1>(int)")


def test_kernel_table_has_one_column_per_trace_in_ms_a_step(tmp_path):
    a = _trace(tmp_path / "a.json", [("gemm<half>", 0, 4000), ("gemm<float>", 5000, 2000), ("softmax", 8000, 1000)])
    b = _trace(tmp_path / "b.json.gz", [("gemm<half>", 0, 1000), ("ncclKernel", 2000, 6000)])
    lines = trace_summary.kernel_table([a, b]).splitlines()
    assert [c.strip() for c in lines[0].split(": ")[1].split(" | ")] == ["a.json", "b.json.gz"]
    rows = {line.split("  ")[-1].strip(): [float(x) for x in line.rsplit("  ", 1)[0].split(" | ")] for line in lines[1:]}
    # the traces hold 2 steps: ms a step is half the summed microseconds / 1000; template arguments dropped
    assert rows["gemm"] == [3.0, 0.5]
    assert rows["ncclKernel"] == [0.0, 3.0]
    assert rows["softmax"] == [0.5, 0.0]
    assert rows["(all kernels)"] == [3.5, 3.5]
    assert rows["(all but NCCL)"] == [3.5, 0.5]
    assert [line.split("  ")[-1].strip() for line in lines[1:3]] == ["gemm", "ncclKernel"]  # largest first; ties by name
    assert trace_summary.kernel_table([]) == "no traces"
