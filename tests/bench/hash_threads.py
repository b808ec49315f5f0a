"""Whether page checksums gain from threads: xxh3 of every page, python-xxhash in one thread
against a GIL-free call (``ctypes`` over the XXH3_64bits the python-xxhash extension exports) in
one and in two threads.

Run: ``python -m tests.bench.hash_threads`` from the repository root. Prints GB/s per page size
(a KV page and an indexer page of DeepSeek-V3.2, an 8K-token request's pages of each in one
buffer), the best of ``--repeat`` passes. Recorded in docs/benchmarks.md (End-to-end checksums).
"""

from __future__ import annotations

import argparse
import ctypes
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash
import xxhash._xxhash

PAGES = 128 * 61  # an 8K-token request: 128 pages in each of 61 layers
PAGE_BYTES = {"KV": 41_984, "indexer": 8_448}


def native_xxh3():
    """libxxhash's XXH3_64bits from the python-xxhash extension: ctypes releases the GIL."""
    function = ctypes.CDLL(xxhash._xxhash.__file__).XXH3_64bits
    function.restype, function.argtypes = ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_size_t]
    return function


def variants(pages: np.ndarray, pool: ThreadPoolExecutor) -> dict:
    """Each way to hash every row of ``pages``: a function of nothing returning the digests."""
    xxh3, (count, width) = native_xxh3(), pages.shape

    def python(lo: int, hi: int) -> np.ndarray:
        return np.fromiter((xxhash.xxh3_64_intdigest(pages[p]) for p in range(lo, hi)), np.uint64, hi - lo)

    def native(lo: int, hi: int) -> np.ndarray:
        base = pages.ctypes.data
        return np.fromiter(map(xxh3, range(base + lo * width, base + hi * width, width),
                               [width] * (hi - lo)), np.uint64, hi - lo)

    halves = [(0, count // 2), (count // 2, count)]
    return {"python-xxhash, 1 thread": lambda: python(0, count),
            "ctypes, 1 thread": lambda: native(0, count),
            "ctypes, 2 threads": lambda: np.concatenate(list(pool.map(lambda h: native(*h), halves)))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with ThreadPoolExecutor(2) as pool:
        for name, width in PAGE_BYTES.items():
            pages = rng.integers(0, 256, (PAGES, width), dtype=np.uint8)
            runs = variants(pages, pool)
            digests = [run() for run in runs.values()]
            assert all((d == digests[0]).all() for d in digests), "the variants disagree"
            for label, run in runs.items():
                best = min(timed(run) for _ in range(args.repeat))
                print(f"{name} page ({width} B), {label}: {pages.nbytes / best / 1e9:.1f} GB/s")


def timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
