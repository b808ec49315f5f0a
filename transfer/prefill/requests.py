"""The prefill node's requests: each one's sender, its destination at decode, and its way to the
writer.

``RequestBook`` keeps four tables, all guarded by the node's lock:

- ``destinations``: room -> where decode wants the request's pages (``Destinations``: one
  ``DecodeDestination`` per decode node that receives it), from decode's ``RequestPages`` until
  the request is finished, refused, or its decode nodes dropped (shared with the
  ``ChunkReporter``, which reads it);
- ``senders``: room -> the application's ``KVSender``, until the request is finished and no write
  of it can still run;
- ``lost_before_sender``: room -> why and when decode's destination was lost (its decode node was
  dropped, or decode gave the request up before sending its pages) before the application made
  the request's sender: a sender made later fails at once;
- ``reservations``: room -> the decode nodes that hold a receiver for it and allocate their pages
  only once told its prefill finished (``Reserve``, deferred allocation), until the request is
  forgotten, refused, or their decode node gave it up or was dropped (shared with the
  ``ChunkReporter``, which refuses them when the request fails).

One request's path: the application makes its sender (``new_sender``), ``init``s it and
``send``s its page ids in chunks; decode announces its pages (``announced_locked``: every decode
node that receives the request, when several do); once both are known, each queued chunk becomes
a writer ``Job`` per decode node (``_dispatch_locked``), counted in ``KVSender.busy``; a request
decode reads from another prefill rank (``nothing_to_send``) succeeds with its last chunk,
writing nothing. Deferred allocation: decode reserves the request first (``reserved_locked``),
and the application's ``prefill_complete`` (``KVSender``) tells each reserving decode node
(``PrefillReady``; one that reserves later, on arrival), which then announces its pages as
above; a deferred sender's deadline runs only from ``prefill_complete``. What becomes of the job
goes from the writer's lane to the ``ChunkReporter``, not back here; every failure and refusal
is the reporter's too. Methods named ``_locked`` expect the node's lock held; the others take it.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np

from ...plugin.descriptors import BufferDescriptor
from .. import protocol
from ..counters import Counters
from ..plan import PlanError, as_page_ids, check_aux_index, check_destination
from ..request import TERMINAL, KVPoll
from .outcomes import ChunkReporter
from .records import (
    Chunk,
    DecodeDestination,
    DecodePeer,
    Destinations,
    IncomingRequest,
    KVSender,
    Reservation,
)
from .writer import Job, Writer


@dataclass(frozen=True)
class LostDestination:
    """Why and when decode's destination of a request without a sender was lost."""

    reason: str
    at: float


def _page_count_mismatch(prefill: int, decode: int) -> str:
    return f"page count mismatch: prefill has {prefill} pages, decode allocated {decode}"


def _announcement_problem(request: protocol.RequestPages) -> str | None:
    """Why decode's ``RequestPages`` cannot be taken on its own; None when it can."""
    if not 0 <= request.room <= protocol.MAX_ROOM:
        return f"room {request.room} is not in 0..2**63-1"
    if request.prefix_tokens < 0:
        return f"prefix_tokens {request.prefix_tokens} < 0"
    if not 1 <= request.copies <= protocol.MAX_COPIES:
        return f"copies {request.copies} is not in 1..{protocol.MAX_COPIES}"
    if request.nothing_to_send and (request.dst_pages or request.copies != 1
                                    or request.aux_index != -1 or request.index_pages is not None):
        return "nothing_to_send with pages, an aux slot or several copies"
    return None


def _share_problem(sender: KVSender, pages: np.ndarray, positions: np.ndarray,
                   through: object) -> str | None:
    """Why a chunk of a share (``KVSender.send_share``) does not continue ``sender``'s; None
    when it does."""
    if sender.shares is False:
        return "a share of the pages after a whole chunk"
    if isinstance(through, bool) or not isinstance(through, (int, np.integer)):
        return f"share chunk: through must be an int, got {through!r}"
    if not sender.pages_sent < through <= sender.num_pages:
        return (f"share chunk through page {through} after {sender.pages_sent} does not fit the "
                f"request's {sender.num_pages} pages")
    if pages.size != positions.size:
        return f"share chunk of {pages.size} pages at {positions.size} positions"
    if positions.size and (positions[0] < sender.pages_sent or positions[-1] >= through
                           or (positions[1:] <= positions[:-1]).any()):
        return (f"share chunk positions must ascend within [{sender.pages_sent}, {through}), got "
                f"{positions[:8].tolist()}{'...' if positions.size > 8 else ''}")
    return None


