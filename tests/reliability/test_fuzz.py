"""Random requests, valid and invalid, into pools fenced with canary guard bytes.

Thousands of requests run through a prefill and a decode node over the in-process memmove
engine, and a smaller run over each real engine; both again with compact pools (index-sharing
layers without an indexer buffer), whose canaries fence only the buffers that exist. Valid
requests (random fragmented pages, random chunking) must arrive byte-exact. Invalid ones
(out-of-range, page-0, negative and int64/uint64 extreme page ids, empty and duplicate page lists,
wrong page counts, overflowing and empty chunks, sends before init, aborts of unknown rooms) must
be refused before any byte moves: the engine
sees exactly the valid requests' chunks, every page no valid request owns keeps the sentinel, and
the canaries around every buffer of both pools never change.
"""

from __future__ import annotations

import numpy as np
import pytest

from dsa_bridge.plugin import DSALayout
from dsa_bridge.transfer import protocol
from dsa_bridge.transfer.backends import BACKENDS, create_backend
from dsa_bridge.transfer.decode import DecodeNode
from dsa_bridge.transfer.launcher.drivers import (
    count_mismatches,
    fill_request,
    request_bytes,
    reset_pages,
    sentinel_intact,
)
from dsa_bridge.transfer.prefill import PrefillNode
from dsa_bridge.transfer.request import KVPoll

from ..transfer.fake_backend import FakeBackend
from ..transfer.helpers import wait_for
from .helpers import DEEPSEEK, GLM_COMPACT, SMALL, SMALL_SHARED, make_pool, settled

CATEGORY = "bad inputs tried"
GUARD = 64
INT64_MAX, UINT64_MAX, INT64_MIN = 2**63 - 1, 2**64 - 1, -(2**63)

# kind -> (share of the cases, the reason a refused request ends with; None = refused locally)
KINDS = {
    "valid": (40, ""),
    "dst beyond": (6, "beyond the registered"),
    "dst page 0": (5, "page 0 is padding"),
    "dst negative": (5, "page 0 is padding"),
    "dst extreme": (5, "bad pages: dst_pages"),
    "dst repeated": (5, "more than once"),
    "dst empty": (3, "is empty"),
    "src beyond": (5, "bad pages"),
    "src page 0": (4, "bad pages"),
    "src repeated": (4, "bad pages"),
    "page count": (5, "page count mismatch"),
    "chunk overflow": (4, "does not fit"),
    "empty chunk": (3, "does not fit"),
    "local bad pages": (3, None),
    "send before init": (2, None),
    "unknown room abort": (1, None),
    "duplicate room": (3, "duplicate room"),
}


