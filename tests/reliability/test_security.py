"""A peer can only direct writes into the buffers it announced, and only into its own requests.

A decode node that skips its own checks sends page ids beyond its buffers, negative, page 0, and
the int64/uint64 extremes (whose address arithmetic would overflow): each is refused before the
engine is called, the canaries around every buffer stay intact, and the node keeps serving. For
any page list at all, the planner either refuses it or produces writes that lie inside the
announced buffers. A decode node cannot abort another's request, a room announced twice fails
without releasing pages a write may still reach, and room ids outside SGLang's 63-bit range are
refused (the launcher's prefill role used to crash on them).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsa_bridge.plugin import DSALayout
from dsa_bridge.transfer import protocol
from dsa_bridge.transfer.decode import DecodeNode
from dsa_bridge.transfer.handshake import pool_buffers
from dsa_bridge.transfer.launcher.drivers import count_mismatches, fill_request, reset_pages, sentinel_intact
from dsa_bridge.transfer.plan import PlanError, pair_buffers, plan_writes
from dsa_bridge.transfer.prefill import PrefillNode
from dsa_bridge.transfer.request import KVPoll

from ..transfer.fake_backend import FakeBackend
from ..transfer.helpers import wait_for
from .helpers import SMALL, make_pool, settled

CATEGORY = "bad inputs tried"
LAYOUT = DSALayout.from_hf_config(SMALL)
PAGES = 24  # usable pages of every pool here; ids 1..24 are valid, 25 is the first beyond
GUARD = 64
INT64_MIN, INT64_MAX, UINT64_MAX = -(2**63), 2**63 - 1, 2**64 - 1

ESCAPES = {
    "first beyond": [PAGES + 1],
    "far beyond among valid ones": [1, 2, 10**9],
    "page 0": [0, 1],
    "negative": [3, -1],
    "int64 min": [INT64_MIN],
    "int64 max": [INT64_MAX],
    "address overflow": [2**62],
    "uint64 wraps to negative": [2**63],
    "uint64 max": [UINT64_MAX],
    "uint64 max among valid ones": [1, UINT64_MAX],
}


@pytest.fixture
def nodes():
    prefill = PrefillNode(make_pool(LAYOUT, PAGES, guard_bytes=GUARD, sentinel=False),
                          FakeBackend(), heartbeat_s=0.1)
    decode = DecodeNode(make_pool(LAYOUT, PAGES, guard_bytes=GUARD), FakeBackend(),
                        prefill.endpoint, heartbeat_s=0.1)
    yield prefill, decode
    decode.close()
    prefill.close()


def rogue_request(decode: DecodeNode, room: int, pages: list[int]):
    """RequestPages straight onto the wire, as a decode node without its own checks would."""
    receiver = decode.receiver(room)
    receiver.page_ids = np.ones(1, dtype=np.int64)
    receiver.state.advance(KVPoll.WaitingForInput, 0.0)
    decode._loop.send(decode.peers[0].socket, protocol.RequestPages(room, pages, 64))
    return receiver


def serve(prefill: PrefillNode, decode: DecodeNode, room: int, pages: np.ndarray):
    fill_request(prefill.pool, room, pages)
    sender = prefill.sender(room)
    sender.init(pages.size)
    sender.send(pages)
    receiver = decode.receiver(room)
    receiver.init(pages)
    wait_for(lambda: settled(receiver), 20, f"room {room}")
    return receiver


@pytest.mark.parametrize("pages", ESCAPES.values(), ids=ESCAPES.keys())
def test_page_ids_outside_the_announced_buffers_never_reach_the_engine(nodes, pages, ledger):
    prefill, decode = nodes
    sender = prefill.sender(1)  # the application is ready to write whatever decode asks
    sender.init(len(pages))
    sender.send(np.arange(1, len(pages) + 1))
    receiver = rogue_request(decode, 1, pages)
    wait_for(lambda: settled(receiver), 20, "the refusal")
    ledger.record(tried=1, failed=1)
    assert receiver.poll() == KVPoll.Failed
    assert "bad pages: dst_pages" in receiver.state.reason
    assert prefill.backend.writes == 0
    assert decode.pool.canaries_intact()
    assert sentinel_intact(decode.pool, np.arange(1, PAGES + 1))
    good = serve(prefill, decode, 2, np.array([4, 5, 6]))  # both nodes keep serving
    assert good.poll() == KVPoll.Success
    assert count_mismatches(decode.pool, 2, np.array([4, 5, 6])) == 0


PLAN_SRC = make_pool(LAYOUT, PAGES, sentinel=False)
PLAN_DST = make_pool(LAYOUT, PAGES, sentinel=False)


PAGE_IDS = st.lists(st.one_of(st.integers(-2, PAGES + 2), st.integers(INT64_MIN, UINT64_MAX)),
                    max_size=12)


@settings(max_examples=400, deadline=None)
@given(src=PAGE_IDS, dst=PAGE_IDS)
def test_planned_writes_stay_inside_the_announced_buffers(src, dst):
    pairs = pair_buffers(pool_buffers(PLAN_SRC), pool_buffers(PLAN_DST))
    try:
        plan = plan_writes(pairs, src, dst)
    except PlanError:
        ok = (len(src) == len(dst) and src and all(1 <= p <= PAGES for p in src + dst)
              and len(set(src)) == len(src) and len(set(dst)) == len(dst))
        assert not ok, "a valid request was refused"
        return
    for addrs, side in ((plan.dst, "dst"), (plan.src, "src")):
        buffers = [getattr(p, side) for p in pairs]
        for addr, length in zip(addrs.tolist(), plan.length.tolist(), strict=True):
            assert any(b.ptr + b.item_len <= addr and addr + length <= b.ptr + b.nbytes
                       for b in buffers), f"{side} write {addr:#x}+{length} escapes"


def test_a_decode_node_cannot_abort_another_ones_request(nodes, ledger):
    prefill, decode = nodes
    with DecodeNode(make_pool(LAYOUT, PAGES), FakeBackend(), prefill.endpoint) as other:
        receiver = decode.receiver(7)
        receiver.init([1, 2])
        wait_for(lambda: not prefill.incoming.empty(), 10, "the room at prefill")
        other._loop.send(other.peers[0].socket, protocol.Abort(7, "not mine"))
        wait_for(lambda: prefill.counters.bad_messages == 1, 10, "the abort dropped")
        fill_request(prefill.pool, 7, np.array([3, 4]))
        sender = prefill.sender(7)
        sender.init(2)
        sender.send([3, 4])
        wait_for(lambda: settled(receiver), 20, "the request")
    ledger.record(tried=1, ok=1)
    assert receiver.poll() == KVPoll.Success
    assert count_mismatches(decode.pool, 7, np.array([1, 2])) == 0


def test_a_room_announced_twice_fails_before_its_pages_can_be_reused(nodes, ledger):
    """The application writes the room after decode re-announced it: decode must not have
    released the pages (it did, when prefill merely refused the second announcement)."""
    prefill, decode = nodes
    sender = prefill.sender(3)
    receiver = decode.receiver(3)
    receiver.init([1, 2])
    wait_for(lambda: receiver.poll() == KVPoll.WaitingForInput
             and prefill._requests.requests[3].destinations is not None, 10,
             "the room at prefill")
    decode._loop.send(decode.peers[0].socket, protocol.RequestPages(3, [5, 6], 128))
    wait_for(lambda: settled(receiver), 10, "the duplicate's verdict")
    assert receiver.poll() == KVPoll.Failed and "duplicate room 3" in receiver.state.reason
    wait_for(receiver.can_release, 10, "the pages released")
    reset_pages(decode.pool, np.array([1, 2]))  # reused
    fill_request(prefill.pool, 3, np.array([7, 8]))
    sender.init(2)
    sender.send([7, 8])
    wait_for(lambda: settled(sender), 10, "the prefill side")
    ledger.record(tried=1, failed=1)
    assert sender.poll() == KVPoll.Failed and prefill.backend.writes == 0
    assert sentinel_intact(decode.pool, np.array([1, 2, 5, 6]))


@pytest.mark.parametrize("room", [-1, 2**63, UINT64_MAX])
def test_room_ids_outside_63_bits_are_refused(nodes, room, ledger):
    prefill, decode = nodes
    receiver = rogue_request(decode, room, [1])
    wait_for(lambda: settled(receiver), 10, "the refusal")
    ledger.record(tried=1, failed=1)
    assert "is not in 0..2**63-1" in receiver.state.reason
    assert prefill.incoming.empty()
