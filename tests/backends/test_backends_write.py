"""Real engines, two processes: byte-exact writes, bad writes refused, concurrent use."""

from __future__ import annotations

import hashlib
import threading
import time

import numpy as np
import pytest

from dsa_bridge.transfer.backends.base import BackendError

from .helpers import INDEXER_PAGE, KV_PAGE, dsa_runs, engine_forbidden, oracle
from .peer import SENTINEL

U64 = np.uint64


def sha(array: np.ndarray) -> str:
    return hashlib.sha256(array.tobytes()).hexdigest()


def first_difference(peer, expected: np.ndarray) -> str:
    got = np.frombuffer(peer.ask("read", 0, peer.nbytes), dtype=np.uint8)
    i = int(np.argmax(got != expected))
    return f"first differing byte at offset {i}: got {got[i]:#x}, expected {expected[i]:#x}"


def test_many_dsa_runs_land_byte_exact(connected) -> None:
    """3000 KV/indexer-sized runs (> 2048: Mooncake must chunk) in shuffled order."""
    local, peer, handle = connected
    src, dst, length = dsa_runs(np.random.default_rng(1), 3000, local, peer)
    local.backend.write(handle, src, dst, length, timeout_s=30)
    expected = oracle(local, peer, src, dst, length)
    assert peer.ask("digest") == sha(expected), first_difference(peer, expected)


@pytest.mark.parametrize("backend_name", ["mooncake"], indirect=True)  # batches are Mooncake's
@pytest.mark.parametrize("max_batch, in_flight", [(1024, 2), (512, 4), (7, 3)])
def test_mooncake_batches_in_flight_land_byte_exact(connected, monkeypatch, max_batch: int,
                                                    in_flight: int) -> None:
    """3000 runs in batches queued ahead of the one on the wire, up to the peer's 2048-entry
    bound (1024 x 2, 512 x 4) and in many small batches: every byte lands, nothing else."""
    local, peer, handle = connected
    monkeypatch.setattr(local.backend, "max_batch", max_batch)
    monkeypatch.setattr(local.backend, "batches_in_flight", in_flight)
    src, dst, length = dsa_runs(np.random.default_rng(4), 3000, local, peer)
    local.backend.write(handle, src, dst, length, timeout_s=30)
    expected = oracle(local, peer, src, dst, length)
    assert peer.ask("digest") == sha(expected), first_difference(peer, expected)


def test_adjacent_runs_land_byte_exact(connected) -> None:
    """Runs adjacent on both sides (which NIXL's prepped path merges) and mixed with a gap."""
    local, peer, handle = connected
    length = np.tile(np.array([KV_PAGE, INDEXER_PAGE], U64), 250)
    offsets = np.concatenate(([0], np.cumsum(length)[:-1])).astype(U64)
    offsets[300:] += U64(4096)  # one gap in the middle
    src, dst = local.base + offsets, peer.addr + offsets + U64(64)
    local.backend.write(handle, src, dst, length, timeout_s=30)
    assert peer.ask("digest") == sha(oracle(local, peer, src, dst, length))


def test_int64_arrays_are_accepted(connected) -> None:
    local, peer, handle = connected
    src, dst, length = dsa_runs(np.random.default_rng(2), 10, local, peer)
    local.backend.write(
        handle, src.astype(np.int64), dst.astype(np.int64), length.astype(np.int64), timeout_s=10
    )
    assert peer.ask("digest") == sha(oracle(local, peer, src, dst, length))


def test_nixl_posts_a_long_write_in_slices_byte_exact(connected, monkeypatch) -> None:
    """NIXL posts a write in slices of at most ``post_bytes`` (a longer descriptor cut in
    pieces), the agent lock held for one slice at a time: many posts, the bytes exact."""
    local, peer, handle = connected
    if local.backend.name != "nixl":
        pytest.skip("slicing is NIXL's (Mooncake's lock is never held across the engine's wait)")
    monkeypatch.setattr(local.backend, "post_bytes", 64 * 1024)
    posts = []
    real = local.backend._post
    monkeypatch.setattr(local.backend, "_post", lambda *a: (posts.append(a[2:]), real(*a)))
    src, dst, length = dsa_runs(np.random.default_rng(3), 200, local, peer)
    length[0] = U64(300_000)  # one descriptor longer than a slice: cut into pieces
    dst[0] = peer.addr + U64(peer.nbytes - 300_000)
    src[0] = local.base + U64(local.source.nbytes - 300_000)
    keep = (dst[1:] + length[1:] <= dst[0]) & (src[1:] + length[1:] <= src[0])
    src, dst, length = (np.concatenate((a[:1], a[1:][keep])) for a in (src, dst, length))
    local.backend.write(handle, src, dst, length, timeout_s=30)
    assert peer.ask("digest") == sha(oracle(local, peer, src, dst, length))
    assert len(posts) >= int(length.sum()) // (64 * 1024)


@pytest.mark.parametrize(
    "where",
    ["crosses the end", "before the start", "far away"],
)
def test_write_outside_peer_region_fails_and_writes_nothing(connected, where: str) -> None:
    local, peer, handle = connected
    dst = {
        "crosses the end": peer.addr + peer.nbytes - 100,
        "before the start": peer.addr - KV_PAGE,
        "far away": peer.addr + (1 << 40),
    }[where]
    with pytest.raises(BackendError):
        local.backend.write(
            handle,
            np.array([local.base], U64),
            np.array([dst], U64),
            np.array([KV_PAGE], U64),
            timeout_s=10,
        )
    assert peer.ask("digest") == sha(np.full(peer.nbytes, SENTINEL, dtype=np.uint8))