class Harness:
    """A prefill and a decode node, both pools fenced with canaries; runs batches of cases."""

    def __init__(self, layout: DSALayout, engine, pages: int, seed: int,
                 decode_layout: DSALayout | None = None):
        self.rng = np.random.default_rng(seed)
        self.prefill = PrefillNode(make_pool(layout, pages, guard_bytes=GUARD, sentinel=False),
                                   engine(), heartbeat_s=0.1)
        self.decode = DecodeNode(make_pool(decode_layout or layout, pages, guard_bytes=GUARD),
                                 engine(), self.prefill.endpoint, heartbeat_s=0.1)
        self.limit = self.decode.pool.num_kv_pages
        self.next_room = 1
        self.writes = 0  # engine writes the valid cases account for
        self.tried = self.ok = self.refused = self.bytes = self.lost = self.unknown_aborts = 0
        kinds = list(KINDS)
        weights = np.array([KINDS[k][0] for k in kinds], dtype=float)
        self.kinds, self.weights = kinds, weights / weights.sum()

    def close(self) -> None:
        self.decode.close()
        self.prefill.close()

    def engine_writes(self) -> int:
        """Chunks the engine wrote or failed (a refused request never reaches it)."""
        counters = self.prefill.counters.snapshot()
        return counters["chunks"] + counters["engine_failures"]

    def pages(self, free: list[int], count: int) -> np.ndarray:
        taken = [free.pop(int(self.rng.integers(len(free)))) for _ in range(count)]
        return np.array(taken, dtype=np.int64)

    def batch(self, size: int) -> None:
        src_free, dst_free = list(range(1, self.limit)), list(range(1, self.limit))
        cases = []
        for _ in range(size):
            kind = self.kinds[int(self.rng.choice(len(self.kinds), p=self.weights))]
            count = int(self.rng.integers(1, 6))
            if count > min(len(src_free), len(dst_free)):
                break
            room, self.next_room = self.next_room, self.next_room + 1
            cases.append(self.start(kind, room, self.pages(src_free, count),
                                    self.pages(dst_free, count)))
        live = [c for c in cases if c[2] is not None]
        wait_for(lambda: settled(*(c[2] for c in live)), 60, "every request of a batch")
        self.check(cases)

    def start(self, kind: str, room: int, src: np.ndarray, dst: np.ndarray):
        """Start one case; returns (kind, dst pages, receiver or None, chunks)."""
        self.tried += 1
        if kind == "unknown room abort":  # prefill refuses; decode drops the unknown room's report
            self.unknown_aborts += 1
            self.decode._loop.send(self.decode.peers[0].socket, protocol.Abort(10**9 + room, "fuzz"))
            return kind, dst, None, 0
        if kind == "local bad pages":
            bad = [0, *dst.tolist()] if room % 2 else [*dst.tolist(), self.limit]
            receiver = self.decode.receiver(room)
            with pytest.raises(ValueError):
                receiver.init(bad)
            receiver.abort("fuzz")
            self.decode.forget(receiver)
            return kind, dst, None, 0
        sender = self.prefill.sender(room)
        if kind == "send before init":
            with pytest.raises(ValueError, match="send before init"):
                sender.send(src)
            sender.abort("fuzz")
            return kind, dst, None, 0
        wire = dst.tolist()
        if kind == "dst beyond":
            wire[-1] = self.limit + int(self.rng.integers(0, 10**6))
        elif kind == "dst page 0":
            wire[0] = 0
        elif kind == "dst negative":
            wire[-1] = -int(self.rng.integers(1, 10**6))
        elif kind == "dst extreme":  # a uint64 id wraps to a negative int64: never a page
            wire[-1] = [INT64_MAX, INT64_MIN, UINT64_MAX, 2**63][int(self.rng.integers(4))]
        elif kind == "dst repeated":
            wire.append(wire[0])
        elif kind == "dst empty":
            wire = []
        chunks = self.send(kind, sender, room, src)
        receiver = self.decode.receiver(room)
        if kind == "duplicate room":  # the same room announced twice by the same decode node
            receiver.init(dst)
            self.decode._loop.send(self.decode.peers[0].socket,
                                   protocol.RequestPages(room, wire[:1], 64))
        elif kind.startswith("dst"):  # a decode node that skips its own checks
            receiver.page_ids = np.asarray(wire or [1])
            receiver.state.advance(KVPoll.WaitingForInput, 0.0)
            self.decode._loop.send(self.decode.peers[0].socket,
                                   protocol.RequestPages(room, wire, 64 * len(wire)))
        else:
            receiver.init(dst)
        return kind, dst, receiver, chunks

    def send(self, kind: str, sender, room: int, src: np.ndarray) -> int:
        """Queue the prefill side of a case; returns the engine writes a valid case makes."""
        if kind == "duplicate room":
            return 0
        fill_request(self.prefill.pool, room, src)
        sender.init(src.size + (kind == "page count"))
        bad = src.copy()
        if kind == "src beyond":
            bad[-1] = self.limit + int(self.rng.integers(0, 1000))
        elif kind == "src page 0":
            bad[0] = 0
        elif kind == "src repeated" and src.size > 1:
            bad[-1] = bad[0]
        elif kind == "src repeated":
            bad = np.array([0])
        if kind == "chunk overflow":
            sender.send(np.concatenate([src, [src[0]]]))
        elif kind == "empty chunk":
            sender.send(np.array([], dtype=np.int64))
        elif kind.startswith("src"):
            sender.send(bad)
        else:
            parts = [p for p in np.array_split(src, int(self.rng.integers(1, 4))) if p.size]
            for part in parts:
                sender.send(part)
            return len(parts) if kind == "valid" else 0
        return 0

    def check(self, cases) -> None:
        pool = self.decode.pool
        used = []
        for kind, dst, receiver, chunks in cases:
            self.writes += chunks
            reason = KINDS[kind][1]
            if kind == "valid":
                assert receiver.poll() == KVPoll.Success, receiver.state.reason
                lost = count_mismatches(pool, receiver.room, dst, receiver.components)
                self.lost += lost
                self.bytes += request_bytes(pool, dst.size, receiver.components)
                self.ok += 1
                used.append(dst)
                assert lost == 0
            elif receiver is not None:
                assert receiver.poll() == KVPoll.Failed, kind
                assert reason in receiver.state.reason, (kind, receiver.state.reason)
                self.refused += 1
            else:
                self.refused += 1
        # the engine saw exactly the valid chunks, and no byte outside valid requests' pages
        wait_for(lambda: self.engine_writes() == self.writes, 10, "the engine's count")
        assert self.engine_writes() == self.writes
        valid = np.concatenate(used) if used else np.zeros(0, dtype=np.int64)
        free = np.setdiff1d(np.arange(1, self.limit), valid)
        assert sentinel_intact(pool, free)
        assert pool.canaries_intact() and self.prefill.pool.canaries_intact()
        reset_pages(pool, valid)
        for _, _, receiver, _ in cases:
            if receiver is not None:
                wait_for(receiver.can_release, 10, "pages released")
                self.decode.forget(receiver)


