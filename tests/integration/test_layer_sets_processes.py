"""Layer sets over the real engines, prefill in its own OS processes: GLM-5.2 uniform and compact.

The pairing matrix (prefill layout x decode layout x decode's indexer reads), byte-exact where it
is allowed, refused before any write (decode's pool still at its sentinel) where prefill lacks an
indexer decode reads; and pipeline stages: two ``dsa-bridge prefill --start-layer/--end-layer``
processes feeding one request, overlapping or missing ranges refused naming the layer.
"""

from __future__ import annotations

import numpy as np
import pytest

from dsa_bridge.plugin import DSALayout, DSATokenToKVPool, load_model_config
from dsa_bridge.transfer.backends import create_backend
from dsa_bridge.transfer.decode import DecodeNode
from dsa_bridge.transfer.handshake import HandshakeError
from dsa_bridge.transfer.launcher.drivers import count_mismatches, request_bytes, reset_pages, sentinel_intact
from dsa_bridge.transfer.request import KVPoll

from ..transfer.helpers import wait_for
from .processes import PrefillProcess

TOKENS = 64 * 24
GLM = load_model_config("glm-5.2")
PRODUCERS = (0, 1, 2, *range(6, 75, 4))
PAGES = [3, 4, 5, 11, 7]


def glm(indexer_layout: str = "uniform") -> DSALayout:
    return DSALayout.from_hf_config(GLM, kv_dtype="fp8_raw", indexer_layout=indexer_layout)


def decode_pool(indexer_layout: str = "uniform") -> DSATokenToKVPool:
    pool = DSATokenToKVPool.from_layout(glm(indexer_layout), size=TOKENS)
    reset_pages(pool, np.arange(pool.num_kv_pages))
    return pool


def start_prefill(tmp, backend, *extra):
    return PrefillProcess(tmp, backend, "--model", "glm-5.2", "--pool-tokens", str(TOKENS),
                          "--peer-timeout", "3", "--chunk-pages", "2", *extra)


@pytest.fixture(scope="module")
def prefills(backend, tmp_path_factory):
    """One uniform and one compact GLM-5.2 prefill process."""
    tmp = tmp_path_factory.mktemp("layer-sets")
    nodes = {}
    try:
        for layout in ("uniform", "compact"):
            nodes[layout] = start_prefill(tmp, backend, "--indexer-layout", layout)
        yield nodes
    finally:
        for node in nodes.values():
            node.stop()


def receive(node: DecodeNode, room: int, prefill=None):
    receiver = node.receiver(room, prefill)
    receiver.init(np.array(PAGES), num_tokens=len(PAGES) * 64)
    wait_for(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), 60.0, "request end")
    assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
    return receiver


def assert_exact(node: DecodeNode, receiver) -> None:
    pages = np.array(PAGES)
    assert count_mismatches(node.pool, receiver.room, pages, receiver.components) == 0
    assert receiver.nbytes == request_bytes(node.pool, len(PAGES), receiver.components)
    untouched = np.setdiff1d(np.arange(1, node.pool.num_kv_pages), pages)
    assert sentinel_intact(node.pool, untouched)


ACCEPTED = [
    ("uniform", "uniform", "held", 78),
    ("uniform", "uniform", "producers", 21),
    ("uniform", "compact", "held", 21),
    ("compact", "compact", "held", 21),
    ("compact", "uniform", "producers", 21),
]


@pytest.mark.parametrize("p_layout, d_layout, reads, indexers", ACCEPTED,
                         ids=[f"{p}->{d}-reads-{r}" for p, d, r, _ in ACCEPTED])
def test_allowed_pairs_are_byte_exact(backend, prefills, p_layout, d_layout, reads, indexers):
    pool = decode_pool(d_layout)
    index_reads = PRODUCERS if reads == "producers" else None
    with DecodeNode(pool, create_backend(backend), prefills[p_layout].endpoint,
                    index_reads=index_reads, peer_timeout_s=3.0) as node:
        receiver = receive(node, room=400 + ACCEPTED.index((p_layout, d_layout, reads, indexers)))
        index_layers = [lid for lid, kind in receiver.components if kind == "index"]
        assert len(index_layers) == indexers
        assert len(receiver.components) == 78 + indexers
        assert_exact(node, receiver)


def test_compact_prefill_to_a_uniform_decode_that_reads_all_is_refused(backend, prefills):
    pool = decode_pool("uniform")
    with pytest.raises(HandshakeError, match="layer 3: decode holds and reads its indexer, but layer 3 "
                                             "holds no indexer .* \\(it reuses layer 2's\\)"):
        DecodeNode(pool, create_backend(backend), prefills["compact"].endpoint, handshake_timeout_s=20)
    assert sentinel_intact(pool, np.arange(1, pool.num_kv_pages))


def test_uniform_to_compact_moves_13_6_percent_fewer_bytes(backend, prefills):
    sizes = {}
    for layout in ("uniform", "compact"):
        with DecodeNode(decode_pool(layout), create_backend(backend), prefills["uniform"].endpoint,
                        peer_timeout_s=3.0) as node:
            sizes[layout] = receive(node, room=500 + len(sizes)).nbytes
    assert round((1 - sizes["compact"] / sizes["uniform"]) * 100, 1) == 13.6


# ---- pipeline stages ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stages(backend, tmp_path_factory):
    """GLM-5.2 in three prefill processes: layers 0-38, 39-77 (compact), and 30-77."""
    tmp = tmp_path_factory.mktemp("stages")
    nodes = []
    try:
        for start, end, layout in ((0, 39, "uniform"), (39, 78, "compact"), (30, 78, "uniform")):
            nodes.append(start_prefill(tmp, backend, "--start-layer", str(start), "--end-layer",
                                       str(end), "--indexer-layout", layout))
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def test_two_stages_feed_one_request(backend, stages):
    first, second, _ = stages
    with DecodeNode(decode_pool("compact"), create_backend(backend),
                    [first.endpoint, second.endpoint], peer_timeout_s=3.0) as node:
        receiver = receive(node, room=600)
        assert receiver.finished == {first.endpoint, second.endpoint}
        assert len(receiver.components) == 78 + 21
        assert_exact(node, receiver)


def test_overlapping_stages_are_refused_at_the_request(backend, stages):
    first, _, overlapping = stages
    with DecodeNode(decode_pool("compact"), create_backend(backend),
                    [first.endpoint, overlapping.endpoint], peer_timeout_s=3.0) as node:
        with pytest.raises(ValueError, match="layer 30 is held by both prefill"):
            node.receiver(601)
        assert sentinel_intact(node.pool, np.arange(1, node.pool.num_kv_pages))


def test_a_missing_range_is_refused_at_the_handshake(backend, stages):
    first = stages[0]
    pool = decode_pool("compact")
    with pytest.raises(HandshakeError, match="layer 39 is held by none of the prefill nodes"):
        DecodeNode(pool, create_backend(backend), first.endpoint, handshake_timeout_s=20)
    assert sentinel_intact(pool, np.arange(1, pool.num_kv_pages))
