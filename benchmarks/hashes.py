"""The content hashes a manifest could record, measured on this machine: GB/s a core over a buffer in memory, and
each one's pace against SHA-256's (what contract 2 recorded first). XXH3-128 is the one written (ckpt_tools/hashing.py).

    python benchmarks/hashes.py [--mib 256] [--repeat 3]
"""
from __future__ import annotations

import argparse
import hashlib
import os
import time


def rate(make, data: memoryview, repeat: int, chunk: int = 8 << 20) -> float:
    """Best of `repeat` passes, in GB/s, hashing `data` in chunks as hashing.hash_file does."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        h = make()
        for i in range(0, len(data), chunk):
            h.update(data[i:i + chunk])
        h.digest()
        best = min(best, time.perf_counter() - start)
    return len(data) / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    a = parser.parse_args()
    data = memoryview(os.urandom(a.mib << 20))
    candidates = {"sha256": hashlib.sha256}
    try:
        import xxhash
        candidates["xxh3_128"] = xxhash.xxh3_128
    except ImportError:
        pass
    try:
        import blake3
        candidates["blake3 (1 thread)"] = blake3.blake3
    except ImportError:
        pass
    rates = {name: rate(make, data, a.repeat) for name, make in candidates.items()}
    print(f"{'hash':<20} {'GB/s':>7} {'x sha256':>9}")
    for name, r in rates.items():
        print(f"{name:<20} {r:7.2f} {r / rates['sha256']:9.2f}")


if __name__ == "__main__":
    main()
