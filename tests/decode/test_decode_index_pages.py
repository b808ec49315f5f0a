"""Decode's own indexer pages, over the real engines: a decode whose application holds the KV and
the indexer in different pools names both page lists (``init(..., index_page_ids=)``; sglang's
HiSparse decode: KV in a host pool whose page 0 is a page, ``kv_page_zero``, the indexer in the
device pool). Prefill writes each cache into its own pages, byte-exact, checksums verified at
each, and the KV layers decode keeps with its indexer (``kv_on_index_pages``: HiSparse's draft
model KV) into the indexer's pages; bad lists and layer sets are refused before any byte moves.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from dsa_bridge.transfer.backends import create_backend
from dsa_bridge.transfer.decode import DecodeNode
from dsa_bridge.transfer.handshake import HandshakeError
from dsa_bridge.transfer.launcher.drivers import count_mismatches, fill_request, sentinel_intact
from dsa_bridge.transfer.plan import PlanError, check_destination, pair_buffers, plan_writes
from dsa_bridge.transfer.request import KVPoll
from tests.transfer.helpers import aux_tensors, ended, infos, make_pool, prefill_node

ROOM = 9
SRC = np.array([9, 3, 4, 5, 17])


def decode_node(engine, made, prefill, *, kv_page_zero=False, aux=None, kv_on_index_pages=()):
    node = DecodeNode(make_pool(size=64 * 24, sentinel=True), create_backend(engine), prefill.endpoint,
                      peer_timeout_s=2.0, heartbeat_s=0.1, checksums=True,
                      aux_buffers=infos(aux or []), kv_page_zero=kv_page_zero,
                      kv_on_index_pages=kv_on_index_pages)
    made.append(node)
    return node


def keys_of(pool, kind):
    return [key for key in pool.buffer_keys() if key[1] == kind]


@pytest.mark.parametrize(("kv_pages", "kv_page_zero"), [
    ([2, 11, 12, 13, 1], False),
    ([0, 3, 4, 5, 6], True),  # a KV pool without a padding page: its page 0 is written
])
def test_each_cache_lands_in_its_own_pages(engine, made, kv_pages, kv_page_zero):
    src_aux, dst_aux = aux_tensors(4), aux_tensors(4, fill=0xA5)
    for tensor in src_aux:
        tensor[2] = 0x3C
    prefill = prefill_node(engine, made, src_aux)
    decode = decode_node(engine, made, prefill, kv_page_zero=kv_page_zero, aux=dst_aux)
    fill_request(prefill.pool, ROOM, SRC)
    kv_pages, index_pages = np.array(kv_pages), np.array([20, 7, 8, 9, 14])
    receiver = decode.receiver(ROOM)
    receiver.init(kv_pages, num_tokens=5 * 64, aux_index=1, index_page_ids=index_pages)
    sender = prefill.sender(ROOM)
    sender.init(SRC.size, aux_index=2)
    sender.send(SRC[:2])
    sender.send(SRC[2:])
    ended(sender, receiver)
    assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
    pool = decode.pool
    assert count_mismatches(pool, ROOM, kv_pages, keys_of(pool, "kv")) == 0
    assert count_mismatches(pool, ROOM, index_pages, keys_of(pool, "index")) == 0
    others = np.setdiff1d(np.arange(pool.num_kv_pages), np.concatenate([kv_pages, index_pages]))
    assert sentinel_intact(pool, others)
    assert receiver.checksums_verified == SRC.size * len(pool.buffer_keys())
    for tensor in dst_aux:
        assert bool((tensor[1] == 0x3C).all()) and bool((tensor[0] == 0xA5).all())


@pytest.mark.parametrize("kv_page_zero", [False, True])
def test_kv_layers_kept_with_the_indexer_land_in_its_pages(engine, made, kv_page_zero):
    """sglang's HiSparse decode with a draft model: the draft's KV (here layers 2 and 3) on the
    device, in the indexer's pages; the target's KV in the host pool's pages."""
    prefill = prefill_node(engine, made)
    decode = decode_node(engine, made, prefill, kv_page_zero=kv_page_zero, kv_on_index_pages=(2, 3))
    fill_request(prefill.pool, ROOM, SRC)
    kv_pages = np.array([0 if kv_page_zero else 2, 11, 12, 13, 1])
    index_pages = np.array([20, 7, 8, 9, 14])
    receiver = decode.receiver(ROOM)
    receiver.init(kv_pages, num_tokens=5 * 64, index_page_ids=index_pages)
    sender = prefill.sender(ROOM)
    sender.init(SRC.size)
    sender.send(SRC[:3])
    sender.send(SRC[3:])
    ended(sender, receiver)
    assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
    pool = decode.pool
    host_kv = [key for key in keys_of(pool, "kv") if key[0] not in (2, 3)]
    at_index = [key for key in pool.buffer_keys() if key not in host_kv]
    assert {key[0] for key in at_index if key[1] == "kv"} == {2, 3}
    # each list's pages hold the request in its own buffers and the sentinel in the others
    assert count_mismatches(pool, ROOM, kv_pages, host_kv) == 0
    assert count_mismatches(pool, ROOM, index_pages, at_index) == 0
    others = np.setdiff1d(np.arange(pool.num_kv_pages), np.concatenate([kv_pages, index_pages]))
    assert sentinel_intact(pool, others)
    assert receiver.checksums_verified == SRC.size * len(pool.buffer_keys())


