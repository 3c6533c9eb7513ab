"""Every read of a `.bin`/`.pt` file and every atomic write goes through here.

Reads use `torch.load(weights_only=True)`: nothing in a checkpoint may run code when loaded.
Real Megatron-LM files also hold an argparse.Namespace, numpy RNG states and (Transformer Engine's
`_extra_state` in older TE versions) io.BytesIO; those types are allow-listed explicitly, nothing else. torch is imported where it is used: the torch-free merge
path (ckpt_tools.merge with ckpt_tools.byte_ranges) writes through this module too.
"""
from __future__ import annotations

import argparse
import errno
import functools
import hashlib
import json
import os
import pickle
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ckpt_tools.errors import CkptError, FormatError


def _allowed_globals() -> list:
    import io as _io
    from ckpt_tools.torchfile import MEGATRON_INERT, Record
    allowed: list = [argparse.Namespace, _io.BytesIO]  # BytesIO: Transformer Engine's _extra_state in older TE
    allowed += [(Record, f"{module}.{name}") for module, name in sorted(MEGATRON_INERT)]  # read, never built
    try:
        import numpy as np
        reconstruct = np._core.multiarray._reconstruct if hasattr(np, "_core") else np.core.multiarray._reconstruct
        # files written under numpy < 2 name it numpy.core.multiarray._reconstruct
        allowed += [np.ndarray, np.dtype, reconstruct, (reconstruct, "numpy.core.multiarray._reconstruct")]
        allowed += [type(np.dtype(t)) for t in ("uint32", "int64", "float64", "float32")]
    except (ImportError, AttributeError):
        pass
    return allowed


def _allowing():
    """The allow-list for one load, adding only what the process has not allowed already: leaving the context
    removes what it added, and must not remove what others (megatron-core registers argparse.Namespace) rely on."""
    import torch
    have = torch.serialization.get_safe_globals()
    # a name already allowed (megatron-core registers its real enums and argparse.Namespace) keeps its entry: two
    # entries of one name would make torch's pick between them arbitrary
    named = {g[1] if isinstance(g, tuple) else f"{getattr(g, '__module__', '')}.{getattr(g, '__qualname__', '')}"
             for g in have}
    return torch.serialization.safe_globals([g for g in _allowed_globals() if g not in have and not (
        isinstance(g, tuple) and g[1] in named)])


TRUST_PICKLE = False  # set only by `ckpt --trust-pickle`: full unpickling, which can run code


def load_bytes(data, what: str) -> Any:
    """A torch.save archive held in memory (a byte entry of a torch_dist checkpoint), loaded with the allow-list;
    `what` names it in errors."""
    import io as _io
    import torch
    try:
        with _allowing():
            return torch.load(_io.BytesIO(bytes(data)), map_location="cpu", weights_only=TRUST_PICKLE is False)
    except Exception as e:  # noqa: BLE001 - refused or damaged: one line either way
        raise FormatError(f"{what}: refused or unreadable ({str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__}): "
                          f"restore the checkpoint from the source") from None


def load_file(path: str | Path, mmap: bool = True) -> Any:
    """Load a torch-saved file safely (weights only), lazily via mmap when the file allows it."""
    import torch
    path = Path(path)
    if not path.is_file():
        raise FormatError(f"{path}: file not found")
    if TRUST_PICKLE:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    try:
        with _allowing():
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        # name the global, not torch's advice (which is to allow-list it)
        found = re.search(r"[Uu]nsupported (?:global: )?GLOBAL (\S+)", str(e))
        if not found:  # not a refused global: a damaged pickle that the weights-only unpickler could not read
            detail = str(e).split("WeightsUnpickler error:")[-1].strip().splitlines()
            raise FormatError(f"{path}: not a readable torch file ({(detail[0] if detail else 'damaged pickle')[:160]}): "
                              f"the file is truncated or corrupt; restore it from the source checkpoint") from None
        what = f"it needs {found.group(1)}"
        raise FormatError(f"{path}: refused to load, unpickling it would need code outside the allow-list "
                          f"({what}): it is not a plain checkpoint; only if you trust its origin, "
                          f"rerun with `ckpt --trust-pickle ...`, which lets it run code") from None
    except Exception as e:  # noqa: BLE001 - a damaged pickle or zip fails in any way (IndexError, KeyError, ...)
        if mmap and "mmap" in str(e):
            return load_file(path, mmap=False)
        first = str(e).strip().splitlines()[0].split(". ")[0][:200] if str(e).strip() else type(e).__name__
        raise FormatError(f"{path}: not a readable torch file ({first}): the file is truncated or corrupt; "
                          f"restore it from the source checkpoint") from None


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
        import threading
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
        from ckpt_tools.writers import copy_range
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
            import threading
            done = threading.Event()
            _WRITEBACKS[0].put((done.set, ()))
            done.wait()


