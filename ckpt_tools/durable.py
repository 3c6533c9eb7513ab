"""Bytes onto the disk for good: fsync of files and dirs, small files written in place, the kernel's writeback started
as a writer goes (sync_file_range), kernel copies between files (copy_file_range), and `FileWorker`, which runs one
output file's copies and writeback starts on a thread of its own, and `each_file`, which writes several files at
once on threads."""
from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from pathlib import Path


def write_bytes_durable(path: str | Path, data: bytes) -> None:
    """A small file written and fsynced in place (inside a staged output, renamed into place later)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | Path) -> None:
    """fsync a file, or a dir (its entries), by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


fsync_dir = fsync_file
_SYNC_FILE_RANGE_WRITE = 2


@functools.cache
def _sync_file_range():
    import ctypes
    f = getattr(ctypes.CDLL(None, use_errno=True), "sync_file_range", None)  # Linux only
    if f is not None:
        f.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return f


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Have the kernel start writing these bytes of a file to disk now, without waiting (Linux
    sync_file_range): a writer that calls it as it goes overlaps its disk writes with its work, and
    its final fsync finds little left to wait for. A no-op where the call is missing."""
    f = _sync_file_range()
    if f is not None:
        f(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


class FileWorker:
    """One output file's kernel copies (copy_range) and writeback starts, run in order on a thread of their own, so
    that the caller goes on planning and writing (headers, pickles, gathered rows) while the bytes move, and two
    files fill on two cores. Every write is positioned (pwrite, copy_file_range at an offset) and no two ranges
    overlap, so the file's bytes do not depend on which thread writes a range first.

    finish() waits for every call submitted, ends the thread and raises the first error a call raised (the calls
    after a failed one are skipped); abandon() skips what is left and ends the thread, raising nothing (a write that
    failed elsewhere). One of them runs before the file's descriptor, or a source's, is closed."""

    def __init__(self):
        import queue
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._skip = False
        self._thread = threading.Thread(target=self._run, name="ckpt-file-worker", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            if self._error is None and not self._skip:
                try:
                    call[0](*call[1])
                except BaseException as e:  # noqa: BLE001 - raised in the caller's thread by finish()
                    self._error = e

    def submit(self, fn, *args) -> None:
        if self._error is not None:  # a call failed: the caller stops here rather than at finish()
            self.finish()
        if not self._thread.is_alive():
            raise RuntimeError("a call submitted to a finished FileWorker")
        self._calls.put((fn, args))

    def copy(self, src: int, offset: int, dst: int, pos: int, nbytes: int) -> None:
        """copy_range, on this file's thread."""
        self.submit(copy_range, src, offset, dst, pos, nbytes)

    def writeback(self, fd: int, offset: int, nbytes: int) -> None:
        """start_writeback, once the copies submitted before it are done, on the process's writeback thread: the
        kernel's work of sending the pages to the disk runs beside the next copies (on another core), not after."""
        self.submit(_writebacks().put, (start_writeback, (fd, offset, nbytes)))

    def finish(self) -> None:
        self._end()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def abandon(self) -> None:
        self._skip = True
        self._end()
        self._error = None

    def _end(self) -> None:
        if self._thread.is_alive():
            self._calls.put(None)
            self._thread.join()
        if _WRITEBACKS:  # the writebacks this file asked for have started too (its descriptor may close next)
            done = threading.Event()
            _WRITEBACKS[0].put((done.set, ()))
            done.wait()


_WRITEBACKS: list = []  # the process's writeback thread's queue, once started
_STARTING = threading.Lock()
if hasattr(os, "register_at_fork"):  # a forked child has no such thread: it starts its own
    def _forked() -> None:
        global _STARTING
        _WRITEBACKS.clear()
        _STARTING = threading.Lock()
    os.register_at_fork(after_in_child=_forked)


def _writebacks():
    with _STARTING:  # two files' threads may ask first at once (each_file): one writeback thread for the process
        if not _WRITEBACKS:
            import queue
            calls: queue.SimpleQueue = queue.SimpleQueue()

            def run() -> None:
                while True:
                    fn, args = calls.get()
                    try:
                        fn(*args)
                    except Exception:  # noqa: BLE001 - a writeback start is advice to the kernel: the fsync still comes
                        pass
            threading.Thread(target=run, name="ckpt-writeback", daemon=True).start()
            _WRITEBACKS.append(calls)
    return _WRITEBACKS[0]


class Stopped(Exception):
    """Another file of the same each_file failed: this one stops where it is (its output is discarded with the rest)."""


def each_file(calls: list[tuple], write: Callable[..., None], at_once: int) -> None:
    """write(*call, stopped) for each call, up to `at_once` at a time: this thread and at_once - 1 helper threads
    each take the next call not yet taken. `stopped` (a threading.Event) is set once a call has failed or this
    thread is interrupted; a write checks it between its pieces and raises Stopped. Every helper has ended before
    this returns or raises (nothing writes on after it); the first error, not Stopped, is raised."""
    stopped = threading.Event()
    if at_once <= 1 or len(calls) <= 1:
        for call in calls:
            write(*call, stopped)
        return
    todo, lock, errors = list(calls), threading.Lock(), []

    def take() -> tuple | None:
        with lock:
            return None if stopped.is_set() or not todo else todo.pop(0)

    def run() -> None:
        try:
            while (call := take()) is not None:
                write(*call, stopped)
        except BaseException as e:  # noqa: BLE001 - raised below, once every thread has ended
            errors.append(e)
            stopped.set()
    helpers = [threading.Thread(target=run, name="ckpt-file-writer", daemon=True)
               for _ in range(min(at_once, len(calls)) - 1)]
    for h in helpers:
        h.start()
    try:
        run()
        for h in helpers:
            h.join()
    except BaseException:  # interrupted while waiting: the helpers stop at their next piece
        stopped.set()
        raise
    if errors:
        raise next((e for e in errors if not isinstance(e, Stopped)), errors[0])


def copy_range(src: int, offset: int, dst: int, pos: int, nbytes: int) -> None:
    """nbytes of file src at offset -> file dst at pos, in the kernel where it can (copy_file_range)."""
    end = offset + nbytes
    while offset < end:
        try:
            n = os.copy_file_range(src, dst, end - offset, offset, pos)
        except OSError:  # not supported here (an old kernel, another file system): through a buffer
            n = os.pwrite(dst, os.pread(src, min(end - offset, 1 << 24), offset), pos)
        if n <= 0:
            raise OSError(f"copying into file {dst}: source ended at byte {offset}, expected {end}")
        offset, pos = offset + n, pos + n
