"""The content hashes of meta.json's file records: which algorithms, and a file's digest (its holes hashed from
zeros, not read; a file still being written hashed as its bytes become final)."""
from __future__ import annotations

import errno
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

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


def hash_file(path: str | Path | int, algorithm: str = HASH, chunk: int = 1 << 22) -> str:
    """The hex digest of a file's bytes (`path` or an open descriptor, left open) by `algorithm` (HASHES); its holes
    (a fresh optimizer's zero moments) are hashed from a buffer of zeros, not read."""
    h, buf = _hasher(algorithm), bytearray(chunk)  # one reused buffer: no fresh pages per chunk
    view = memoryview(buf)
    with open(path, "rb", buffering=0, closefd=not isinstance(path, int)) as f:
        for start, end, data in _extents(f.fileno()):
            if not data:
                for at in range(start, end, len(_ZEROS)):
                    h.update(_ZEROS[:min(len(_ZEROS), end - at)])
                continue
            f.seek(start)
            left = end - start
            while left > 0 and (n := f.readinto(view[:min(chunk, left)])):
                h.update(view[:n])
                left -= n
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