def aux_only(request: protocol.RequestPages) -> bool:
    """Whether decode announces no page for the request, only its aux slot or a prefix: its radix
    cache holds the whole page-aligned prompt, and prefill's sender is ``init(0)`` (a page count
    that differs fails the request). An empty list with neither is refused as empty."""
    return (not request.dst_pages and not request.index_pages
            and (request.aux_index >= 0 or request.prefix_tokens > 0))


def _mismatch(destinations: Destinations, request: protocol.RequestPages) -> str | None:
    """Why another decode node's announcement of a request does not match the first one's."""
    if request.nothing_to_send or destinations.nothing_to_send:
        return "one decode node has nothing to receive, another has pages"
    if request.copies != destinations.copies:
        return (f"decode nodes disagree on how many receive the request: {destinations.copies} "
                f"and {request.copies}")
    if request.prefix_tokens != destinations.prefix_tokens:
        return (f"decode nodes disagree on the prefix they hold: {destinations.prefix_tokens} "
                f"and {request.prefix_tokens} tokens")
    return None


class RequestBook:
    """The node's requests and their tables (see the module docstring)."""

    def __init__(self, name: str, lock: threading.Lock, *,
                 destinations: dict[int, Destinations],
                 reservations: dict[int, list[Reservation]], reporter: ChunkReporter,
                 writer: Writer, counters: Counters, incoming: queue.Queue[IncomingRequest],
                 aux_buffers: list[BufferDescriptor], request_timeout_s: float):
        self.name = name
        self.destinations = destinations
        self.senders: dict[int, KVSender] = {}
        self.lost_before_sender: dict[int, LostDestination] = {}
        self.reservations = reservations
        self.aux_buffers = aux_buffers
        self.request_timeout_s = request_timeout_s
        self._lock = lock
        self._reporter = reporter
        self._writer = writer
        self._counters = counters
        self._incoming = incoming

    # ---- the application's calls (its thread) ----------------------------------------------

    def new_sender(self, room: int, *, deferred: bool = False) -> KVSender:
        with self._lock:
            if room in self.senders:
                raise ValueError(f"room {room} already has a sender")
            sender = KVSender(self, room, self.request_timeout_s, deferred=deferred)
            self.senders[room] = sender
            destinations = self.destinations.get(room)
            if destinations is not None and destinations.complete:
                sender.state.advance(KVPoll.WaitingForInput, time.monotonic())
                sender.decode_prefix_tokens = destinations.prefix_tokens
            lost = self.lost_before_sender.pop(room, None)
            if lost is not None:  # its decode node was dropped before the application came
                self._reporter.fail_locked(sender, lost.reason)
            return sender

    def init_sender(self, sender: KVSender, num_pages: int, aux_index: int | None) -> None:
        if num_pages < 0:  # 0: decode holds every page already (``aux_only``)
            raise ValueError(f"num_pages must not be negative, got {num_pages}")
        try:
            sender.aux_index = check_aux_index(self.aux_buffers, aux_index, "aux_index")
        except PlanError as exc:
            raise ValueError(str(exc)) from None
        with self._lock:
            if sender.num_pages is not None:
                raise ValueError(f"room {sender.room}: init called twice")
            sender.num_pages = num_pages
            destinations = self.destinations.get(sender.room)
            for destination in destinations.to_write() if destinations is not None else []:
                if len(destination.dst_pages) != num_pages:
                    self._reporter.fail_locked(sender, _page_count_mismatch(
                        num_pages, len(destination.dst_pages)))
                    return

    def send_chunk(self, sender: KVSender, page_ids: object) -> None:
        pages = as_page_ids(page_ids, "page_ids")
        with self._lock:
            if not self._sendable_locked(sender):
                return
            if sender.shares:
                self._reporter.fail_locked(sender, "a whole chunk after a share of the pages")
                return
            # a request of no page: its one chunk is empty, the last (its aux slot alone)
            empty_last = sender.num_pages == 0 and sender.shares is None
            sender.shares = False
            if (pages.size == 0 and not empty_last) or sender.pages_sent + pages.size > sender.num_pages:
                self._reporter.fail_locked(
                    sender, f"chunk of {pages.size} pages after {sender.pages_sent} does not fit "
                    f"the request's {sender.num_pages} pages")
                return
            offset = sender.pages_sent
            sender.pages_sent += pages.size
            sender.pending.append(Chunk(offset, pages, sender.pages_sent == sender.num_pages))
            self._dispatch_locked(sender)

    def send_share(self, sender: KVSender, page_ids: object, positions: object,
                   through: int) -> None:
        """A chunk of ``sender``'s share of the pages (``KVSender.send_share``); one that does not
        continue its share fails the request, naming why."""
        pages = as_page_ids(page_ids, "page_ids")
        at = as_page_ids(positions, "positions")
        with self._lock:
            if not self._sendable_locked(sender):
                return
            problem = _share_problem(sender, pages, at, through)
            if problem:
                self._reporter.fail_locked(sender, problem)
                return
            sender.shares = True
            sender.pages_sent = through
            last = through == sender.num_pages
            if pages.size or last:
                sender.pending.append(Chunk(0, pages, last, at))
                self._dispatch_locked(sender)

    @staticmethod
    def _sendable_locked(sender: KVSender) -> bool:
        """Whether ``sender`` takes chunks: False once it ended (they are dropped); ValueError
        before its ``init``."""
        if sender.state.status in TERMINAL:
            return False
        if sender.num_pages is None:
            raise ValueError(f"room {sender.room}: send before init")
        return True

    def abort(self, sender: KVSender, reason: str) -> None:
        with self._lock:
            self._reporter.fail_locked(sender, reason)

    def prefill_complete(self, sender: KVSender) -> None:
        """``sender``'s prefill finished: its deadline runs from now, and each decode node that
        reserved the request and was not told yet is told (once; a later one on arrival)."""
        with self._lock:
            if sender.completed:
                return
            sender.completed = True
            if sender.state.status in TERMINAL or self.senders.get(sender.room) is not sender:
                return  # failed (nobody is told), finished, or forgotten
            sender.state.deadline = time.monotonic() + self.request_timeout_s
            for reservation in self.reservations.get(sender.room, []):
                self._tell_ready_locked(sender.room, reservation)

    def _tell_ready_locked(self, room: int, reservation: Reservation) -> None:
        if not (reservation.told or reservation.refused):
            reservation.told = True
            self._reporter.ready(reservation.peer, room)

    def _dispatch_locked(self, sender: KVSender) -> None:
        """Hand queued chunks to the writer, one job per decode node, once every decode node's
        pages are known; with nothing to send, the last chunk ends the request."""
        destinations = self.destinations.get(sender.room)
        if destinations is None or not destinations.complete or not sender.pending:
            return
        now = time.monotonic()
        sender.state.advance(KVPoll.Transferring, now)
        for chunk in sender.pending:
            for destination in destinations.to_write():
                sender.busy += 1
                self._writer.submit(Job(sender, destination, chunk))
            if chunk.last and destinations.nothing_to_send:
                sender.state.advance(KVPoll.Success, now)
        sender.pending.clear()

    # ---- decode's messages (the control loop) ----------------------------------------------

    def announced_locked(self, peer: DecodePeer, request: protocol.RequestPages) -> None:
        """One decode node's pages for a request: once every decode node that receives it
        announced (``copies``), offered on ``incoming`` until its sender comes, or dispatched."""
        room = request.room
        tell = not request.nothing_to_send  # such a decode node keeps no request to tell
        problem = _announcement_problem(request)
        if problem and not tell:
            raise protocol.ProtocolError(problem)  # dropped and counted (``bad_messages``)
        if problem:
            self._reporter.refuse(peer, room, problem)
            return
        destinations = self.destinations.get(room)
        if destinations is not None:
            if destinations.of(peer) is not None or destinations.complete:
                self._duplicate_locked(peer, room, tell=tell)
                return
            mismatch = _mismatch(destinations, request)
            if mismatch:  # the decode ranks disagree: the request cannot be served
                self._reporter.refuse(peer, room, mismatch, tell=tell)
                self._decode_gave_up_locked(room, mismatch)
                return
        try:
            dst, index = (np.empty(0, np.int64), None) if request.nothing_to_send or aux_only(request) else (
                check_destination(peer.pairs, request.dst_pages, request.index_pages,
                                  kv_page_zero=peer.kv_page_zero))
            aux = check_aux_index([p.dst for p in peer.aux_pairs], request.aux_index,
                                  "decode's aux_index")
        except PlanError as exc:
            self._reporter.refuse(peer, room, f"bad pages: {exc}", tell=tell)
            return
        if destinations is None:
            destinations = Destinations(request.copies, [], request.nothing_to_send)
            self.destinations[room] = destinations
        destinations.members.append(DecodeDestination(peer, dst, request.num_tokens,
                                                      time.monotonic(), aux,
                                                      request.prefix_tokens, index_pages=index))
        peer.rooms.add(room)
        sender = self.senders.get(room)
        if sender is not None and sender.state.status == KVPoll.Failed:  # before these pages
            if sender.reported:  # to the decode nodes that had announced: this one too
                self._reporter.refuse(peer, room, sender.state.reason, tell=tell)
            else:
                self._reporter.report_failure_locked(sender, in_flight=False)
            return
        if not destinations.complete:
            return
        if sender is None:
            self._incoming.put(IncomingRequest(room, dst.size, request.num_tokens, peer.node,
                                               request.prefix_tokens))
            return
        sender.decode_prefix_tokens = request.prefix_tokens
        sender.state.advance(KVPoll.WaitingForInput, time.monotonic())
        for destination in destinations.to_write() if sender.num_pages is not None else []:
            if destination.dst_pages.size != sender.num_pages:
                self._reporter.fail_locked(sender, _page_count_mismatch(
                    sender.num_pages, destination.dst_pages.size))
                return
        self._dispatch_locked(sender)

    def reserved_locked(self, peer: DecodePeer, reserve: protocol.Reserve) -> None:
        """A decode node holds a receiver for ``room`` and waits to be told its prefill finished:
        told now if it has, refused if the request failed or its destination was lost, else
        recorded (a repeat of the same node's is ignored)."""
        room = reserve.room
        reservations = self.reservations.get(room, [])
        if any(r.peer is peer for r in reservations):
            return
        sender = self._live_sender_locked(room)
        lost = self.lost_before_sender.get(room)
        if sender is not None and sender.state.status == KVPoll.Failed:
            self._reporter.refuse(peer, room, sender.state.reason)
            return
        if sender is None and lost is not None:
            self._reporter.refuse(peer, room, lost.reason)
            return
        reservation = Reservation(peer, time.monotonic())
        self.reservations.setdefault(room, []).append(reservation)
        if sender is not None and sender.completed:
            self._tell_ready_locked(room, reservation)

    def _live_sender_locked(self, room: int) -> KVSender | None:
        """``room``'s sender, unless it succeeded: a reservation then is for the room's next
        request."""
        sender = self.senders.get(room)
        return None if sender is None or sender.state.status == KVPoll.Success else sender

    def _unreserve_locked(self, room: int, peer: DecodePeer) -> bool:
        """Forget ``peer``'s reservation of ``room``; True if it had one."""
        reservations = self.reservations.get(room, [])
        kept = [r for r in reservations if r.peer is not peer]
        if kept:
            self.reservations[room] = kept
        else:
            self.reservations.pop(room, None)
        return len(kept) != len(reservations)

    def _duplicate_locked(self, peer: DecodePeer, room: int, *, tell: bool) -> None:
        """A room announced again. From a decode node that does not receive it, the newcomer's
        request is the one refused. From one that does, it no longer knows which pages it meant:
        the room fails, and, like any failure, is reported only once no write of ours into it
        can still land."""
        destinations = self.destinations[room]
        mine = destinations.of(peer)
        sender = self.senders.get(room)
        if mine is None or sender is None:
            if mine is not None:
                self._leave_locked(room, mine)
            self._reporter.refuse(peer, room, f"duplicate room {room}", tell=tell)
            return
        self._reporter.fail_locked(sender, f"duplicate room {room}")

    def aborted_locked(self, peer: DecodePeer, abort: protocol.Abort) -> None:
        if abort.before_pages:  # its reservation, if any, goes first: it needs no refusal
            self._unreserve_locked(abort.room, peer)
        destinations = self.destinations.get(abort.room)
        member = destinations is not None and destinations.of(peer) is not None
        if abort.before_pages and not member and (destinations is None
                                                  or not destinations.complete):
            # nothing to answer (no page was asked of it); the request cannot be served
            self._decode_gave_up_locked(abort.room, f"aborted by decode: {abort.reason}")
            return
        if destinations is not None and not member:
            raise protocol.ProtocolError(f"abort of room {abort.room}, which another decode "
                                         f"node announced")
        sender = self.senders.get(abort.room)
        if destinations is None:
            self._reporter.refuse(peer, abort.room, f"aborted by decode: {abort.reason}")
            return
        if sender is None:
            self._drop_destinations_locked(abort.room, f"aborted by decode: {abort.reason}")
            return
        self._reporter.fail_locked(sender, f"aborted by decode: {abort.reason}")

    def _decode_gave_up_locked(self, room: int, reason: str) -> None:
        """Decode gave ``room`` up before it sent its pages: its sender fails now, or at once
        when the application makes it."""
        sender = self.senders.get(room)
        if sender is None:
            self.lost_before_sender[room] = LostDestination(reason, time.monotonic())
        else:
            self._reporter.fail_locked(sender, reason)

    def drop_peer_locked(self, peer: DecodePeer, reason: str, now: float) -> None:
        """Fail a dropped decode node's requests and forget its destinations; their senders
        are kept on the peer (``dropped_senders``) for the fence of its session's next Hello.
        The request's other decode nodes, if any, are told as usual. A room it only reserved
        fails too (no write into it can run): its sender now, or at once when made."""
        reserved = [room for room in list(self.reservations) if self._unreserve_locked(room, peer)]
        for room in reserved:
            if room in peer.rooms:  # announced as well: below
                continue
            sender = self.senders.get(room)
            if sender is None:
                self.lost_before_sender[room] = LostDestination(reason, now)
            else:
                self._reporter.fail_locked(sender, reason)
        for room in list(peer.rooms):
            sender = self.senders.get(room)
            if sender is None:  # offered on ``incoming``: a sender made later fails at once
                self.lost_before_sender[room] = LostDestination(reason, now)
            else:
                peer.dropped_senders.append(sender)
                if sender.state.fail(reason, now):
                    self._counters.request_failed(reason)
            destinations = self.destinations.get(room)
            mine = destinations.of(peer) if destinations is not None else None
            if mine is not None:
                self._leave_locked(room, mine)
            if sender is not None:
                self._reporter.report_failure_locked(sender, in_flight=False)

    def _leave_locked(self, room: int, destination: DecodeDestination) -> None:
        """``destination``'s decode node no longer receives ``room``."""
        destinations = self.destinations[room]
        destinations.members.remove(destination)
        destination.peer.rooms.discard(room)
        if not destinations.members:
            del self.destinations[room]

    def _drop_destinations_locked(self, room: int, reason: str) -> None:
        """Forget every decode node's destination of ``room`` and refuse it to each."""
        destinations = self.destinations.pop(room)
        for destination in destinations.members:
            destination.peer.rooms.discard(room)
            self._reporter.refuse(destination.peer, room, reason,
                                  tell=not destinations.nothing_to_send)

    # ---- the tick (the control loop) -------------------------------------------------------

    def expire_locked(self, now: float) -> None:
        """Fail the requests past their deadline, forget the finished ones no write of which can
        still run, and the lost destinations older than the request timeout."""
        for sender in list(self.senders.values()):
            if sender.state.status not in TERMINAL and now > sender.state.deadline:
                self._reporter.fail_locked(sender, f"timed out after {self.request_timeout_s:.0f}s")
            if sender.can_release() and (sender.reported or now > self._kept_until(sender)
                                         or sender.state.status == KVPoll.Success):
                self._forget_locked(sender)
        if self.lost_before_sender:
            self.lost_before_sender = {room: lost for room, lost in self.lost_before_sender.items()
                                       if now - lost.at <= self.request_timeout_s}

    def _kept_until(self, sender: KVSender) -> float:
        """Until when a failed request nobody was told of stays on record (so that decode's
        pages or reservation arriving later are refused): its deadline, or, for a deferred one
        that failed before ``prefill_complete`` (no deadline), the timeout after its failure."""
        if sender.state.deadline == math.inf and sender.state.finished_at is not None:
            return sender.state.finished_at + self.request_timeout_s
        return sender.state.deadline

    def refuse_unclaimed_locked(self, now: float) -> None:
        """Refuse the requests decode announced or reserved that no sender claimed within the
        timeout."""
        unclaimed = "no prefill request for this room"
        for room, destinations in list(self.destinations.items()):
            announced = destinations.members[0].received_at
            if room not in self.senders and now - announced > self.request_timeout_s:
                self._drop_destinations_locked(room, unclaimed)
        for room, reservations in list(self.reservations.items()):
            if room in self.senders:
                continue
            for reservation in reservations:
                if now - reservation.received_at > self.request_timeout_s:
                    self._unreserve_locked(room, reservation.peer)
                    self._reporter.refuse(reservation.peer, room, unclaimed)

    def _forget_locked(self, sender: KVSender) -> None:
        """Drop a finished request, and the reservations it saw; the application keeps its sender
        object and its state."""
        room = sender.room
        self.senders.pop(room, None)
        destinations = self.destinations.pop(room, None)
        for destination in destinations.members if destinations is not None else []:
            destination.peer.rooms.discard(room)
        finished_at = sender.state.finished_at
        later = [r for r in self.reservations.pop(room, []) if finished_at is not None
                 and r.received_at > finished_at and sender.state.status == KVPoll.Success]
        if later:  # for the room's next request
            self.reservations[room] = later
