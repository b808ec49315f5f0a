"""Different attention-TP widths between prefill and decode, over the real engines.

A decode wider than prefill: several decode nodes each receive the whole request from one
prefill node (``RequestPages.copies``); prefill writes once every one of them announced its
pages, each chunk once to each, and succeeds once each received its last chunk. A prefill wider
than decode: decode reads the request from one prefill node and tells the others it has nothing
for them (``DecodeNode.nothing_to_send``); their senders end with their last chunk, writing
nothing. Byte-exact KV, indexer and aux on every decode node; the bad announcements (decode
nodes that disagree, nothing to send with pages) refused with their reason; a decode node
dropped mid-request fails the request on the other.
"""

from __future__ import annotations

import numpy as np
import pytest

from dsa_bridge.transfer import protocol
from dsa_bridge.transfer.launcher.drivers import count_mismatches, fill_request, sentinel_intact
from dsa_bridge.transfer.request import KVPoll

from .helpers import aux_tensors, decode_node, ended, prefill_node, wait_for

PAGE = 64
SRC = np.array([9, 3, 4, 5, 17])


def test_a_wider_decode_gets_the_whole_request_on_every_rank(engine, made):
    src_aux = aux_tensors(4)
    prefill = prefill_node(engine, made, src_aux)
    dst_aux = [aux_tensors(4, fill=0xA5), aux_tensors(4, fill=0xA5)]
    decodes = [decode_node(engine, made, [prefill], dst_aux[r]) for r in range(2)]
    fill_request(prefill.pool, 1, SRC)
    for tensor in src_aux:
        tensor[2] = 0x3C
    sender = prefill.sender(1)
    pages = [[2, 11, 12, 13, 1], [6, 7, 8, 14, 15]]
    receivers = [d.receiver(1) for d in decodes]
    receivers[0].init(pages[0], num_tokens=5 * PAGE, aux_index=1, copies=2)
    sender.init(SRC.size, aux_index=2)
    sender.send(SRC[:2])
    assert sender.poll() == KVPoll.Bootstrapping  # one of its two decode ranks announced
    receivers[1].init(pages[1], num_tokens=5 * PAGE, aux_index=3, copies=2)
    sender.send(SRC[2:])
    ended(sender, *receivers)
    assert [r.poll() for r in receivers] == [KVPoll.Success] * 2, receivers[0].failure_exception()
    assert sender.poll() == KVPoll.Success
    layout = prefill.pool.layout
    request_bytes = SRC.size * (layout.kv_page_bytes + layout.index_page_bytes) * layout.num_layers
    for decode, receiver, dst, aux, slot in zip(decodes, receivers, pages, dst_aux, (1, 3),
                                                strict=True):
        assert count_mismatches(decode.pool, 1, np.array(dst)) == 0
        untouched = np.setdiff1d(np.arange(1, decode.pool.num_kv_pages), dst)
        assert sentinel_intact(decode.pool, untouched)
        assert receiver.nbytes == request_bytes + sum(t[0].nbytes for t in aux)  # each once
        for tensor in aux:
            assert bool((tensor[slot] == 0x3C).all()) and bool((tensor[0] == 0xA5).all())
    assert prefill.counters.snapshot()["bytes"] >= 2 * request_bytes


def test_a_wider_prefill_writes_from_one_rank_and_the_others_end_empty(engine, made):
    prefills = [prefill_node(engine, made) for _ in range(2)]
    decode = decode_node(engine, made, prefills)
    senders = [p.sender(7) for p in prefills]
    fill_request(prefills[0].pool, 7, SRC)
    receiver = decode.receiver(7, prefills[0].endpoint)
    receiver.init([2, 11, 12, 13, 1], num_tokens=5 * PAGE)
    decode.nothing_to_send(7, [prefills[1].endpoint])
    wait_for(lambda: senders[1].poll() == KVPoll.WaitingForInput, 10, "the idle rank told")
    for sender in senders:  # sglang's prefill ranks each run the same request
        sender.init(SRC.size)
        sender.send(SRC[:3])
    assert senders[1].poll() == KVPoll.Transferring  # not before its last chunk
    for sender in senders:
        sender.send(SRC[3:])
    ended(receiver, *senders)
    assert [s.poll() for s in senders] == [KVPoll.Success] * 2
    assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
    assert count_mismatches(decode.pool, 7, np.array([2, 11, 12, 13, 1])) == 0
    assert prefills[1].counters.snapshot().get("bytes", 0) == 0
    assert decode.counters.snapshot().get("messages_dropped", 0) == 0  # nothing answered to it


