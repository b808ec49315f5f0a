"""Page shares over the real engines: several prefill nodes that each hold every layer and write
a share of a request's pages, which only they know (sglang's KV sharding: logical page ``l`` on
shard rank ``l % N`` as its local page ``l // N``; prefill CP's page split).

Each share chunk names the request's pages it wrote (``ChunkDone.positions``); decode counts
each writer's bytes by its share, checks each page is written by exactly one writer, verifies
the checksums of a share's pages, and succeeds only once every page was written. A writer whose
share ends before the request's last pages still sends its (empty) last chunk. Refused, with the
reason: a page left unwritten, a page written twice, a share into a decode that reads the whole
request from that prefill (and the reverse), and share chunks that do not continue their share.
"""

from __future__ import annotations

import numpy as np
import pytest

from dsa_bridge.transfer.launcher.drivers import count_mismatches, fill_request, sentinel_intact
from dsa_bridge.transfer.request import KVPoll

from .helpers import aux_tensors, decode_node, ended, prefill_node, wait_for

ROOM = 5
DST = np.array([3, 4, 10, 11, 12])  # decode's pages for the request's 5 pages
LOGICAL = np.array([6, 7, 8, 9, 10])  # the prefill's logical pages: page l on rank l % 2


def share(rank: int, positions: range) -> tuple[np.ndarray, np.ndarray]:
    """Shard rank ``rank``'s (local pages, positions) among the request's ``positions``."""
    at = np.array([p for p in positions if LOGICAL[p] % 2 == rank], dtype=np.int64)
    return LOGICAL[at] // 2 if at.size else np.zeros(0, np.int64), at


def sharded_prefills(engine, made, aux=None):
    prefills = [prefill_node(engine, made, aux) for _ in range(2)]
    for rank, prefill in enumerate(prefills):
        fill_request(prefill.pool, ROOM, *share(rank, range(5)))
    return prefills


def send_shares(senders, splits=((0, 4), (4, 5)), skip=None):
    """Each shard rank sends its share of each chunk ``[start, end)``; ``skip``: a position
    rank 1 leaves out."""
    for start, end in splits:
        for rank, sender in enumerate(senders):
            pages, at = share(rank, range(start, end))
            if rank == 1 and skip is not None:
                keep = at != skip
                pages, at = pages[keep], at[keep]
            sender.send_share(pages, at, end)


def test_two_share_writers_fill_the_request_byte_exact(engine, made):
    src_aux = aux_tensors(4)
    for tensor in src_aux:
        tensor[2] = 0x3C
    prefills = sharded_prefills(engine, made, src_aux)
    dst_aux = aux_tensors(4, fill=0xA5)
    decode = decode_node(engine, made, prefills, dst_aux)
    receiver = decode.receiver(ROOM, [p.endpoint for p in prefills], shares=True)
    receiver.init(DST, num_tokens=5 * 64, aux_index=1)
    senders = [p.sender(ROOM) for p in prefills]
    for sender in senders:
        sender.init(5, aux_index=2)
    send_shares(senders)  # rank 1's share ends at page 3: its last chunk is empty
    ended(receiver, *senders)
    assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
    assert [s.poll() for s in senders] == [KVPoll.Success] * 2
    assert count_mismatches(decode.pool, ROOM, DST) == 0
    assert sentinel_intact(decode.pool, np.setdiff1d(np.arange(1, decode.pool.num_kv_pages), DST))
    layout = decode.pool.layout
    page_bytes = (layout.kv_page_bytes + layout.index_page_bytes) * layout.num_layers
    aux_bytes = sum(t[0].nbytes for t in dst_aux)
    assert receiver.received == {prefills[0].endpoint: 3 * page_bytes + aux_bytes,
                                 prefills[1].endpoint: 2 * page_bytes}
    assert receiver.checksums_verified == 5 * 2 * layout.num_layers
    for tensor in dst_aux:
        assert bool((tensor[1] == 0x3C).all()) and bool((tensor[0] == 0xA5).all())