_WRITEBACKS: list = []  # the process's writeback thread's queue, once started
if hasattr(os, "register_at_fork"):  # a forked child has no such thread: it starts its own
    os.register_at_fork(after_in_child=_WRITEBACKS.clear)


def _writebacks():
    if not _WRITEBACKS:
        import queue
        import threading
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


def save_file(obj: Any, path: str | Path) -> None:
    """torch.save + fsync: the caller writes into a temp dir that is renamed when complete."""
    import torch
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write a small text file via a temp name in the same dir + fsync + rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_json_atomic(path: str | Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def reuse_freed_memory() -> bool:
    """Have glibc keep large freed buffers for the next allocation instead of handing them back to the kernel: a
    process that makes one full tensor after another (import's HF tensors and their shards, reshard's joins) would
    otherwise map every one afresh, each page a fault that zeroes it. Blocks up to 1 GiB then come from the heap,
    and the heap's free memory is kept, not trimmed: the process's resident size stays at its high-water mark (in a
    1 GB import 0.75 GiB against 0.6 GiB, for a third fewer seconds), given back at exit. For the `ckpt` processes
    of reshard and import; whether glibc took it is returned (a no-op elsewhere)."""
    import ctypes
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    if mallopt(m_mmap_threshold, 1 << 30) != 1:  # refused (a glibc that caps it): leave both as they were
        return False
    return mallopt(m_trim_threshold, (1 << 31) - 1) == 1


_ZEROS = memoryview(bytes(1 << 22))


# The content hashes of meta.json's file records, by the record key that names each. XXH3-128 is what this version
# writes: made for checking data, 17.8 GB/s a core here against SHA-256's 1.8 and BLAKE3's 4.7 (256 MiB in memory,
# 2026-11-26; benchmarks/hashes.py), so that hashing no longer sets a verb's pace. The records guard against damage
# (a flipped bit, a truncated or swapped file), not against an adversary who can rewrite meta.json as well: the
# allow-listed loaders stand between a hostile file and code execution. SHA-256 records (written before) verify.
HASH = "xxh3_128"
HASHES = ("xxh3_128", "sha256")


def record_hash(record) -> tuple[str, str] | None:
    """(algorithm, hex digest) of a meta.json file record: exactly one known hash key holding a string, else None."""
    found = [(k, record[k]) for k in HASHES if isinstance(record, dict) and k in record]
    return found[0] if len(found) == 1 and isinstance(found[0][1], str) else None


def _hasher(algorithm: str):
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "xxh3_128":
        import xxhash
        return xxhash.xxh3_128()
    raise ValueError(f"unknown hash {algorithm!r}")


def hash_file(path: str | Path | int, algorithm: str = HASH, chunk: int = 1 << 22, ready=None) -> str:
    """The hex digest of a file's bytes (`path` or an open descriptor, left open) by `algorithm` (HASHES); its holes
    (a fresh optimizer's zero moments) are hashed from a buffer of zeros, not read. `ready`: for a file still being
    written or filled in order (writers.Growth.ready, writers.Filling.ready), called with the bytes hashed so far, it
    returns once more of the file is final how far it is final, and the file's final size once all of it is: the
    hash follows the writing instead of waiting for its end."""
    h, buf = _hasher(algorithm), bytearray(chunk)  # one reused buffer: no fresh pages per chunk
    view = memoryview(buf)
    with open(path, "rb", buffering=0, closefd=not isinstance(path, int)) as f:
        size = os.fstat(f.fileno()).st_size
        pos = 0
        while True:
            final = size if ready is None else ready(pos)
            if final <= pos:
                break
            for start, end, data in _extents(f.fileno(), pos, final):
                if not data:
                    for at in range(start, end, len(_ZEROS)):
                        h.update(_ZEROS[:min(len(_ZEROS), end - at)])
                    continue
                f.seek(start)
                left = end - start
                while left > 0 and (n := f.readinto(view[:min(chunk, left)])):
                    h.update(view[:n])
                    left -= n
            pos = final
    return h.hexdigest()


def _extents(fd: int, pos: int = 0, size: int | None = None) -> Iterator[tuple[int, int, bool]]:
    """(start, end, holds data) of the data and hole runs of a file's bytes [pos, size) (size: the file's); one data
    run where the filesystem cannot tell."""
    size = os.fstat(fd).st_size if size is None else size
    while pos < size:
        try:
            data = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as e:
            if e.errno == errno.ENXIO:  # only a hole up to the end
                yield pos, size, False
                return
            yield pos, size, True  # SEEK_DATA not supported here
            return
        if data >= size:
            yield pos, size, False
            return
        if data > pos:
            yield pos, data, False
        hole = min(size, os.lseek(fd, data, os.SEEK_HOLE))
        yield data, hole, True
        pos = hole


# ---------------------------------------------------------------- resident pages of mmap'd files
_MADV_DONTNEED = 4
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def file_mappings(path: str | Path) -> list[tuple[int, int, int]]:
    """(start, end, file offset of start) of each range where this process maps `path` (Linux
    /proc/self/maps; empty elsewhere)."""
    target = os.path.realpath(path)
    ranges = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].strip() == target:
                    start, end = (int(x, 16) for x in parts[0].split("-"))
                    ranges.append((start, end, int(parts[2], 16)))
    except OSError:
        return []
    return ranges


