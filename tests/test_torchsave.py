"""ckpt_tools.forms.torchsave (torch.save archives and pickles written without torch) against torch's own readers:
torch.load (plain, mmap, weights_only), Python's zipfile, torch.distributed.checkpoint's metadata reader."""
from __future__ import annotations

import argparse
import io
import os
import pickle
import zipfile

import pytest
import torch

from ckpt_tools.forms import torchsave as ts

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.float64]


def write(path, fn, *args) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        return fn(fd, 0, *args)
    finally:
        os.close(fd)


@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d).removeprefix("torch.") for d in DTYPES])
@pytest.mark.parametrize("shape", [(3, 5), (7,), (), (2, 0, 4), (2, 3, 4)], ids=["2d", "1d", "scalar", "empty", "3d"])
def test_a_tensor_loads_as_torch_saved_it(tmp_path, dtype, shape):
    t = (torch.randn(shape) * 100).to(dtype)
    path = tmp_path / "t.pt"
    end = write(path, ts.save_tensor, str(dtype).removeprefix("torch."), shape, t.contiguous().view(-1).view(torch.uint8)
                .numpy().tobytes())
    assert end == path.stat().st_size
    for mmap in (False, True):
        got = torch.load(path, weights_only=True, mmap=mmap)
        assert got.dtype == dtype and got.shape == t.shape and torch.equal(got, t)
    names = zipfile.ZipFile(path).namelist()
    assert names[0] == "archive/data.pkl" and "archive/data/0" in names and "archive/byteorder" in names


def test_bytes_from_file_ranges_and_archives_one_after_another(tmp_path):
    """Record bytes copied from another file's ranges; two archives in one file, each loadable from its own bytes
    (as DCP hands a .distcp's byte range to torch.load); data 64-byte aligned within each archive."""
    src = tmp_path / "src"
    data = torch.arange(40, dtype=torch.float32)
    src.write_bytes(b"x" * 13 + data.numpy().tobytes())
    fd_src = os.open(src, os.O_RDONLY)
    path = tmp_path / "two"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        mid = ts.save_tensor(fd, 0, "float32", (4, 5), [(fd_src, 13, 40), (fd_src, 53, 40)])
        end = ts.save_object(fd, mid, {"a": [1, 2.5, None, "s"], "b": (True, -3, 2**40)})
    finally:
        os.close(fd)
        os.close(fd_src)
    blob = path.read_bytes()
    assert end == len(blob)
    first = torch.load(io.BytesIO(blob[:mid]), weights_only=True)
    assert torch.equal(first, data[:20].view(4, 5))
    assert torch.load(io.BytesIO(blob[mid:]), weights_only=True) == {"a": [1, 2.5, None, "s"], "b": (True, -3, 2**40)}
    info = zipfile.ZipFile(io.BytesIO(blob[:mid])).getinfo("archive/data/0")
    header = blob[info.header_offset:info.header_offset + 30]
    start = info.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")
    assert start % 64 == 0 and blob[start:start + 80] == data[:20].numpy().tobytes()


def test_zip64_records_and_directory(tmp_path, monkeypatch):
    """Sizes and offsets past the zip limit (lowered here) get zip64 fields that torch and zipfile read."""
    monkeypatch.setattr(ts, "ZIP64_LIMIT", 100)
    t = torch.arange(64, dtype=torch.float32).view(8, 8)
    path = tmp_path / "z.pt"
    write(path, ts.save_tensor, "float32", (8, 8), t.numpy().tobytes())
    assert torch.equal(torch.load(path, weights_only=True), t)
    blob = path.read_bytes()
    assert b"PK\x06\x06" in blob and b"PK\x06\x07" in blob  # the zip64 end record and its locator
    infos = {i.filename: i for i in zipfile.ZipFile(path).infolist()}  # (no CRCs to test: torch writes none either)
    assert infos["archive/data/0"].file_size == 256 and infos["archive/version"].header_offset > 100


def test_pickles_equal_pythons_for_plain_values():
    values = [None, True, False, 0, 255, 256, 65535, 65536, -1, -2**31, 2**31, -2**63, 2**70, 1.5, -0.0, float("inf"),
              "", "héllo", (), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4), [], [1, [2, []]], {}, {"a": {"b": (1, "c")}}]
    for v in values:
        assert pickle.loads(ts.dumps(v)) == v and type(pickle.loads(ts.dumps(v))) is type(v), v


def test_parts_pickled_ahead_make_the_same_pickle():
    """A large index is held as pickled parts (ts.pickled) until it is written: the same bytes as the whole tree."""
    size = ts.size((3, 4))
    namespace = ts.New(ts.Global("argparse", "Namespace"))
    tree = {"a": [size, {"b": (1, "c")}], "items": ts.Items([(ts.size((1,)), namespace)])}
    ahead = {"a": [ts.pickled(size), ts.pickled({"b": (1, "c")})],
             "items": ts.Items([(ts.pickled(ts.size((1,))), ts.pickled(namespace))])}
    assert ts.dumps(ahead) == ts.dumps(tree) and pickle.loads(ts.dumps(ahead))["a"][0] == torch.Size((3, 4))


def test_stand_ins_load_as_the_torch_objects_they_name():
    ns = argparse.Namespace(params_dtype=ts.dtype_global("bfloat16"), tp=2, real=torch.float16)
    got = pickle.loads(ts.dumps({"args": ns, "size": ts.size((3, 4))}))
    assert got["args"].params_dtype is torch.bfloat16 and got["args"].real is torch.float16 and got["args"].tp == 2
    assert got["size"] == torch.Size((3, 4)) and type(got["size"]) is torch.Size
    with pytest.raises(ts.Unpicklable, match="object"):
        ts.dumps({"x": object()})


def test_dcp_metadata_reads_as_torchs(tmp_path):
    """A .metadata written by megatron_write's stand-ins is read by torch's own DCP reader into its own classes,
    equal to the Metadata built from those classes."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    from ckpt_tools.forms import megatron_write as mw
    chunks = [((0, 0), (2, 8)), ((2, 0), (2, 8))]
    meta = ts.New(ts.Global(mw.DCP, "Metadata"), {
        "state_dict_metadata": {"w": mw._tensor_metadata("bfloat16", (4, 8), chunks),
                                "obj": ts.New(ts.Global(mw.DCP, "BytesStorageMetadata"))},
        "planner_data": None, "storage_data": ts.Items([(mw._index("w", (2, 0)), mw._storage("__1_0.distcp", 5, 9)),
                                                        (mw._index("obj", None), mw._storage("__0_0.distcp", 0, 3))]),
        "storage_meta": None, "version": None})
    (tmp_path / ".metadata").write_bytes(ts.dumps(meta))
    got = FileSystemReader(str(tmp_path)).read_metadata()
    w = got.state_dict_metadata["w"]
    assert w == TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), torch.Size((4, 8)),
                                      [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])
    assert isinstance(got.state_dict_metadata["obj"], BytesStorageMetadata)
    assert got.storage_data[MetadataIndex("w", torch.Size((2, 0)))] == _StorageInfo("__1_0.distcp", 5, 9)
    assert got.storage_data[MetadataIndex("obj")] == _StorageInfo("__0_0.distcp", 0, 3)