@pytest.mark.parametrize("fault, reason", [
    ("unwritten", "1 of the request's 5 pages were written by no prefill node (the first: page 3)"),
    ("twice", "was written by two prefill nodes"),
])
def test_a_page_unwritten_or_written_twice_fails_the_request(engine, made, fault, reason):
    prefills = sharded_prefills(engine, made)
    decode = decode_node(engine, made, prefills)
    receiver = decode.receiver(ROOM, [p.endpoint for p in prefills], shares=True)
    receiver.init(DST, num_tokens=5 * 64)
    senders = [p.sender(ROOM) for p in prefills]
    for sender in senders:
        sender.init(5)
    if fault == "unwritten":
        send_shares(senders, skip=3)
    else:  # once rank 0's pages are counted, rank 1 also writes page 0, rank 0's
        senders[0].send_share(*share(0, range(5)), 5)
        wait_for(lambda: receiver.received[prefills[0].endpoint], 10, "rank 0's chunk")
        senders[1].send_share(np.array([1, 3, 4]), np.array([0, 1, 3]), 5)
    ended(receiver, *senders)
    assert receiver.poll() == KVPoll.Failed
    assert reason in str(receiver.failure_exception())


def test_a_share_into_a_decode_reading_the_whole_request_fails_it(engine, made):
    prefills = sharded_prefills(engine, made)
    decode = decode_node(engine, made, prefills[:1])
    receiver = decode.receiver(ROOM, prefills[0].endpoint)  # not shares
    receiver.init(DST, num_tokens=5 * 64)
    sender = prefills[0].sender(ROOM)
    sender.init(5)
    sender.send_share(*share(0, range(5)), 5)
    ended(receiver)
    assert receiver.poll() == KVPoll.Failed
    assert "wrote a share of the request's pages, and decode reads the whole request" in str(
        receiver.failure_exception())


def test_a_whole_chunk_into_a_decode_reading_shares_fails_it(engine, made):
    prefills = sharded_prefills(engine, made)
    decode = decode_node(engine, made, prefills)
    receiver = decode.receiver(ROOM, [p.endpoint for p in prefills], shares=True)
    receiver.init(DST, num_tokens=5 * 64)
    sender = prefills[0].sender(ROOM)
    sender.init(5)
    sender.send(np.array([1, 2, 3, 4, 5]))
    ended(receiver)
    assert receiver.poll() == KVPoll.Failed
    assert "without naming its pages" in str(receiver.failure_exception())


def test_share_writers_must_each_hold_every_layer(engine, made):
    prefills = [prefill_node(engine, made) for _ in range(2)]
    decode = decode_node(engine, made, prefills)
    assert decode.receiver(1, [p.endpoint for p in prefills], shares=True).parts.shares
    with pytest.raises(ValueError, match="layer 0 is held by both"):
        decode.receiver(2, [p.endpoint for p in prefills])  # as stages: each layer twice


@pytest.mark.parametrize("calls, reason", [
    ([([2, 1], [1, 0], 2)], "must ascend within [0, 2)"),
    ([([1], [3], 2)], "must ascend within [0, 2)"),
    ([([1, 2], [0], 2)], "share chunk of 2 pages at 1 positions"),
    ([([1], [0], 2), ([2], [1], 2)], "through page 2 after 2 does not fit"),
    ([([1], [0], 6)], "through page 6 after 0 does not fit the request's 5 pages"),
    ([([1], [0], 1), ([2], [0], 3)], "must ascend within [1, 3)"),
    ([([1], [0], True)], "through must be an int"),
])
def test_share_chunks_that_do_not_continue_their_share_fail_the_request(engine, made, calls,
                                                                        reason):
    prefill = prefill_node(engine, made)
    sender = prefill.sender(ROOM)
    sender.init(5)
    for pages, positions, through in calls:
        sender.send_share(np.array(pages), np.array(positions), through)
    assert sender.poll() == KVPoll.Failed
    assert reason in str(sender.failure_exception())


def test_a_sender_writes_shares_or_whole_chunks_not_both(engine, made):
    prefill = prefill_node(engine, made)
    whole, shared = prefill.sender(1), prefill.sender(2)
    whole.init(5)
    shared.init(5)
    whole.send(np.array([1]))
    whole.send_share(np.array([2]), np.array([1]), 2)
    shared.send_share(np.array([2]), np.array([0]), 1)
    shared.send(np.array([3]))
    assert "a share of the pages after a whole chunk" in str(whole.failure_exception())
    assert "a whole chunk after a share of the pages" in str(shared.failure_exception())