def release_pages(tensors, ranges: list[tuple[int, int, int]]) -> None:
    """Drop the resident pages of tensors that live in read-only private file mappings (`ranges`).

    The data stays in the file and is read again if touched; memory held by the process stays
    near the tensors in flight instead of growing with everything read so far. Tensors outside
    `ranges` (ordinary memory) are never touched.
    """
    if not ranges:
        return
    import ctypes

    import torch
    libc = ctypes.CDLL(None, use_errno=True)
    for t in tensors:
        if not torch.is_tensor(t) or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        ptr, size = storage.data_ptr(), storage.nbytes()
        for start, end, _ in ranges:
            if start <= ptr and ptr + size <= end:
                lo = max(start, ptr - ptr % _PAGE)
                hi = min(end, -(-(ptr + size) // _PAGE) * _PAGE)
                libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), _MADV_DONTNEED)
                break


def return_freed_memory() -> None:
    """Make glibc give blocks of >= 1 MiB back to the OS when freed (mmap'd, not kept in the heap).

    Streaming allocates and frees one large tensor after another; glibc's adaptive threshold would
    otherwise keep the freed blocks, and the resident set would grow with the number of layers.
    """
    try:
        import ctypes
        ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


PORT_RANGE = "CKPT_PORT_RANGE"  # LO-HI: the range free_port draws from (several jobs on one machine: a range each)


def free_port() -> int:
    """A TCP port free on this machine now, for a torchrun rendezvous: the kernel's choice, or a free one drawn from
    $CKPT_PORT_RANGE (LO-HI) where it is set. Jobs that start processes side by side on one machine (the test suite's
    workers) each take their own range below the kernel's ephemeral ports: a port one job found free is then never
    the one another job's process is given meanwhile."""
    import random
    import socket
    span = os.environ.get(PORT_RANGE)
    if not span:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    m = re.fullmatch(r"(\d+)-(\d+)", span.strip())
    lo, hi = (int(m.group(1)), int(m.group(2))) if m else (0, -1)
    if not 1024 <= lo <= hi <= 65535:
        raise CkptError(f"{PORT_RANGE}={span!r} is not a port range LO-HI within 1024-65535: set it like 20000-23999 or "
                        f"unset it")
    for port in random.sample(range(lo, hi + 1), min(256, hi - lo + 1)):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise CkptError(f"no free port in {PORT_RANGE}={span}: widen the range or unset it")