def test_decode_ranks_that_disagree_fail_the_request(engine, made):
    prefill = prefill_node(engine, made)
    decodes = [decode_node(engine, made, [prefill]) for _ in range(2)]
    sender = prefill.sender(3)
    first, second = (d.receiver(3) for d in decodes)
    first.init([2, 3], num_tokens=2 * PAGE, copies=2)
    second.init([4, 5], num_tokens=3 * PAGE, copies=2, prefix_tokens=PAGE)
    ended(sender, first, second)
    assert "disagree on the prefix" in str(sender.failure_exception())
    assert "disagree on the prefix" in str(second.failure_exception())
    assert first.poll() == KVPoll.Failed


@pytest.mark.parametrize("gives_up_first", [False, True])
def test_a_rank_giving_up_before_its_pages_fails_the_request_on_the_other(engine, made,
                                                                           gives_up_first):
    prefill = prefill_node(engine, made)
    decodes = [decode_node(engine, made, [prefill]) for _ in range(2)]
    sender = prefill.sender(8)
    announced, gave_up = (d.receiver(8) for d in decodes)
    if not gives_up_first:
        announced.init([2, 3], num_tokens=2 * PAGE, copies=2)
    gave_up.abort("decode refused: no room in its pool")  # before its pages: Abort(before_pages)
    if gives_up_first:  # the other rank's pages arrive after prefill failed the request
        wait_for(lambda: sender.poll() == KVPoll.Failed, 10, "the sender failed")
        announced.init([2, 3], num_tokens=2 * PAGE, copies=2)
    ended(sender, announced)
    assert "no room in its pool" in str(sender.failure_exception())
    assert "no room in its pool" in str(announced.failure_exception())


def test_every_ranks_page_count_is_checked_against_an_early_init(engine, made):
    prefill = prefill_node(engine, made)
    decodes = [decode_node(engine, made, [prefill]) for _ in range(2)]
    sender = prefill.sender(9)
    sender.init(3)  # before any decode rank announced
    first, second = (d.receiver(9) for d in decodes)
    first.init([2, 3], num_tokens=2 * PAGE, copies=2)  # two pages where prefill has three
    second.init([4, 5, 6], num_tokens=3 * PAGE, copies=2)
    ended(sender, first, second)
    assert "prefill has 3 pages, decode allocated 2" in str(sender.failure_exception())
    assert first.poll() == second.poll() == KVPoll.Failed


def test_a_rank_dropped_mid_request_fails_it_on_the_other(engine, made):
    prefill = prefill_node(engine, made)
    decodes = [decode_node(engine, made, [prefill]) for _ in range(2)]
    fill_request(prefill.pool, 4, SRC)
    sender = prefill.sender(4)
    receivers = [d.receiver(4) for d in decodes]
    for receiver, dst in zip(receivers, ([1, 2, 3, 4, 6], [7, 8, 9, 10, 11]), strict=True):
        receiver.init(dst, num_tokens=5 * PAGE, copies=2)
    wait_for(lambda: sender.poll() == KVPoll.WaitingForInput, 10, "both ranks' pages")
    decodes[1].close()  # gone: its write fails, or prefill drops it after its peer timeout
    sender.init(SRC.size)
    sender.send(SRC[:2])  # the request's last chunk never comes: rank 0 cannot succeed
    ended(sender, receivers[0])  # long before the request timeout (60 s)
    assert sender.poll() == receivers[0].poll() == KVPoll.Failed
    assert sender.state.reason in str(receivers[0].failure_exception())


@pytest.mark.parametrize("message, reason", [
    (protocol.RequestPages(5, [1], PAGE, nothing_to_send=True), "nothing_to_send with pages"),
    (protocol.RequestPages(5, [1], PAGE, copies=0), "copies 0 is not in 1..64"),
    (protocol.RequestPages(5, [1], PAGE, copies=65), "copies 65 is not in 1..64"),
])
def test_bad_announcements_are_refused(engine, made, message, reason):
    prefill = prefill_node(engine, made)
    decode = decode_node(engine, made, [prefill])
    receiver = decode.receiver(5)  # to hear the refusal (sent for pages decode named)
    decode._loop.send(decode.peers[0].socket, message)
    sender = prefill.sender(5)
    if message.nothing_to_send:  # decode keeps nothing to tell: dropped as malformed
        wait_for(lambda: prefill.counters.snapshot().get("bad_messages", 0) == 1, 10, "the drop")
        assert sender.poll() == KVPoll.Bootstrapping
        return
    wait_for(lambda: receiver.poll() == KVPoll.Failed, 10, "the refusal")
    assert reason in str(receiver.failure_exception())


@pytest.mark.parametrize("copies", [0, 65, 1.0])
def test_bad_copies_never_leave_decode(engine, made, copies):
    prefill = prefill_node(engine, made)
    decode = decode_node(engine, made, [prefill])
    with pytest.raises(ValueError, match="copies must be an int in 1..64"):
        decode.receiver(6).init([1], copies=copies)
    with pytest.raises(ValueError, match="not a prefill node"):
        decode.nothing_to_send(6, ["127.0.0.1:1"])
    assert prefill.incoming.empty()
