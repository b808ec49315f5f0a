"""One request at prefill as one object (``PrefillRequest``), and the reporter working on the
request a writer's result hands it forward, with no table of the node's behind it.

``PrefillRequest`` is pure (no lock, thread or clock; time passed in): it is idle (the node
forgets the room) only when no sender, destination, reservation or lost destination is left;
its destinations keep their decode nodes' ``rooms`` in step; each reserving decode node is told
(``untold``) and refused (``unrefused``) at most once, and a node that announced pages is never
refused as a mere reservation; a finished request hands the reservations that came after its
success to the room's next request; a lost destination is kept for the request timeout.
The node-level behaviour (over real engines): test_prefill_complete.py, tests/transfer/test_nodes.py.
"""

from __future__ import annotations

import threading

import numpy as np

from dsa_bridge.transfer import protocol
from dsa_bridge.transfer.counters import Counters
from dsa_bridge.transfer.plan import WritePlan
from dsa_bridge.transfer.prefill.outcomes import ChunkReporter
from dsa_bridge.transfer.prefill.prefill_request import PrefillRequest
from dsa_bridge.transfer.prefill.records import Chunk, DecodeDestination, DecodePeer, KVSender
from dsa_bridge.transfer.prefill.writer import Job, Result
from dsa_bridge.transfer.request import KVPoll

ROOM = 7


def peer(name: str) -> DecodePeer:
    return DecodePeer(name.encode(), name, f"engine-{name}", None, 0.0)


def destination(decode: DecodePeer, pages=(3, 4)) -> DecodeDestination:
    return DecodeDestination(decode, np.asarray(pages, dtype=np.int64), 128, 1.0)


def sender(room: int = ROOM) -> KVSender:
    return KVSender(None, room, 60.0)


def test_a_request_is_idle_only_when_nothing_of_it_is_left():
    request = PrefillRequest(ROOM)
    assert request.idle and not request.writable and request.to_write() == []
    decode = peer("a")
    request.reserve(decode, 1.0)
    assert not request.idle
    assert request.unreserve(decode) and not request.unreserve(decode)
    assert request.idle
    request.lose("decode gave it up", 2.0)
    assert not request.idle
    request.forget_lost(now=2.0 + 60.0, keep_s=60.0)  # not older than the timeout: kept
    assert request.lost is not None
    request.forget_lost(now=2.0 + 60.5, keep_s=60.0)
    assert request.lost is None and request.idle


def test_a_sender_made_after_its_destination_was_lost_learns_why_once():
    request = PrefillRequest(ROOM)
    request.lose("decode a unreachable", 1.0)
    first = sender()
    lost = request.attach(first)
    assert lost is not None and lost.reason == "decode a unreachable" and lost.at == 1.0
    assert request.sender is first and request.lost is None and not request.idle


def test_destinations_keep_their_decode_nodes_rooms_in_step():
    a, b = peer("a"), peer("b")
    request = PrefillRequest(ROOM)
    mine, theirs = destination(a), destination(b, (5, 6))
    request.announce(mine, copies=2, nothing_to_send=False)
    assert not request.writable and a.rooms == {ROOM} and request.destination_of(b) is None
    request.announce(theirs, copies=2, nothing_to_send=False)
    assert request.writable and request.to_write() == [mine, theirs]
    assert request.destination_of(b) is theirs and b.rooms == {ROOM}
    request.leave(mine)
    assert a.rooms == set() and request.destinations.members == [theirs] and not request.writable
    dropped = request.drop_destinations()
    assert dropped.members == [theirs] and b.rooms == set() and request.destinations is None
    assert request.idle


def test_nothing_to_send_writes_to_no_decode_node():
    request = PrefillRequest(ROOM)
    request.announce(destination(peer("a"), ()), copies=1, nothing_to_send=True)
    assert request.writable and request.to_write() == []


def test_each_reserving_node_is_told_or_refused_once_and_an_announced_one_never_refused():
    a, b, c = peer("a"), peer("b"), peer("c")
    request = PrefillRequest(ROOM)
    assert request.reserve(a, 1.0) and not request.reserve(a, 1.5)  # a repeat changes nothing
    assert request.reserve(b, 2.0)
    assert request.untold() == [a, b] and request.untold() == []
    assert request.reserve(c, 3.0)
    request.announce(destination(b), copies=1, nothing_to_send=False)
    # told or not: refused unless it announced pages (b: its failure goes with its ChunkDone)
    assert request.unrefused() == [a, c] and request.unrefused() == []
    assert request.untold() == []  # c was refused: never told


