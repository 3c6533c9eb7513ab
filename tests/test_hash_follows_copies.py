"""Our format's writer fills its copied records on a thread of the file's own (writers.Filling), and the file's sha256
follows those copies (hashing.hash_file with `ready`): the same bytes and the same hashes as filling and hashing in turn,
holes included, and a failed copy is raised where the hash waits for it. While the file is still being written, the
hash follows the writer (writers.Growth): up to the first record reserved for copies, then the copies."""
from __future__ import annotations

import gc
import itertools
import os
import threading
import time

import pytest
import torch
import xxhash

from ckpt_tools import hashing
from ckpt_tools.forms.writers import TorchFileWriter


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
        digest = hashing.hash_file(tmp_path / "thread" / "f.bin", chunk=4096, ready=filling.ready)
        filling.wait()
        filling.wait()  # a second wait does nothing
    finally:
        os.close(fd)
    plain, threaded = (tmp_path / "plain" / "f.bin").read_bytes(), (tmp_path / "thread" / "f.bin").read_bytes()
    assert plain == threaded
    assert digest == xxhash.xxh3_128(plain).hexdigest() == hashing.hash_file(tmp_path / "plain" / "f.bin")
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
    size = (1 << 22) + 123
    marks = itertools.chain([7, 10000, 20000, 1 << 21, (1 << 21) + 1], itertools.repeat(size))  # then: all final
    assert hashing.hash_file(path, chunk=4096, ready=lambda pos: next(marks)) == \
        xxhash.xxh3_128(path.read_bytes()).hexdigest() == hashing.hash_file(path)


def test_a_failed_copy_is_raised_where_the_hash_waits(tmp_path):
    filling = _write(tmp_path / "bad.bin", 1 << 20, background=True)  # no such descriptor: EBADF on the file's thread
    with pytest.raises(OSError):
        hashing.hash_file(tmp_path / "bad.bin", ready=filling.ready)


def _follow(growth) -> tuple[threading.Thread, dict]:
    """A thread hashing the file as the writer goes; `seen` gets each mark ready() returned, with the time."""
    out: dict = {"marks": []}

    def ready(pos):
        mark = growth.ready(pos)
        out["marks"].append((time.monotonic(), mark))
        return mark

    def run():
        try:
            out["digest"] = hashing.hash_file(growth.path, chunk=4096, ready=ready)
        except Exception as e:  # what the test expects for a dropped writer
            out["error"] = e
        finally:
            growth.finish()
    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_hash_follows_the_writer_then_the_copies(tmp_path):
    fd, data = _source(tmp_path)
    try:
        w = TorchFileWriter(tmp_path / "f.bin")
        growth = w.follow()
        thread, out = _follow(growth)
        state = {"a": w.tensor(torch.ones(1 << 18)), "z": w.zeros(torch.float32, (1 << 18,))}
        state["e"] = w.tensor(torch.full((1 << 18,), 2.0))
        time.sleep(0.3)  # the hash catches up with what is written
        state["b"] = w.tensor_from_files(torch.float32, (1 << 18,), [(fd, 4096, 1 << 20)])  # nothing final past here
        state["d"] = w.tensor(torch.full((1 << 18,), 3.0))  # the file's end now past b's record, unfilled
        time.sleep(0.3)
        closing = time.monotonic()
        filling = w.close(state, fsync=False, background=True)
        thread.join(10)
        assert not thread.is_alive() and "error" not in out
    finally:
        os.close(fd)
    assert filling is not None
    body = (tmp_path / "f.bin").read_bytes()
    assert out["digest"] == xxhash.xxh3_128(body).hexdigest()
    before = [mark for when, mark in out["marks"] if when < closing]
    assert before and max(before) >= 3 * (1 << 20)  # the three tensors written first, hashed before the close
    assert max(before) <= body.index(data[1024:1040].numpy().tobytes())  # but nothing from b's record on
    loaded = torch.load(tmp_path / "f.bin", weights_only=True, mmap=True)
    assert torch.equal(loaded["b"], data[1024:1024 + (1 << 18)]) and not loaded["z"].any()


def test_a_writer_dropped_unclosed_stops_its_hash(tmp_path):
    w = TorchFileWriter(tmp_path / "f.bin")
    thread, out = _follow(w.follow())
    w.tensor(torch.ones(1000))
    del w
    gc.collect()
    thread.join(10)
    assert not thread.is_alive() and isinstance(out.get("error"), OSError) and "before the file was complete" in \
        str(out["error"])


def test_a_target_file_that_fails_or_is_dropped_stops_its_hash(tmp_path):
    """Through target.Target.open_file (the hash on a thread of its own): a close that fails, and a writer dropped
    unclosed (an error mid-stage), end the file's hash with an error instead of leaving its thread waiting."""
    from torch_target import Target

    from ckpt_tools.model.spec import ModelSpec
    spec = ModelSpec("llama", num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                     vocab_size=128)
    target = Target(tmp_path, spec, 1, [2], 128, optimizer=False)
    failing, dropped = target.open_file("failing.bin"), target.open_file("dropped.bin")
    failing.tensor(torch.ones(1000))
    dropped.tensor(torch.ones(1000))
    with pytest.raises(Exception):
        failing.close({"x": lambda: None})  # cannot be pickled
    del dropped
    gc.collect()
    for name in ("failing.bin", "dropped.bin"):
        with pytest.raises(OSError, match="before the file was complete"):
            target._hashes[name].result(timeout=10)
