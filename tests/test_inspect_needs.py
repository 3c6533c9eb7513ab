"""`ckpt inspect`'s "needs" line against what merge and reshard really do: the bytes merge writes are exact
(the tensor data of the merged safetensors files), and every measured peak RSS stays under its estimate."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_tools.forms.shards import open_checkpoint
from ckpt_tools.verbs.inspect import needs

TIME = Path("/usr/bin/time")


def tensor_bytes(hf_dir: Path) -> int:
    """Bytes of tensor data in a merged HF dir's safetensors files (each file less its header)."""
    total = 0
    for f in sorted(hf_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        total += sum(end - begin for begin, end in (t["data_offsets"] for t in header.values()))
        assert f.stat().st_size == 8 + n + max(end for _, end in (t["data_offsets"] for t in header.values()))
    return total


def peak_rss(args: list[str], tmp: Path, **env: str) -> int:
    """Bytes: the command's own maximum resident set (GNU time, which forks the command itself)."""
    out = tmp / "rss"
    proc = subprocess.run([str(TIME), "-f", "%M", "-o", str(out), sys.executable, "-m", "ckpt_tools.cli", *args],
                          capture_output=True, text=True, env={**os.environ, **env}, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return int(out.read_text().split()[-1]) * 1024


@pytest.mark.skipif(not TIME.is_file(), reason="needs GNU time (/usr/bin/time)")
@pytest.mark.parametrize("run", ["llama_run", "gpt2_run"])
def test_needs_is_exact_for_bytes_and_an_upper_bound_for_ram(request, run, tmp_path):
    save = request.getfixturevalue(run)[0]
    estimate = needs(open_checkpoint(save).meta)
    hf = tmp_path / "hf"
    measured = {"merge_ram": peak_rss(["merge", str(save), str(hf), "-q"], tmp_path)}
    assert tensor_bytes(hf) == estimate["merge_bytes"]
    shutil.rmtree(hf)
    measured["merge_ram_torch"] = peak_rss(["merge", str(save), str(hf), "-q"], tmp_path, CKPT_MERGE_TORCH="1")
    assert tensor_bytes(hf) == estimate["merge_bytes"]
    measured["reshard_ram"] = peak_rss(["reshard", str(save), str(tmp_path / "re"), "--tp", "1", "--pp", "1", "-q"],
                                       tmp_path)
    print(f"\n{run}: measured peak RSS vs estimate (MiB): "
          + ", ".join(f"{k} {measured[k] / 2**20:.0f} <= {estimate[k] / 2**20:.0f}" for k in measured))
    for key, got in measured.items():
        assert got <= estimate[key], (key, got, estimate[key])
    # the torch-free merge is really torch-free: far below the merge through torch (the reshard is torch-free too)
    assert measured["merge_ram"] < measured["merge_ram_torch"] / 3
