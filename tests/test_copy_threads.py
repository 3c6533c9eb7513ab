"""The copy path's speed-ups keep every byte and every check: durable.FileWorker (a file's kernel copies and writeback on a
thread of its own), torchsave's cached archive around a tensor's data, and torchfile's memo of parsed chunks."""
from __future__ import annotations

import io as pyio
import os
import threading
import time
import zipfile

import pytest

from ckpt_tools import durable
from ckpt_tools.forms import torchfile
from ckpt_tools.forms import torchsave as ts
from ckpt_tools.forms.dtypes import ELEMENT_SIZES


def _file(path, data: bytes) -> int:
    path.write_bytes(data)
    return os.open(path, os.O_RDONLY)


def test_file_worker_copies_in_place_and_raises_the_first_error(tmp_path):
    src = _file(tmp_path / "src", bytes(range(256)) * 64)
    dst = os.open(tmp_path / "dst", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        worker = durable.FileWorker()
        worker.copy(src, 4096, dst, 100, 5000)  # later bytes first: each range lands in its place whatever the order
        os.pwrite(dst, b"head", 0)
        worker.copy(src, 0, dst, 5100, 100)
        worker.writeback(dst, 0, 5200)
        worker.submit(os.fsync, dst)
        worker.finish()
        got = os.pread(dst, 6000, 0)
        whole = bytes(range(256)) * 64
        assert got[:4] == b"head" and got[100:5100] == whole[4096:9096] and got[5100:5200] == whole[:100]
        assert len(got) == 5200

        failing, ran = durable.FileWorker(), []
        failing.submit(os.fsync, 1 << 20)  # EBADF
        failing.submit(ran.append, "after")  # skipped: the file is incomplete
        with pytest.raises(OSError):
            failing.finish()
        assert ran == []
        with pytest.raises(RuntimeError):
            failing.submit(ran.append, "late")

        dropped = durable.FileWorker()
        dropped.submit(os.fsync, 1 << 20)
        dropped.abandon()  # a write that failed elsewhere: nothing raised here
    finally:
        os.close(src)
        os.close(dst)


@pytest.mark.parametrize("limit", [ts.ZIP64_LIMIT, 100])
def test_save_tensor_writes_what_the_archive_writer_writes(tmp_path, monkeypatch, limit):
    """The archive around a tensor's data, made once per dtype and shape, equals the one written record by record."""
    monkeypatch.setattr(ts, "ZIP64_LIMIT", limit)
    src = _file(tmp_path / "src", os.urandom(1 << 16))
    try:
        for dtype, shape, start in [("bfloat16", (4, 8), 0), ("bfloat16", (4, 8), 777), ("float32", (3, 5, 7), 64),
                                    ("float16", (), 5), ("float32", (0, 3), 9)]:
            n = ts.math.prod(shape) * ELEMENT_SIZES[dtype]
            for data in ([(src, 123, n)], os.urandom(n), [os.urandom(n // 2), (src, 0, n - n // 2)]):
                fds = [os.open(tmp_path / name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644) for name in "ab"]
                try:
                    end = ts.save_tensor(fds[0], start, dtype, shape, data)
                    old = ts._torch_records(ts.Archive(fds[1], start), ts.dumps(ts.TensorRef("0", dtype, shape)),
                                            [("0", data)])
                    assert end == old
                finally:
                    for fd in fds:
                        os.close(fd)
                assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()
    finally:
        os.close(src)


def test_parsed_chunks_are_reused_only_for_the_same_bytes(tmp_path):
    """A .distcp-like file of chunk archives: chunks of one shape are parsed once; a chunk whose headers differ (a
    damaged one of the same length) is parsed, and refused, on its own."""
    path = tmp_path / "x.distcp"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    where = []
    try:
        pos = 0
        for i in range(4):
            end = ts.save_tensor(fd, pos, "bfloat16", (64, 40), os.urandom(64 * 40 * 2))
            where.append((pos, end - pos))
            pos = end
    finally:
        os.close(fd)
    torchfile._PARSED.clear()
    infos = [torchfile.read(path, o, n) for o, n in where]
    assert sum(len(v) for v in torchfile._PARSED.values()) == 1  # one parse for the four
    fresh = []
    for o, n in where:
        torchfile._PARSED.clear()
        fresh.append(torchfile.read(path, o, n))
    assert infos == fresh and len({i.offset for i in infos}) == 4

    blob = bytearray(path.read_bytes())
    o, n = where[2]
    archive = bytes(blob[o:o + n])
    h = zipfile.ZipFile(pyio.BytesIO(archive)).getinfo("archive/data.pkl").header_offset
    start = o + h + 30 + int.from_bytes(archive[h + 26:h + 28], "little") + \
        int.from_bytes(archive[h + 28:h + 30], "little")
    blob[start + 2] ^= 0xFF  # a damaged pickle, the archive's length unchanged
    path.write_bytes(bytes(blob))
    torchfile._PARSED.clear()
    assert torchfile.read(path, *where[0]) == infos[0]
    with pytest.raises(torchfile.Unreadable):
        torchfile.read(path, *where[2])
    assert torchfile.read(path, *where[3]) == infos[3]


def _pieces(stopped, n: int = 20, pause: float = 0.01) -> None:
    """A file's writing in pieces, stopping between them once another file has failed (as merge's bar does)."""
    for _ in range(n):
        if stopped.is_set():
            raise durable.Stopped()
        time.sleep(pause)


def test_each_file_makes_every_call_once_on_as_many_threads_as_asked():
    for at_once in (1, 2, 3):
        made, threads = [], set()

        def write(i, stopped, made=made, threads=threads):
            _pieces(stopped, 2)
            made.append(i)
            threads.add(threading.get_ident())
        durable.each_file([(i,) for i in range(7)], write, at_once)
        assert sorted(made) == list(range(7)) and len(threads) == at_once


@pytest.mark.parametrize("failing", ["helper", "caller"])
def test_each_file_stops_every_file_at_its_next_piece_and_raises_the_error(failing):
    """A file that fails on a helper thread, or on the calling thread: the other file stops at its next piece, no
    file is taken after the failure, the error (not Stopped) is raised, and no helper is still running after it."""
    taken, ended, both = [], [], threading.Barrier(2)

    def write(i, stopped):
        taken.append(i)
        both.wait(timeout=10)  # both files are being written when one fails
        on_helper = threading.current_thread() is not threading.main_thread()
        if on_helper == (failing == "helper"):
            _pieces(stopped, 3)
            raise OSError(f"disk full writing file {i}")
        _pieces(stopped, 200)  # 2 s unless stopped
        ended.append(i)
    start = time.perf_counter()
    with pytest.raises(OSError, match="disk full"):
        durable.each_file([(i,) for i in range(10)], write, 2)
    assert time.perf_counter() - start < 1.5  # the other file stopped at its next piece, not at its end
    assert len(taken) == 2 and ended == []
    assert not [t for t in threading.enumerate() if t.name == "ckpt-file-writer"]