def test_a_finished_request_hands_later_reservations_to_the_rooms_next_request():
    a, b = peer("a"), peer("b")
    request = PrefillRequest(ROOM)
    request.reserve(a, 1.0)
    request.announce(destination(a), copies=1, nothing_to_send=False)
    done = sender()
    request.attach(done)
    done.state.advance(KVPoll.Success, 5.0)
    request.reserve(b, 6.0)  # after the success: for the room's next request
    following = request.finish()
    assert following is not None and following.room == ROOM and following.sender is None
    assert [r.peer for r in following.reservations] == [b]
    assert request.destinations is None and request.reservations == [] and a.rooms == set()
    assert request.sender is done  # the application keeps its sender and its state


def test_a_failed_request_hands_nothing_on():
    request = PrefillRequest(ROOM)
    failed = sender()
    request.attach(failed)
    failed.state.fail("timed out", 5.0)
    request.reserve(peer("a"), 6.0)
    request.lose("late", 6.0)
    assert request.finish() is None
    assert request.reservations == [] and request.lost is None


class Reports:
    """What a reporter sends, by decode node."""

    def __init__(self):
        self.sent: list[tuple[bytes, protocol.Message]] = []

    def __call__(self, message: protocol.Message, identity: bytes) -> None:
        self.sent.append((identity, message))


def written(job: Job) -> Result:
    plan = WritePlan(np.zeros(1, np.uint64), np.zeros(1, np.uint64), np.full(1, 4096, np.uint64), 1)
    return Result(job, ok=True, plan=plan)


def test_the_reporter_updates_the_request_its_result_carries():
    """Two decode nodes receive the request: each gets its ChunkDone, and the request succeeds
    once both have their last chunk; no table of a node is involved."""
    a, b = peer("a"), peer("b")
    request = PrefillRequest(ROOM)
    to_a, to_b = destination(a), destination(b)
    request.announce(to_a, copies=2, nothing_to_send=False)
    request.announce(to_b, copies=2, nothing_to_send=False)
    request.attach(running := sender())
    running.state.advance(KVPoll.Transferring, 1.0)
    running.busy = 2
    reports = Reports()
    reporter = ChunkReporter("prefill", threading.Lock(), Counters(), reports)
    chunk = Chunk(0, np.array([1, 2]), True)
    reporter.finish(written(Job(request, to_a, chunk)))
    assert running.poll() == KVPoll.Transferring and to_a.finished and not to_b.finished
    reporter.finish(written(Job(request, to_b, chunk)))
    assert running.poll() == KVPoll.Success and running.busy == 0
    assert running.chunks_sent == 2 and running.nbytes == 2 * 4096
    assert [(identity, m.ok, m.last, m.nbytes) for identity, m in reports.sent] == [
        (b"a", True, True, 4096), (b"b", True, True, 4096)]


def test_a_failed_write_is_reported_once_no_write_of_the_request_runs():
    """The first job's engine write failed (in flight) while the second is still in the writer:
    decode hears of it only after the second leaves, once, naming the write in flight; the
    decode node that only reserved the request is refused at once."""
    a, c = peer("a"), peer("c")
    request = PrefillRequest(ROOM)
    to_a = destination(a)
    request.announce(to_a, copies=1, nothing_to_send=False)
    request.reserve(c, 1.0)
    request.attach(running := sender())
    running.busy = 2
    reports = Reports()
    reporter = ChunkReporter("prefill", threading.Lock(), Counters(), reports)
    first, second = Chunk(0, np.array([1]), False), Chunk(1, np.array([2]), True)
    reporter.finish(Result(Job(request, to_a, first), ok=False, reason="engine write failed: x",
                           in_flight=True, engine_failure=True))
    assert running.poll() == KVPoll.Failed and running.write_failed and running.busy == 1
    assert [(identity, m.reason) for identity, m in reports.sent] == [(b"c", "engine write failed: x")]
    reporter.finish(Result(Job(request, to_a, second), ok=False))  # skipped: the request failed
    assert running.busy == 0 and running.reported
    assert [(identity, m.ok, m.in_flight, m.reason) for identity, m in reports.sent[1:]] == [
        (b"a", False, True, "engine write failed: x")]
