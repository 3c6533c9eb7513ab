"""Whether the outputs of two runs of scripts/output_digests.py hold the same contents where their digests differ:

    python scripts/output_contents.py OLD_WORKDIR NEW_WORKDIR NAME [NAME ...]

Each torch file is loaded (torch.load) and compared object by object, tensors bit for bit; a torch.distributed
checkpoint dir (torch_dist, fsdp_dtensor) is read whole by torch's own DCP reader (tests/mcore_resume.full_tensors),
whatever its .distcp files; safetensors are loaded; meta.json is compared without its files' hashes, its checksum and
the toolkit's version; anything else byte for byte. One line per output: "same contents" or what differs first.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]


def same(a, b, where: str) -> None:
    if torch.is_tensor(b):
        assert torch.is_tensor(a) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)), where
    elif isinstance(b, dict):
        assert isinstance(a, dict) and sorted(map(str, a)) == sorted(map(str, b)), where
        for k in b:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(b, (list, tuple)):
        assert isinstance(a, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    elif hasattr(b, "getvalue"):  # a BytesIO entry
        assert a.getvalue() == b.getvalue(), where
    elif hasattr(b, "__dict__") and not isinstance(b, type):  # an argparse.Namespace
        same(vars(a), vars(b), where)
    else:
        assert a == b, (where, a, b)


def _meta(path: Path) -> dict:
    meta = json.loads(path.read_text())
    meta.pop("checksum", None)
    meta["files"] = sorted(meta.get("files", {}))
    meta.get("versions", {}).pop("ckpt-tools", None)
    return meta


def compare(x: Path, y: Path, scratch: Path) -> int:
    """The entries compared; AssertionError at the first difference."""
    if y.is_file():
        files, x, y = [Path(y.name)], x.parent, y.parent
    else:
        files = sorted(p.relative_to(y) for p in y.rglob("*") if p.is_file())
        other = sorted(p.relative_to(x) for p in x.rglob("*") if p.is_file())
        strip = lambda fs: [f for f in fs if f.suffix != ".distcp"]  # noqa: E731 (a DCP dir's files: its writer's)
        assert strip(files) == strip(other), ("the files differ", strip(files), strip(other))
    dcp, n = {f.parent for f in files if f.name == ".metadata"}, 0
    for d in dcp:
        from mcore_resume import full_tensors
        a, b = full_tensors(x / d, scratch / "a.pt"), full_tensors(y / d, scratch / "b.pt")
        same(a, b, str(d))
        n += len(b)
    for f in files:
        a, b = x / f, y / f
        if f.parent in dcp and f.name != "common.pt":
            continue
        if f.suffix in (".bin", ".pt"):
            same(torch.load(a, weights_only=False), torch.load(b, weights_only=False), str(f))
        elif f.suffix == ".safetensors":
            from safetensors.torch import load_file
            same(load_file(a), load_file(b), str(f))
        elif f.name == "meta.json":
            same(_meta(a), _meta(b), str(f))
        else:
            assert a.read_bytes() == b.read_bytes(), str(f)
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", type=Path)
    ap.add_argument("new", type=Path)
    ap.add_argument("names", nargs="+")
    a = ap.parse_args()
    failed = False
    with tempfile.TemporaryDirectory() as scratch:
        for name in a.names:
            x, y = a.old / name, a.new / name
            try:
                print(f"{name:<28} same contents ({compare(x, y, Path(scratch))} entries)")
            except AssertionError as e:
                failed = True
                print(f"{name:<28} DIFFERS: {str(e)[:300]}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