@pytest.mark.parametrize(("layers", "message"), [
    ((2, 9), "kv_on_index_pages: layer 9 is not a layer of decode's pool"),
    ((2, 2), "kv_on_index_pages names a layer twice"),
])
def test_bad_kv_layers_on_index_pages_are_refused(engine, made, layers, message):
    prefill = prefill_node(engine, made)
    with pytest.raises(ValueError, match=message):
        decode_node(engine, made, prefill, kv_on_index_pages=layers)


def test_prefill_refuses_a_hello_naming_a_layer_decode_lacks(engine, made):
    prefill = prefill_node(engine, made)
    decode = decode_node(engine, made, prefill, kv_on_index_pages=(3,))
    hello = msgspec.structs.replace(decode._handshaker.hello(epoch=7), kv_on_index_pages=[3, 4])
    with pytest.raises(HandshakeError, match="layer 4 is not a layer of decode's pool"):
        prefill._responder.pair(hello)
    pairs = prefill._responder.pair(decode._handshaker.hello(epoch=8)).pairs
    kv, index = pairs.split_index()
    assert [p.dst.layer_id for p in kv] == [0, 1, 2]
    assert [(p.dst.layer_id, p.dst.kind) for p in index] == [(0, "index"), (1, "index"),
                                                             (2, "index"), (3, "kv"), (3, "index")]


@pytest.mark.parametrize(("kv_pages", "index_pages", "kv_page_zero", "message"), [
    ([0, 3, 4], None, False, "page_ids contains page 0: page 0 is padding"),
    ([0, 3, 4], [7, 8, 9], False, "page_ids contains page 0: page 0 is padding"),
    ([0, 3, 4], None, True, "page_ids contains page 0: page 0 is padding"),  # (the indexer's)
    ([2, 3, 4], [7, 8], True, "index_page_ids has 2 pages but page_ids has 3"),
    ([2, 3, 4], [7, 0, 9], True, "index_page_ids contains page 0"),
    ([2, 3, 4], [7, 8, 99], False, "index_page_ids contains page 99, beyond the registered 25"),
    ([2, 3, 4], [7, 8, 7], False, "index_page_ids lists a page more than once"),
])
def test_bad_page_lists_are_refused_at_init(engine, made, kv_pages, index_pages, kv_page_zero,
                                           message):
    prefill = prefill_node(engine, made)
    decode = decode_node(engine, made, prefill, kv_page_zero=kv_page_zero)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        decode.receiver(ROOM).init(kv_pages, index_page_ids=index_pages)


def test_plans_write_each_cache_into_its_own_pages():
    pool, peer = make_pool(), make_pool()
    pairs = pair_buffers(pool.buffer_descriptors(), peer.buffer_descriptors())
    plan = plan_writes(pairs, [3, 4], [0, 1], [7, 9], kv_page_zero=True)
    by_dst = dict(zip(plan.dst.tolist(), plan.length.tolist(), strict=True))
    for pair in pairs:
        first = {"kv": 0, "index": 7}[pair.dst.kind]
        assert by_dst[pair.dst.ptr + first * pair.dst.item_len] == (
            2 if pair.dst.kind == "kv" else 1) * pair.dst.item_len
    assert plan.runs == 1 + 2  # one KV run, two indexer runs
    with pytest.raises(PlanError, match="dst_pages contains page 0"):
        plan_writes(pairs, [3, 4], [0, 1], [7, 9])
    with pytest.raises(PlanError, match="dst_pages contains page -1: ids must be >= 0"):
        plan_writes(pairs, [3, 4], [-1, 1], [7, 9], kv_page_zero=True)
    with pytest.raises(PlanError, match="index_pages contains page 0"):
        plan_writes(pairs, [3, 4], [1, 2], [0, 9], kv_page_zero=True)
    with pytest.raises(PlanError, match="index_pages has 1 pages but dst_pages has 2"):
        check_destination(pairs, [1, 2], [5])
    assert check_destination(pairs, [0, 2], [5, 6], kv_page_zero=True)[1].tolist() == [5, 6]
