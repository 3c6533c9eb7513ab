"""Our format's writer fills its copied records on a thread of the file's own (writers.Filling), and the file's sha256
follows those copies (io.sha256_file with `ready`): the same bytes and the same hashes as filling and hashing in turn,
holes included, and a failed copy is raised where the hash waits for it."""
from __future__ import annotations

import hashlib
import os

import pytest
import torch

from ckpt_tools import io
from ckpt_tools.writers import TorchFileWriter


def _source(tmp_path) -> tuple[int, torch.Tensor]:
    data = torch.arange(3 << 20, dtype=torch.float32)
    path = tmp_path / "src.bin"
    path.write_bytes(data.numpy().tobytes())
    return os.open(path, os.O_RDONLY), data


def _write(path, fd: int, background: bool):
    w = TorchFileWriter(path)
    state = {"a": w.tensor(torch.ones(1000)),
             "b": w.tensor_from_files(torch.float32, (1 << 20,), [(fd, 4 << 20, 2 << 20), (fd, 0, 2 << 20)]),
             "z": w.zeros(torch.float32, (1 << 20,)),
             "c": w.tensor_from_files(torch.float32, (512,), [(fd, 8 << 20, 2048)]),
             "d": w.tensor(torch.full((77,), 3.0))}
    return w.close(state, fsync=False, background=background)


def test_filled_on_a_thread_hashed_as_it_goes(tmp_path):
    fd, data = _source(tmp_path)
    try:
        (tmp_path / "plain").mkdir()
        (tmp_path / "thread").mkdir()  # the same file name: the archive's name is the file's
        assert _write(tmp_path / "plain" / "f.bin", fd, background=False) is None
        filling = _write(tmp_path / "thread" / "f.bin", fd, background=True)
        digest = io.sha256_file(tmp_path / "thread" / "f.bin", chunk=4096, ready=filling.ready)
        filling.wait()
        filling.wait()  # a second wait does nothing
    finally:
        os.close(fd)
    plain, threaded = (tmp_path / "plain" / "f.bin").read_bytes(), (tmp_path / "thread" / "f.bin").read_bytes()
    assert plain == threaded
    assert digest == hashlib.sha256(plain).hexdigest() == io.sha256_file(tmp_path / "plain" / "f.bin")
    state = torch.load(tmp_path / "thread" / "f.bin", weights_only=True, mmap=True)
    assert torch.equal(state["b"], torch.cat([data[1 << 20:(1 << 20) + (1 << 19)], data[:1 << 19]]))
    assert not state["z"].any() and torch.equal(state["c"], data[2 << 20:(2 << 20) + 512])


def test_hash_bounded_by_ready_equals_whole_file_hash(tmp_path):
    path = tmp_path / "holes.bin"
    with open(path, "wb") as f:  # data, a hole, data, a hole at the end
        f.write(b"x" * 10000)
        f.seek(1 << 21)
        f.write(b"y" * 5000)
        f.truncate((1 << 22) + 123)
    marks = iter([7, 10000, 20000, 1 << 21, (1 << 21) + 1, (1 << 22) + 123])
    assert io.sha256_file(path, chunk=4096, ready=lambda pos: next(marks)) == \
        hashlib.sha256(path.read_bytes()).hexdigest() == io.sha256_file(path)


def test_a_failed_copy_is_raised_where_the_hash_waits(tmp_path):
    filling = _write(tmp_path / "bad.bin", 1 << 20, background=True)  # no such descriptor: EBADF on the file's thread
    with pytest.raises(OSError):
        io.sha256_file(tmp_path / "bad.bin", ready=filling.ready)
