"""The process's memory while it streams tensors: glibc's thresholds for large freed blocks, and the resident pages of
memory-mapped checkpoint files dropped once their tensors are used."""
from __future__ import annotations

import os
from pathlib import Path


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