def test_concurrent_writes_and_progress_from_other_threads(connected) -> None:
    """Two writer threads (disjoint halves) and a progress loop, as the node will run them."""
    local, peer, handle = connected
    src, dst, length = dsa_runs(np.random.default_rng(3), 1200, local, peer)
    errors: list[BaseException] = []
    stop = threading.Event()

    def write(part: slice) -> None:
        try:
            local.backend.write(handle, src[part], dst[part], length[part], timeout_s=30)
        except BaseException as exc:  # reported below
            errors.append(exc)

    def spin() -> None:
        while not stop.is_set():
            local.backend.progress()
            time.sleep(0.001)

    threads = [threading.Thread(target=write, args=(part,)) for part in (np.s_[:600], np.s_[600:])]
    spinner = threading.Thread(target=spin)
    spinner.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    stop.set()
    spinner.join(5)
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads + [spinner])
    assert peer.ask("digest") == sha(oracle(local, peer, src, dst, length))


def test_nixl_progress_skips_while_the_agent_is_busy_then_waits_its_turn(local, monkeypatch) -> None:
    """While a write holds the agent lock (as it does for each slice's post), ``progress()``
    returns without it; ``PROGRESS_MAX_SKIP_S`` after it last ran, it waits its turn."""
    if local.backend.name != "nixl":
        pytest.skip("Mooncake's progress() never takes a lock")
    from dsa_bridge.transfer.backends import nixl

    monkeypatch.setattr(nixl, "PROGRESS_MAX_SKIP_S", 0.2)
    agent_lock, done = local.backend._lock, []

    def progress() -> threading.Thread:
        thread = threading.Thread(target=lambda: (local.backend.progress(), done.append(1)))
        thread.start()
        return thread

    local.backend.progress()  # runs: the agent is free
    agent_lock.acquire()  # a write's post
    try:
        skipped = progress()
        skipped.join(5)
        assert not skipped.is_alive() and done == [1]  # returned while the lock was held
        time.sleep(0.25)
        waiting = progress()
        waiting.join(0.2)
        assert waiting.is_alive() and done == [1]  # past the bound: it queues for the lock
    finally:
        agent_lock.release()
    waiting.join(5)
    assert not waiting.is_alive() and done == [1, 1]
    local.backend.progress()  # free again: taken and released
    assert agent_lock.acquire_if_free()
    agent_lock.release()


BAD_WRITES = {
    "unequal sizes": lambda s, d, n: (s, d[:-1], n),
    "empty": lambda s, d, n: (s[:0], d[:0], n[:0]),
    "zero length": lambda s, d, n: (s, d, np.where(np.arange(len(n)) == 1, U64(0), n)),
    "null source": lambda s, d, n: (np.where(np.arange(len(s)) == 2, U64(0), s), d, n),
    "float dtype": lambda s, d, n: (s.astype(np.float64), d, n),
    "2-D": lambda s, d, n: (s.reshape(1, -1), d, n),
    "negative int64": lambda s, d, n: (s.astype(np.int64), -d.astype(np.int64), n),
    "overlapping destinations": lambda s, d, n: (s, np.full(len(d), d[0], U64), n),
    "source outside every local region": lambda s, d, n: (s + U64(1 << 40), d, n),
}


@pytest.mark.parametrize("case", sorted(BAD_WRITES))
def test_bad_write_arguments_refused_before_the_engine(connected, case: str) -> None:
    local, peer, handle = connected
    src, dst, length = dsa_runs(np.random.default_rng(4), 4, local, peer)
    with engine_forbidden(local.backend), pytest.raises(BackendError):
        local.backend.write(handle, *BAD_WRITES[case](src, dst, length), timeout_s=5)


@pytest.mark.parametrize("timeout_s", [0, -1, float("nan"), float("inf")])
def test_bad_timeout_refused(connected, timeout_s: float) -> None:
    local, peer, handle = connected
    src, dst, length = dsa_runs(np.random.default_rng(5), 2, local, peer)
    with engine_forbidden(local.backend), pytest.raises(BackendError, match="timeout_s"):
        local.backend.write(handle, src, dst, length, timeout_s=timeout_s)


def test_unknown_peer_refused(connected) -> None:
    local, peer, _ = connected
    src, dst, length = dsa_runs(np.random.default_rng(6), 2, local, peer)
    with engine_forbidden(local.backend), pytest.raises(BackendError, match="unknown peer"):
        local.backend.write("127.0.0.1:1", src, dst, length, timeout_s=5)


@pytest.mark.parametrize("metadata", [b"", b"garbage", b"127.0.0.1:99999", b"host:123"])
def test_malformed_peer_metadata_refused(local, metadata: bytes) -> None:
    with pytest.raises(BackendError, match="connect"):
        local.backend.connect(metadata)


def test_nixl_metadata_with_a_corrupt_agent_part_is_refused(local, peer) -> None:
    if local.backend.name != "nixl":
        pytest.skip("Mooncake's metadata is a session id: covered by the test above")
    with pytest.raises(BackendError, match="add_remote_agent.*nixl"):
        local.backend.connect(peer.metadata[:-40])


