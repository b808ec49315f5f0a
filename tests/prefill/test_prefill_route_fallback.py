"""A forced staged route that cannot be taken (no staging area on either side, or a page of
every buffer larger than a slice) sends the chunk direct and says so in the log once per decode
node, naming the flag to change; ``auto`` falls back silently (that is its choice to make)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from dsa_bridge.transfer.plan import BufferPair, PairTable, plan_chunk
from dsa_bridge.transfer.prefill.records import DecodePeer
from dsa_bridge.transfer.prefill.stager import Stager
from dsa_bridge.transfer.protocol import StagingArea
from tests.transfer.fake_backend import FakeBackend
from tests.transfer.helpers import make_pool

LOGGER = "dsa_bridge.transfer.prefill.stager"


@pytest.fixture
def engine():
    backend = FakeBackend()
    yield backend
    backend.close()


def decode_peer(pool, engine_peer: str, staging: StagingArea | None = None) -> DecodePeer:
    buffers = pool.buffer_descriptors()
    pairs = PairTable(BufferPair(b, b) for b in buffers)
    return DecodePeer(b"id-" + engine_peer.encode(), f"node-{engine_peer}", engine_peer, pairs,
                      0.0, staging=staging)


def route(stager: Stager, peer: DecodePeer) -> str:
    plan = plan_chunk(peer.pairs, np.array([1, 3]), np.array([2, 5]), last=False)
    return stager.route_for(peer, plan)


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_a_forced_staged_route_without_decodes_staging_is_logged_once_per_decode_node(
        engine, caplog):
    pool = make_pool()
    stager = Stager(pool, engine, lambda *a: None, route="staged")
    caplog.set_level(logging.WARNING, LOGGER)
    first, second = decode_peer(pool, "a"), decode_peer(pool, "b")
    assert [route(stager, first), route(stager, first), route(stager, second)] == ["direct"] * 3
    assert warnings(caplog) == [
        f"route staged forced, but chunks to decode node {peer.node} go direct: it offered no "
        f"staging area (its --staging-mib is 0)" for peer in (first, second)]
    stager.close()


def test_no_staging_here_or_a_page_larger_than_a_slice_is_logged_with_its_flag(engine, caplog):
    pool = make_pool()
    caplog.set_level(logging.WARNING, LOGGER)
    none_here = Stager(pool, engine, lambda *a: None, route="staged", staging_bytes=0)
    assert route(none_here, decode_peer(pool, "a")) == "direct"
    page_bytes = sum(b.item_len for b in pool.buffer_descriptors())
    small = StagingArea(ptr=1 << 20, slice_bytes=page_bytes - 1, slices=4)
    stager = Stager(pool, engine, lambda *a: None, route="staged")
    assert route(stager, decode_peer(pool, "b", small)) == "direct"
    assert warnings(caplog) == [
        "route staged forced, but chunks to decode node node-a go direct: this node has no "
        "staging area (--staging-mib 0)",
        f"route staged forced, but chunks to decode node node-b go direct: one page of every "
        f"buffer ({page_bytes} bytes) does not fit a staging slice ({page_bytes - 1} bytes; "
        f"raise --staging-mib)"]
    none_here.close()
    stager.close()


def test_auto_falls_back_silently(engine, caplog):
    pool = make_pool()
    stager = Stager(pool, engine, lambda *a: None, route="auto")
    caplog.set_level(logging.WARNING, LOGGER)
    assert route(stager, decode_peer(pool, "a")) == "direct"
    assert warnings(caplog) == []
    stager.close()
