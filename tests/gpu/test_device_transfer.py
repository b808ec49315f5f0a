"""Prefill and decode as two processes on one device: the bench's prefill child (a real
PrefillNode, its pool on the device, filled there with each request's pattern) and a DecodeNode
in the test process (its pool on the same device), over each engine (NIXL: UCX's cuda_ipc /
cuda_copy on a GPU, CMA here; Mooncake: whatever its build offers without RDMA: TCP here). Every
byte of every layer's KV and indexer verified on decode, checksums on (``wsum64`` on CUDA,
xxHash3 on the CPU), decode's other pages untouched, on ``auto`` and on the staged route forced
(its gather and scatter on the device)."""

from __future__ import annotations

import numpy as np
import pytest

from dsa_bridge.transfer.bench.child import Geometry, start_child
from dsa_bridge.transfer.bench.measure import TransferSession, page_ids

from .device_bytes import mismatches, random_fill, snapshot

PAGES = 24  # a request: 24 pages of 61 layers, both caches (~74 MB)


@pytest.fixture(scope="module")
def child():
    """One prefill process for the module (each test sets up and tears down its own node)."""
    child = start_child()
    try:
        yield child
    finally:
        child.stop()


@pytest.mark.parametrize("route", ["auto", "staged"])
@pytest.mark.parametrize("pattern", ["fragmented", "per_page"])
def test_two_processes_move_every_byte(child, device, engine, route, pattern):
    geometry = Geometry("deepseek-v3.2", 61, "fp8", pool_tokens=2 * PAGES * 64, device=device)
    session = TransferSession(child, engine, geometry)
    try:
        pool = session.node.pool
        random_fill(pool, 9)
        before = snapshot(pool)
        (src, dst), = page_ids(pattern, PAGES)
        room = session._room  # the room the next end_to_end sends
        child.call("fill", room=room, pages=src.tolist())
        transfer = session.end_to_end([(src, dst)], checksums=True, route=route)
        assert mismatches(pool, room, dst) == 0
        after = snapshot(pool)
        others = np.setdiff1d(np.arange(pool.num_kv_pages), dst)
        assert all(np.array_equal(after[k][others], before[k][others]) for k in before)
        assert transfer.nbytes == PAGES * 61 * (41984 + 8448)
        assert transfer.checksum_seconds > 0
        assert session.node.counters.snapshot()["checksums_verified"] == PAGES * 122
        if route == "staged":
            assert transfer.staged_chunks == 1 and transfer.staging_slices >= 1
    finally:
        session.close()
