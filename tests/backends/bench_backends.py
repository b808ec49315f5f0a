"""Throughput of both backends between two processes on this host, NIXL's two request paths,
and NIXL without its worker threads (``num_threads`` 0, beside the default ``UCX_PARAMS``).

Run: ``python -m tests.backends.bench_backends [--repeat 5]`` from the repository root. Prints one
line per case: median GB/s over ``--repeat`` runs (and the request set-up time for NIXL paths).
Figures are noisy on a shared 2-core machine: compare them as ratios (see docs/engines.md).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from dsa_bridge.plugin.descriptors import raw_region
from dsa_bridge.transfer.backends import BACKENDS, create_backend

from .helpers import INDEXER_PAGE, KV_PAGE, Local, dsa_runs
from .peer import Peer, start_peer

BYTES = 320 << 20
MIB = 1 << 20


def strided(count: int, size: int, gap: int, local: Local, peer: Peer):
    """``count`` runs of ``size`` bytes, ``gap`` bytes apart on both sides (gap 0: adjacent)."""
    offsets = np.arange(count, dtype=np.uint64) * np.uint64(size + gap)
    length = np.full(count, size, dtype=np.uint64)
    return local.base + offsets, peer.addr + offsets, length


def cases(local: Local, peer: Peer) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    return {
        "1 x 256 MiB": strided(1, 256 * MIB, 0, local, peer),
        "4096 x 64 KiB": strided(4096, 64 << 10, 64, local, peer),
        "3000 DSA runs (41,984 / 8,448 B)": dsa_runs(np.random.default_rng(0), 3000, local, peer),
        "6000 x 8,448 B (indexer pages)": strided(6000, INDEXER_PAGE, 64, local, peer),
        "3000 x 41,984 B (KV pages)": strided(3000, KV_PAGE, 64, local, peer),
    }


def median_rate(
    run: Callable[..., float], args: tuple[np.ndarray, np.ndarray, np.ndarray], repeat: int
) -> tuple[float, float]:
    """(median GB/s, median of what ``run(*args)`` returns, e.g. its set-up seconds)."""
    nbytes = int(args[2].sum())
    rates, extras = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        extras.append(run(*args))
        rates.append(nbytes / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates), statistics.median(extras)


def bench_backend(name: str, repeat: int, backend_params: dict[str, str] | None = None) -> None:
    peer = start_peer(name, BYTES, lifetime_s=600)
    backend = create_backend(name, **({"backend_params": backend_params} if backend_params else {}))
    try:
        source = np.random.default_rng(1).integers(0, 256, BYTES, dtype=np.uint8)
        backend.register([raw_region(source.ctypes.data, source.nbytes)])
        local = Local(backend, source)
        handle = backend.connect(peer.metadata)
        print(f"{name}{f' {backend_params}' if backend_params else ''}: transport "
              f"{backend.transport()}")

        def write(src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> float:
            backend.write(handle, src, dst, length, timeout_s=60)
            return 0.0

        for label, args in cases(local, peer).items():
            rate, _ = median_rate(write, args, repeat)
            print(f"  {label:36s} {rate:6.2f} GB/s")
        if name == "nixl" and not backend_params:
            bench_nixl_paths(backend, handle, local, peer, repeat)
    finally:
        backend.close()
        peer.stop()


def bench_nixl_paths(backend, handle: str, local: Local, peer: Peer, repeat: int) -> None:
    """``initialize_xfer`` against ``prep_xfer_dlist`` + ``make_prepped_xfer`` (white-box)."""
    agent = backend._agent

    def descs(base: np.ndarray, length: np.ndarray) -> np.ndarray:
        return np.column_stack((base, length, np.zeros_like(length)))

    def finish(request) -> None:
        state = agent.transfer(request)
        while state == "PROC":
            state = agent.check_xfer_state(request)
        assert state == "DONE", state
        request.release()

    def initialize(src, dst, length) -> float:
        start = time.perf_counter()
        local_list = agent.get_xfer_descs(descs(src, length), "DRAM")
        remote_list = agent.get_xfer_descs(descs(dst, length), "DRAM")
        request = agent.initialize_xfer("WRITE", local_list, remote_list, handle)
        setup = time.perf_counter() - start
        finish(request)
        return setup

    def prepped(src, dst, length) -> float:
        start = time.perf_counter()
        local_side = agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs(src, length), "DRAM")
        remote_side = agent.prep_xfer_dlist(handle, descs(dst, length), "DRAM")
        index = np.arange(len(length), dtype=np.int32)
        request = agent.make_prepped_xfer("WRITE", local_side, index, remote_side, index)
        setup = time.perf_counter() - start
        finish(request)
        local_side.release()
        remote_side.release()
        return setup

    print("  NIXL request paths (setup = descriptor lists + request, ms):")
    for gap, layout in ((64, "apart"), (0, "adjacent")):
        for size, count in ((KV_PAGE, 3000), (INDEXER_PAGE, 6000)):
            args = strided(count, size, gap, local, peer)
            for path in (initialize, prepped):
                with backend._lock:
                    rate, setup = median_rate(path, args, repeat)
                print(
                    f"    {count} x {size:,} B {layout:8s} {path.__name__:10s} "
                    f"{rate:6.2f} GB/s  setup {setup * 1e3:5.2f} ms"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--backend", choices=BACKENDS, action="append")
    args = parser.parse_args()
    for name in args.backend or BACKENDS:
        bench_backend(name, args.repeat)
        if name == "nixl":
            bench_backend(name, args.repeat, {"num_threads": "0"})


if __name__ == "__main__":
    main()
