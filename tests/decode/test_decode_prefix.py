"""A decode radix-cache prefix, and decode giving a request up before it sent its pages.

Decode that holds a request's first tokens already (its radix cache) sends pages for the rest
only, with ``prefix_tokens``; prefill's sender learns it (``decode_prefix_tokens``, and
``IncomingRequest.prefix_tokens``) and sends the rest. Decode that gives a request up before
its pages went out tells prefill at once (``Abort(before_pages=True)``): the sender fails now,
or as soon as it is made, instead of waiting for its deadline; nothing is answered. And the
other way: prefill tells decode of a failure only for a request that failed (an abort after
success sends nothing).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dsa_bridge.transfer.counters import Counters
from dsa_bridge.transfer.launcher.drivers import count_mismatches, fill_request, sentinel_intact
from dsa_bridge.transfer.prefill.outcomes import ChunkReporter
from dsa_bridge.transfer.prefill.prefill_request import PrefillRequest
from dsa_bridge.transfer.prefill.records import DecodeDestination, DecodePeer, Destinations, KVSender
from dsa_bridge.transfer.request import KVPoll
from tests.transfer.helpers import wait_for

PAGE = 64


def test_prefix_tokens_reach_a_sender_made_before_or_after_decodes_pages(nodes):
    prefill, decode = nodes()
    early = prefill.sender(1)  # made before decode's pages arrive
    first = decode.receiver(1)
    first.init([5, 6], num_tokens=5 * PAGE, prefix_tokens=3 * PAGE)
    wait_for(lambda: early.poll() == KVPoll.WaitingForInput, what="decode's pages")
    assert early.decode_prefix_tokens == 3 * PAGE
    second = decode.receiver(2)
    second.init([7], num_tokens=2 * PAGE, prefix_tokens=PAGE)
    offered = wait_for(lambda: not prefill.incoming.empty() and prefill.incoming.get())
    assert (offered.room, offered.num_pages, offered.prefix_tokens) == (2, 1, PAGE)
    late = prefill.sender(2)  # made after
    assert late.decode_prefix_tokens == PAGE


def test_only_the_pages_after_the_prefix_move(nodes):
    """A five-page request whose first two pages decode holds: prefill sends its last three into
    decode's three pages; decode's other pages (its cached prefix among them) are untouched."""
    prefill, decode = nodes()
    src = np.array([9, 3, 4, 5, 17])
    fill_request(prefill.pool, 99, src[:2])  # the prefix: never sent
    fill_request(prefill.pool, 1, src[2:])  # the rest, request 1's pattern from its first page
    receiver = decode.receiver(1)
    receiver.init([11, 12, 13], num_tokens=5 * PAGE, prefix_tokens=2 * PAGE)
    sender = prefill.sender(1)
    wait_for(lambda: sender.poll() == KVPoll.WaitingForInput, what="decode's pages")
    skip = sender.decode_prefix_tokens // PAGE  # as sglang's prefill: start_send_idx
    sender.init(src.size - skip)
    sender.send(src[skip:])
    wait_for(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), what="request end")
    assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
    layout = decode.pool.layout
    assert receiver.nbytes == 3 * (layout.kv_page_bytes + layout.index_page_bytes) * 4
    assert count_mismatches(decode.pool, 1, np.array([11, 12, 13])) == 0
    untouched = np.setdiff1d(np.arange(1, decode.pool.num_kv_pages), [11, 12, 13])
    assert sentinel_intact(decode.pool, untouched)


@pytest.mark.parametrize("prefix", [-1, 1.5])
def test_a_bad_prefix_is_refused_before_anything_is_sent(nodes, prefix):
    prefill, decode = nodes()
    receiver = decode.receiver(1)
    with pytest.raises(ValueError, match="prefix_tokens must be a non-negative int"):
        receiver.init([5], prefix_tokens=prefix)
    assert prefill.incoming.empty()


def test_decode_giving_up_before_its_pages_fails_the_waiting_sender_at_once(nodes):
    prefill, decode = nodes()
    waiting = prefill.sender(1)  # sglang's bootstrap queue: waits for decode's pages
    receiver = decode.receiver(1)
    receiver.abort("decode refused: no room in its pool")
    assert receiver.poll() == KVPoll.Failed and receiver.can_release()  # nothing was asked
    wait_for(lambda: waiting.poll() == KVPoll.Failed, 5, "the sender told")
    assert "decode refused: no room in its pool" in str(waiting.failure_exception())
    later = decode.receiver(2)
    later.abort("client went away")
    wait_for(lambda: 2 in prefill._requests.requests and prefill._requests.requests[2].lost,
             5, "prefill told of room 2")
    made_after = prefill.sender(2)  # the application comes later: fails at once
    assert made_after.poll() == KVPoll.Failed
    assert "client went away" in str(made_after.failure_exception())
    decode.forget(receiver)
    decode.forget(later)
    assert decode.counters.snapshot().get("messages_dropped", 0) == 0  # nothing was answered


def test_aborting_a_sender_that_succeeded_tells_decode_nothing():
    """sglang's prefill may abort (or clear) a request right after its transfer succeeded, before
    the node forgets it: no failure report (with an empty reason) goes to decode then."""
    sent = []
    destination = DecodeDestination(DecodePeer(b"decode", "decode", "engine", None, 0.0),
                                    np.array([7, 8]), 2 * PAGE, 0.0)
    reporter = ChunkReporter("prefill", threading.Lock(), Counters(),
                             lambda message, identity: sent.append(message))
    succeeded = KVSender(None, 1, 60.0)
    succeeded.state.advance(KVPoll.Success, 0.0)
    reporter.fail_locked(PrefillRequest(1, succeeded, Destinations(1, [destination])),
                         "aborted by sglang after the fact")
    assert succeeded.poll() == KVPoll.Success and sent == []
    failing = KVSender(None, 1, 60.0)
    reporter.fail_locked(PrefillRequest(1, failing, Destinations(1, [destination])),
                         "aborted by sglang")
    assert [(m.room, m.ok, m.reason) for m in sent] == [(1, False, "aborted by sglang")]
