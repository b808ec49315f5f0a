"""Deferred decode allocation over the real engines: decode reserves a request (``Reserve``)
before it allocates any page, prefill tells it once the request's prefill has run
(``KVSender.prefill_complete`` -> ``PrefillReady``), then the usual transfer runs.

Both orders (decode reserves before the sender exists, or after prefill completed: readiness
buffered), one readiness per decode node however often prefill completes, byte-exact pages and
aux; a prefill abort before completion fails decode's receiver at once with prefill's reason, a
decode abort before readiness fails prefill's sender with decode's (made before or after); a
deferred sender has no deadline before it completes, decode's deadline starts again at
readiness; an unclaimed reservation is refused at prefill's timeout; malformed rooms are dropped
and counted.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from dsa_bridge.transfer import protocol
from dsa_bridge.transfer.launcher.drivers import count_mismatches, fill_request, sentinel_intact
from dsa_bridge.transfer.request import TERMINAL, KVPoll
from tests.transfer.helpers import aux_tensors, decode_node, prefill_node, wait_for

PAGE = 64
SRC = np.array([9, 3, 4, 5, 17])
DST = np.array([2, 11, 12, 13, 1])


@pytest.fixture
def readiness(monkeypatch):
    """Counts the ``PrefillReady`` messages a prefill node sends, by room."""
    told: list[int] = []

    def watch(prefill):
        reporter = prefill._reporter
        ready = reporter.ready

        def counted(peer, room):
            told.append(room)
            ready(peer, room)

        monkeypatch.setattr(reporter, "ready", counted)
        return told

    return watch


def reservations(prefill, room) -> list:
    """The reservations of ``room`` prefill keeps (its ``PrefillRequest``'s)."""
    request = prefill._requests.requests.get(room)
    return [] if request is None else request.reservations


def reserved_rooms(prefill) -> set[int]:
    """The rooms some decode node's reservation of which prefill keeps."""
    return {room for room, request in prefill._requests.requests.items() if request.reservations}


def lost(prefill, room) -> bool:
    """Prefill keeps why decode gave ``room`` up before its sender was made."""
    request = prefill._requests.requests.get(room)
    return request is not None and request.lost is not None


def reserved(prefill, room, peers=1):
    """Wait until prefill has recorded ``peers`` reservations of ``room``."""
    wait_for(lambda: len(reservations(prefill, room)) == peers, 10,
             f"room {room} reserved")


def still(predicate, seconds=0.3):
    """``predicate`` holds for ``seconds`` (checked throughout)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert predicate()
        time.sleep(0.01)


def transfer(prefill, decode, sender, receiver, room, *, aux_index=None, src_aux_index=None):
    """The pages after readiness: decode allocates and announces, prefill sends; byte-exact."""
    wait_for(lambda: receiver.prefill_ready, 10, "readiness at decode")
    fill_request(prefill.pool, room, SRC)
    receiver.init(DST, num_tokens=SRC.size * PAGE, aux_index=aux_index)
    sender.init(SRC.size, aux_index=src_aux_index)
    sender.send(SRC[:2])
    sender.send(SRC[2:])
    wait_for(lambda: sender.poll() in TERMINAL and receiver.poll() in TERMINAL, 20, "the end")
    assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
    assert sender.poll() == KVPoll.Success, sender.failure_exception()
    assert count_mismatches(decode.pool, room, DST) == 0  # every layer, KV and indexer
    assert sentinel_intact(decode.pool, np.setdiff1d(np.arange(1, decode.pool.num_kv_pages), DST))


@pytest.mark.parametrize("order", ["reserve_first", "complete_first"])
def test_decode_allocates_once_prefill_completed_in_either_order(engine, made, readiness, order):
    src_aux = aux_tensors(4)
    prefill = prefill_node(engine, made, aux=src_aux)
    dst_aux = aux_tensors(4, fill=0xA5)
    decode = decode_node(engine, made, [prefill], aux=dst_aux)
    told = readiness(prefill)
    for tensor in src_aux:
        tensor[2] = 0x3C
    if order == "reserve_first":  # decode's Reserve before the application's sender
        receiver = decode.receiver(1, reserve=True)
        reserved(prefill, 1)
        sender = prefill.sender(1, deferred=True)
        still(lambda: not receiver.prefill_ready and sender.poll() == KVPoll.Bootstrapping)
        assert receiver.poll() == KVPoll.Bootstrapping
        sender.prefill_complete()
    else:  # prefill completed before decode reserved: readiness buffered until it does
        sender = prefill.sender(1, deferred=True)
        sender.prefill_complete()
        assert told == []
        receiver = decode.receiver(1, reserve=True)
    transfer(prefill, decode, sender, receiver, 1, aux_index=1, src_aux_index=2)
    assert told == [1]
    for tensor in dst_aux:
        assert bool((tensor[1] == 0x3C).all()) and bool((tensor[0] == 0xA5).all())
    snapshot = decode.counters.snapshot()
    assert snapshot.get("bad_messages", 0) == 0 and snapshot.get("requests_failed", 0) == 0
    assert prefill.counters.snapshot().get("bad_messages", 0) == 0


def test_readiness_is_sent_once_per_decode_node(engine, made, readiness):
    prefill = prefill_node(engine, made)
    decode = decode_node(engine, made, [prefill])
    told = readiness(prefill)
    receiver = decode.receiver(2, reserve=True)
    reserved(prefill, 2)
    sender = prefill.sender(2, deferred=True)
    sender.prefill_complete()
    sender.prefill_complete()  # idempotent, no error
    wait_for(lambda: receiver.prefill_ready, 10, "readiness at decode")
    decode._loop.send(decode.peers[0].socket, protocol.Reserve(2))  # a repeat: ignored
    sender.prefill_complete()
    transfer(prefill, decode, sender, receiver, 2)
    assert told == [2]
    assert len(reservations(prefill, 2)) <= 1
    assert prefill.counters.snapshot().get("bad_messages", 0) == 0


def test_readiness_for_a_room_decode_does_not_reserve_is_ignored(engine, made):
    prefill = prefill_node(engine, made)
    decode = decode_node(engine, made, [prefill])
    plain = decode.receiver(3)  # made without reserve: ready from the start
    assert plain.prefill_ready
    identity = next(iter(prefill._sessions.peers))
    for room in (3, 4):  # a receiver that did not reserve, and no receiver at all
        prefill._send(protocol.PrefillReady(room), identity)
    time.sleep(0.3)
    assert decode.counters.snapshot().get("bad_messages", 0) == 0
    assert plain.poll() == KVPoll.Bootstrapping
    sender = prefill.sender(3)
    transfer(prefill, decode, sender, plain, 3)


def test_a_reserved_receiver_may_send_its_pages_before_readiness(engine, made, readiness):
    prefill = prefill_node(engine, made)
    decode = decode_node(engine, made, [prefill])
    told = readiness(prefill)
    receiver = decode.receiver(4, reserve=True)
    sender = prefill.sender(4, deferred=True)
    reserved(prefill, 4)
    fill_request(prefill.pool, 4, SRC)
    receiver.init(DST, num_tokens=SRC.size * PAGE)  # the early path: no readiness awaited
    sender.init(SRC.size)
    sender.send(SRC)
    wait_for(lambda: receiver.poll() in TERMINAL, 20, "the end")
    assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
    assert count_mismatches(decode.pool, 4, DST) == 0
    assert not receiver.prefill_ready
    sender.prefill_complete()  # the transfer is over: nobody is told any more
    time.sleep(0.2)
    assert told == [] and receiver.poll() == KVPoll.Success


@pytest.mark.parametrize("reserve_before_abort", [True, False])
def test_a_prefill_abort_before_completion_fails_decode_at_once(engine, made, readiness,
                                                                reserve_before_abort):
    prefill = prefill_node(engine, made)
    decode = decode_node(engine, made, [prefill])  # its own deadline: 60 s
    told = readiness(prefill)
    sender = prefill.sender(5, deferred=True)
    if reserve_before_abort:
        receiver = decode.receiver(5, reserve=True)
        reserved(prefill, 5)
    started = time.monotonic()
    sender.abort("client went away")
    if not reserve_before_abort:
        receiver = decode.receiver(5, reserve=True)
    wait_for(lambda: receiver.poll() == KVPoll.Failed, 5, "decode's receiver failed")
    assert time.monotonic() - started < 5
    assert "client went away" in str(receiver.failure_exception())
    assert not receiver.prefill_ready and receiver.can_release()
    sender.prefill_complete()  # on a failed sender: tells nobody
    time.sleep(0.2)
    assert told == [] and sender.poll() == KVPoll.Failed
    assert decode.counters.snapshot().get("bad_messages", 0) == 0
    assert prefill.counters.snapshot().get("bad_messages", 0) == 0


@pytest.mark.parametrize("sender_exists", [True, False])
def test_a_decode_abort_before_readiness_fails_the_sender(engine, made, readiness, sender_exists):
    prefill = prefill_node(engine, made)
    decode = decode_node(engine, made, [prefill])
    told = readiness(prefill)
    receiver = decode.receiver(6, reserve=True)
    reserved(prefill, 6)
    sender = prefill.sender(6, deferred=True) if sender_exists else None
    receiver.abort("decode out of memory")
    if sender is None:  # made after prefill heard of the abort: fails at once
        wait_for(lambda: lost(prefill, 6), 10, "the abort at prefill")
        sender = prefill.sender(6, deferred=True)
        assert sender.poll() == KVPoll.Failed
    wait_for(lambda: sender.poll() == KVPoll.Failed, 5, "prefill's sender failed")
    assert "decode out of memory" in str(sender.failure_exception())
    assert 6 not in reserved_rooms(prefill)  # the reservation was dropped
    sender.prefill_complete()
    time.sleep(0.2)
    assert told == []
    assert receiver.poll() == KVPoll.Failed and receiver.can_release()
    assert decode.counters.snapshot().get("bad_messages", 0) == 0
    assert prefill.counters.snapshot().get("bad_messages", 0) == 0


@pytest.mark.slow
def test_a_deferred_sender_has_no_deadline_until_it_completes(engine, made):
    prefill = prefill_node(engine, made, request_timeout_s=3.0)  # (the transfer's time after it)
    decode = decode_node(engine, made, [prefill])
    deferred = prefill.sender(7, deferred=True)
    plain = prefill.sender(8)  # its deadline runs from creation
    wait_for(lambda: plain.poll() == KVPoll.Failed, 5, "the plain sender timed out")
    assert "timed out" in str(plain.failure_exception())
    time.sleep(0.5)  # both now well past the 3 s timeout
    assert deferred.poll() == KVPoll.Bootstrapping
    receiver = decode.receiver(7, reserve=True)
    reserved(prefill, 7)
    completed = time.monotonic()
    deferred.prefill_complete()
    assert completed <= deferred.state.deadline - 3.0 <= time.monotonic()
    transfer(prefill, decode, deferred, receiver, 7)


def test_a_completed_deferred_sender_times_out_without_decode_pages(engine, made):
    prefill = prefill_node(engine, made, request_timeout_s=1.0)
    decode = decode_node(engine, made, [prefill])
    receiver = decode.receiver(9, reserve=True)
    sender = prefill.sender(9, deferred=True)
    reserved(prefill, 9)
    sender.prefill_complete()
    wait_for(lambda: receiver.prefill_ready, 10, "readiness at decode")
    wait_for(lambda: sender.poll() == KVPoll.Failed, 5, "the sender timed out")
    assert "timed out after 1s" in str(sender.failure_exception())
    wait_for(lambda: receiver.poll() == KVPoll.Failed, 5, "decode told")
    assert "timed out after 1s" in str(receiver.failure_exception())


@pytest.mark.slow
def test_decodes_deadline_starts_again_at_readiness(engine, made):
    prefill = prefill_node(engine, made)
    decode = decode_node(engine, made, [prefill], request_timeout_s=3.0)
    receiver = decode.receiver(10, reserve=True)
    created_deadline = receiver.state.deadline
    sender = prefill.sender(10, deferred=True)
    reserved(prefill, 10)
    time.sleep(1.8)  # the prefill computes for most of decode's timeout
    before = time.monotonic()
    sender.prefill_complete()
    wait_for(lambda: receiver.prefill_ready, 10, "readiness at decode")
    assert receiver.state.deadline >= before + 3.0 > created_deadline
    wait_for(lambda: time.monotonic() > created_deadline + 0.3, 5, "the first deadline passed")
    assert receiver.poll() == KVPoll.Bootstrapping  # not timed out
    transfer(prefill, decode, sender, receiver, 10)


def test_an_unclaimed_reservation_is_refused_at_prefills_timeout(engine, made):
    prefill = prefill_node(engine, made, request_timeout_s=1.0)
    decode = decode_node(engine, made, [prefill])  # its own deadline: 60 s
    receiver = decode.receiver(11, reserve=True)
    reserved(prefill, 11)
    wait_for(lambda: receiver.poll() == KVPoll.Failed, 5, "the refusal")
    assert "no prefill request for this room" in str(receiver.failure_exception())
    assert 11 not in reserved_rooms(prefill)
    assert receiver.can_release()


def test_a_sender_made_after_its_room_was_refused_as_unclaimed_fails_at_once(engine, made):
    """decode's pages, or its reservation, refused because no sender came within prefill's
    timeout: a sender the application makes just after fails at once, saying why, instead of
    waiting its whole timeout for pages that decode, already failed, will never send again."""
    prefill = prefill_node(engine, made, request_timeout_s=1.5)
    decode = decode_node(engine, made, [prefill])
    announced = decode.receiver(13)
    announced.init(np.arange(1, 3), num_tokens=128)
    reserving = decode.receiver(14, reserve=True)
    reserved(prefill, 14)
    for receiver in (announced, reserving):
        wait_for(lambda r=receiver: r.poll() == KVPoll.Failed, 10, "the refusal")
        assert "no prefill request for this room" in str(receiver.failure_exception())
    for room in (13, 14):
        sender = prefill.sender(room)
        assert sender.poll() == KVPoll.Failed, room  # at once, not after its own 1.5 s
        assert "no sender came within 1.5s" in str(sender.failure_exception())


def test_malformed_rooms_are_dropped_and_counted(engine, made, readiness):
    prefill = prefill_node(engine, made)
    decode = decode_node(engine, made, [prefill])
    told = readiness(prefill)
    for room in (-1, protocol.MAX_ROOM + 1):
        decode._loop.send(decode.peers[0].socket, protocol.Reserve(room))
    wait_for(lambda: prefill.counters.snapshot().get("bad_messages", 0) == 2, 10, "the drops")
    identity = next(iter(prefill._sessions.peers))
    prefill._send(protocol.PrefillReady(-1), identity)
    wait_for(lambda: decode.counters.snapshot().get("bad_messages", 0) == 1, 10, "the drop")
    assert reserved_rooms(prefill) == set()
    receiver = decode.receiver(12, reserve=True)  # both nodes keep serving
    sender = prefill.sender(12, deferred=True)
    sender.prefill_complete()
    transfer(prefill, decode, sender, receiver, 12)
    assert told == [12]
    with pytest.raises(ValueError, match="not in 0..2"):
        decode.receiver(-1, reserve=True)


def test_a_dropped_decode_node_fails_what_it_reserved(engine, made):
    prefill = prefill_node(engine, made)
    decode = decode_node(engine, made, [prefill])
    sender = prefill.sender(13, deferred=True)
    decode.receiver(13, reserve=True)
    decode.receiver(14, reserve=True)  # no sender yet
    reserved(prefill, 13)
    reserved(prefill, 14)
    decode.close()  # silent: prefill drops it after its peer timeout (2 s)
    wait_for(lambda: sender.poll() == KVPoll.Failed, 10, "the sender failed")
    assert "unreachable" in str(sender.failure_exception())
    assert reserved_rooms(prefill) == set()
    later = prefill.sender(14, deferred=True)
    assert later.poll() == KVPoll.Failed and "unreachable" in str(later.failure_exception())


@pytest.mark.parametrize("kind", [protocol.Reserve, protocol.PrefillReady])
def test_the_messages_round_trip_and_bound_their_room(kind):
    for room in (0, protocol.MAX_ROOM):
        assert protocol.decode(protocol.encode(kind(room))) == kind(room)
    for room in (-1, protocol.MAX_ROOM + 1):
        with pytest.raises(protocol.ProtocolError, match="room"):
            protocol.decode(protocol.encode(kind(room)))