def run(harness: Harness, total: int, batch: int, ledger) -> None:
    try:
        while harness.tried < total:
            harness.batch(min(batch, total - harness.tried))
        # prefill answers an unknown room's abort, and decode counts that answer, asynchronously:
        # the last batch's may still be on its way
        wait_for(lambda: harness.decode.counters.bad_messages >= harness.unknown_aborts, 30,
                 "decode counting prefill's answer to every unknown room's abort",
                 detail=lambda: f"{harness.decode.counters.bad_messages} counted of "
                                f"{harness.unknown_aborts} aborts")
    finally:
        ledger.record(tried=harness.tried - harness.ok, ok=harness.ok, failed=harness.refused,
                      bytes_verified=harness.bytes, bytes_lost=harness.lost)
        harness.close()
    bad = harness.decode.counters.bad_messages
    assert bad == harness.unknown_aborts, f"{bad} bad messages, {harness.unknown_aborts} aborts"
    assert harness.ok > total // 4 and harness.refused > total // 3


def test_thousands_of_random_requests_over_the_memmove_engine(ledger):
    layout = DSALayout.from_hf_config(SMALL)
    run(Harness(layout, FakeBackend, pages=96, seed=5), total=3000, batch=40, ledger=ledger)


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_requests_over_a_real_engine(backend, ledger):
    run(Harness(DEEPSEEK, lambda: create_backend(backend), pages=48, seed=6), total=160,
        batch=24, ledger=ledger)


@pytest.mark.parametrize("prefill_layout", ["uniform", "compact"])
def test_random_requests_into_a_compact_pool_over_the_memmove_engine(prefill_layout, ledger):
    compact = DSALayout.from_hf_config(SMALL_SHARED, indexer_layout="compact")
    source = DSALayout.from_hf_config(SMALL_SHARED, indexer_layout=prefill_layout)
    run(Harness(source, FakeBackend, pages=96, seed=7, decode_layout=compact), total=400,
        batch=40, ledger=ledger)


@pytest.mark.parametrize("backend", BACKENDS)
def test_random_requests_between_compact_pools_over_a_real_engine(backend, ledger):
    run(Harness(GLM_COMPACT, lambda: create_backend(backend), pages=32, seed=8), total=60,
        batch=20, ledger=ledger)
