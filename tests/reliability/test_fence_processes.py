"""The fence with real engines in real processes: a prefill frozen (SIGSTOP) mid-write for
longer than decode's peer timeout, then resumed.

The decode node (this process) is fed by two ``dsa-bridge prefill`` processes: the victim, whose
every write lands half, then pauses 3 s before the rest (the fault injection of
``tests/faulty.py``), and a healthy one. The victim is frozen in that pause; decode
fails the request when its heartbeats stop. The decode pool is small: the next request needs
pages only the failed one holds (the allocator hands freed pages out again), so releasing them
before the victim's write is over would give the late bytes to the new request. The test holds
the victim frozen well past the 1 s after which decode used to release the pages, resumes it,
and then checks that the new request's bytes, the canaries and the sentinel of every free page
are intact; that the failed request's pages were quarantined (counted) and released only after
the victim answered decode's new handshake; and that the victim serves again.
"""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest

from dsa_bridge.transfer.backends import BACKENDS, create_backend
from dsa_bridge.transfer.decode import DecodeNode
from dsa_bridge.transfer.launcher.drivers import count_mismatches, reset_pages, sentinel_intact
from dsa_bridge.transfer.launcher.page_allocator import PageAllocator
from dsa_bridge.transfer.request import KVPoll
from tests.faulty import DELAY_ENV

from ..transfer.helpers import wait_for
from .helpers import DEEPSEEK, buffer_matches, buffer_untouched, make_pool, settled
from .netns import loopback_hosts
from .procs import listening, prefill

CATEGORY = "faults injected"
LO = loopback_hosts(1)[0]
NODE = ("--pool-tokens", str(64 * 48), "--request-timeout", "120")
FIRST, LAST = DEEPSEEK.layer_ids[0], DEEPSEEK.layer_ids[-1]
PAGE_BYTES = (DEEPSEEK.kv_page_bytes + DEEPSEEK.index_page_bytes) * DEEPSEEK.num_layers
DELAY_S = 3.0  # the victim's pause between the two halves of every write
FROZEN_S = 3.0  # how long the victim stays frozen after decode failed its request
VICTIM_PAGES, NEW_PAGES = 10, 12  # of a 16-page pool: the new request needs the victim's pages


class Pages:
    """The application's side of the decode pool: allocate, and release only what
    ``can_release`` allows (refilled with the sentinel, as the roles do)."""

    def __init__(self, node: DecodeNode):
        self.node = node
        self.allocator = PageAllocator(node.pool.num_kv_pages, seed=3)
        self.held: dict[int, tuple[object, np.ndarray]] = {}
        self.released_at: dict[int, float] = {}

    def alloc(self, count: int) -> np.ndarray | None:
        return self.allocator.alloc(count)

    def hold(self, receiver, pages: np.ndarray) -> None:
        self.held[receiver.room] = (receiver, pages)

    def release_failed(self) -> None:
        """Release every failed request the node lets go (successful ones are checked first)."""
        for room, (receiver, _) in list(self.held.items()):
            if receiver.poll() == KVPoll.Failed and receiver.can_release():
                self.release(room)

    def release(self, room: int) -> None:
        receiver, pages = self.held.pop(room)
        self.released_at[room] = time.monotonic()
        reset_pages(self.node.pool, pages)
        self.allocator.free(pages)
        self.node.forget(receiver)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_frozen_prefill_resuming_writes_nothing_into_reused_pages(backend, procs, ledger):
    victim = prefill(procs, LO, backend, *NODE, name="victim", env={DELAY_ENV: str(int(DELAY_S * 1000))})
    other = prefill(procs, LO, backend, *NODE, name="other")
    listening(procs, victim, other)
    node = DecodeNode(make_pool(pages=16, guard_bytes=64), create_backend(backend),
                      [victim.endpoint, other.endpoint], peer_timeout_s=2.0,
                      request_timeout_s=90.0, in_flight_grace_s=5.0)
    with node:
        pool = node.pool
        pages = Pages(node)
        first_pages = pages.alloc(VICTIM_PAGES)
        first = node.receiver(1, prefill=victim.endpoint)
        first.init(first_pages, VICTIM_PAGES * 64)
        pages.hold(first, first_pages)
        wait_for(lambda: buffer_matches(pool, 1, first_pages, FIRST, "kv"), 60,
                 "the first half of the victim's write")
        victim.signal(signal.SIGSTOP)
        assert buffer_untouched(pool, first_pages, LAST, "index"), "the write was not mid-way"
        wait_for(lambda: first.poll() == KVPoll.Failed, 20, "decode failing the frozen request")
        assert "unreachable" in first.state.reason
        failed_at = time.monotonic()
        held_frozen = node.held_pages()

        new, new_pages = None, None
        resumed_at = held_at_resume = None
        deadline = failed_at + 120
        while time.monotonic() < deadline:
            pages.release_failed()
            if new is None and (new_pages := pages.alloc(NEW_PAGES)) is not None:
                new = node.receiver(2, prefill=other.endpoint)
                new.init(new_pages, NEW_PAGES * 64)
                pages.hold(new, new_pages)
            now = time.monotonic()
            if resumed_at is None and now > failed_at + FROZEN_S:
                held_at_resume = node.held_pages()
                victim.signal(signal.SIGCONT)
                resumed_at = now
            # done once the new request settled and the victim's paused write has certainly
            # ended (its pause is DELAY_S, a few seconds more for the resumed process)
            if (resumed_at is not None and new is not None and settled(new)
                    and now > resumed_at + DELAY_S + 3.0):
                break
            time.sleep(0.005)
        assert new is not None and settled(new), "the new request never got its pages"
        assert new.poll() == KVPoll.Success, new.state.reason
        lost = count_mismatches(pool, 2, new_pages)
        assert lost == 0, f"{lost} bytes of the new request were overwritten by the late write"
        assert pool.canaries_intact()
        pages.release(2)
        assert sentinel_intact(pool, pages.allocator.free_list())

        c = node.counters.snapshot()
        assert held_frozen == held_at_resume == VICTIM_PAGES  # quarantined while frozen
        assert pages.released_at[1] > resumed_at, "released before the victim resumed"
        assert c.get("quarantines") == 1 and c.get("pages_quarantined") == VICTIM_PAGES
        assert c.get("quarantine_expiries") == 0 and c.get("peer_recoveries", 0) >= 1
        assert node.peers[0].alive

        # the victim came back through the new handshake: it serves new requests again
        again_pages = pages.alloc(4)
        again = node.receiver(3, prefill=victim.endpoint)
        again.init(again_pages, 4 * 64)
        wait_for(lambda: settled(again), 60, "a request to the recovered victim")
        assert again.poll() == KVPoll.Success, again.state.reason
        lost += count_mismatches(pool, 3, again_pages)
        assert lost == 0 and pool.canaries_intact()
    ledger.record(tried=1, ok=2, failed=1, bytes_verified=(NEW_PAGES + 4) * PAGE_BYTES,
                  bytes_lost=lost)
