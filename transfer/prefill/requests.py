"""The prefill node's requests: each one's sender, its destination at decode, and its way to the
writer.

``RequestBook`` keeps three tables, all guarded by the node's lock:

- ``destinations``: room -> where decode wants the request's pages (``DecodeDestination``), from
  decode's ``RequestPages`` until the request is finished, refused, or its decode node dropped
  (shared with the ``ChunkReporter``, which reads it);
- ``senders``: room -> the application's ``KVSender``, until the request is finished and no write
  of it can still run;
- ``lost_before_sender``: room -> why and when decode's destination was lost (its decode node was
  dropped, or decode gave the request up before sending its pages) before the application made
  the request's sender: a sender made later fails at once.

One request's path: the application makes its sender (``new_sender``), ``init``s it and ``send``s
its page ids in chunks; decode announces its pages (``announced_locked``); once both are known,
each queued chunk becomes a writer ``Job`` (``_dispatch_locked``), counted in ``KVSender.busy``.
What becomes of the job goes from the writer's lane to the ``ChunkReporter``, not back here; every
failure and refusal is the reporter's too. Methods named ``_locked`` expect the node's lock held;
the others take it.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

from ...plugin.descriptors import BufferDescriptor
from .. import protocol
from ..counters import Counters
from ..plan import PlanError, as_page_ids, check_aux_index, check_destination
from ..request import TERMINAL, KVPoll
from .outcomes import ChunkReporter
from .records import Chunk, DecodeDestination, DecodePeer, IncomingRequest, KVSender
from .writer import Job, Writer

MAX_ROOM = 2**63 - 1  # room ids are SGLang bootstrap rooms: non-negative 63-bit


@dataclass(frozen=True)
class LostDestination:
    """Why and when decode's destination of a request without a sender was lost."""

    reason: str
    at: float


def _page_count_mismatch(prefill: int, decode: int) -> str:
    return f"page count mismatch: prefill has {prefill} pages, decode allocated {decode}"


class RequestBook:
    """The node's requests and their tables (see the module docstring)."""

    def __init__(self, name: str, lock: threading.Lock, *,
                 destinations: dict[int, DecodeDestination], reporter: ChunkReporter,
                 writer: Writer, counters: Counters, incoming: queue.Queue[IncomingRequest],
                 aux_buffers: list[BufferDescriptor], request_timeout_s: float):
        self.name = name
        self.destinations = destinations
        self.senders: dict[int, KVSender] = {}
        self.lost_before_sender: dict[int, LostDestination] = {}
        self.aux_buffers = aux_buffers
        self.request_timeout_s = request_timeout_s
        self._lock = lock
        self._reporter = reporter
        self._writer = writer
        self._counters = counters
        self._incoming = incoming

    # ---- the application's calls (its thread) ----------------------------------------------

    def new_sender(self, room: int) -> KVSender:
        with self._lock:
            if room in self.senders:
                raise ValueError(f"room {room} already has a sender")
            sender = KVSender(self, room, self.request_timeout_s)
            self.senders[room] = sender
            if room in self.destinations:
                sender.state.advance(KVPoll.WaitingForInput, time.monotonic())
                sender.decode_prefix_tokens = self.destinations[room].prefix_tokens
            lost = self.lost_before_sender.pop(room, None)
            if lost is not None:  # its decode node was dropped before the application came
                self._reporter.fail_locked(sender, lost.reason)
            return sender

    def init_sender(self, sender: KVSender, num_pages: int, aux_index: int | None) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        try:
            sender.aux_index = check_aux_index(self.aux_buffers, aux_index, "aux_index")
        except PlanError as exc:
            raise ValueError(str(exc)) from None
        with self._lock:
            if sender.num_pages is not None:
                raise ValueError(f"room {sender.room}: init called twice")
            sender.num_pages = num_pages
            destination = self.destinations.get(sender.room)
            if destination is not None and len(destination.dst_pages) != num_pages:
                self._reporter.fail_locked(sender, _page_count_mismatch(
                    num_pages, len(destination.dst_pages)))

    def send_chunk(self, sender: KVSender, page_ids: object) -> None:
        pages = as_page_ids(page_ids, "page_ids")
        with self._lock:
            if sender.state.status in TERMINAL:
                return
            if sender.num_pages is None:
                raise ValueError(f"room {sender.room}: send before init")
            if pages.size == 0 or sender.pages_sent + pages.size > sender.num_pages:
                self._reporter.fail_locked(
                    sender, f"chunk of {pages.size} pages after {sender.pages_sent} does not fit "
                    f"the request's {sender.num_pages} pages")
                return
            offset = sender.pages_sent
            sender.pages_sent += pages.size
            sender.pending.append(Chunk(offset, pages, sender.pages_sent == sender.num_pages))
            self._dispatch_locked(sender)

    def abort(self, sender: KVSender, reason: str) -> None:
        with self._lock:
            self._reporter.fail_locked(sender, reason)

    def _dispatch_locked(self, sender: KVSender) -> None:
        """Hand queued chunks to the writer once decode's pages are known."""
        destination = self.destinations.get(sender.room)
        if destination is None or not sender.pending:
            return
        sender.state.advance(KVPoll.Transferring, time.monotonic())
        for chunk in sender.pending:
            sender.busy += 1
            self._writer.submit(Job(sender, destination, chunk))
        sender.pending.clear()

    # ---- decode's messages (the control loop) ----------------------------------------------

    def announced_locked(self, peer: DecodePeer, request: protocol.RequestPages) -> None:
        """Decode's pages for a request: offered on ``incoming`` until its sender comes."""
        if not 0 <= request.room <= MAX_ROOM:
            self._reporter.refuse(peer, request.room, f"room {request.room} is not in 0..2**63-1")
            return
        if request.room in self.destinations:
            self._duplicate_locked(peer, request.room)
            return
        if request.prefix_tokens < 0:
            self._reporter.refuse(peer, request.room, f"prefix_tokens {request.prefix_tokens} < 0")
            return
        try:
            dst = check_destination(peer.pairs, request.dst_pages)
            aux = check_aux_index([p.dst for p in peer.aux_pairs], request.aux_index,
                                  "decode's aux_index")
        except PlanError as exc:
            self._reporter.refuse(peer, request.room, f"bad pages: {exc}")
            return
        self.destinations[request.room] = DecodeDestination(peer, dst, request.num_tokens,
                                                            time.monotonic(), aux,
                                                            request.prefix_tokens)
        peer.rooms.add(request.room)
        sender = self.senders.get(request.room)
        if sender is None:
            self._incoming.put(IncomingRequest(request.room, dst.size, request.num_tokens, peer.node,
                                               request.prefix_tokens))
            return
        sender.decode_prefix_tokens = request.prefix_tokens
        if sender.state.status == KVPoll.Failed:  # failed before decode's pages arrived
            self._reporter.report_failure_locked(sender, in_flight=False)
            return
        sender.state.advance(KVPoll.WaitingForInput, time.monotonic())
        if sender.num_pages is not None and sender.num_pages != dst.size:
            self._reporter.fail_locked(sender, _page_count_mismatch(sender.num_pages, dst.size))
            return
        self._dispatch_locked(sender)

    def _duplicate_locked(self, peer: DecodePeer, room: int) -> None:
        """A room announced again. From another decode node, the newcomer's request is the one
        refused. From the same node, it no longer knows which pages it meant: the room fails,
        and, like any failure, is reported only once no write of ours into it can still land."""
        destination = self.destinations[room]
        sender = self.senders.get(room)
        if destination.peer is not peer or sender is None:
            if destination.peer is peer:
                del self.destinations[room]
                peer.rooms.discard(room)
            self._reporter.refuse(peer, room, f"duplicate room {room}")
            return
        self._reporter.fail_locked(sender, f"duplicate room {room}")

    def aborted_locked(self, peer: DecodePeer, abort: protocol.Abort) -> None:
        destination = self.destinations.get(abort.room)
        if destination is not None and destination.peer is not peer:
            raise protocol.ProtocolError(f"abort of room {abort.room}, which another decode "
                                         f"node announced")
        sender = self.senders.get(abort.room)
        if abort.before_pages and destination is None:  # nothing to answer: no page was asked
            self._decode_gave_up_locked(abort.room, f"aborted by decode: {abort.reason}")
            return
        if sender is None or destination is None:
            self.destinations.pop(abort.room, None)
            peer.rooms.discard(abort.room)
            self._reporter.refuse(peer, abort.room, f"aborted by decode: {abort.reason}")
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
        """Fail a dropped decode node's requests and forget their destinations; their senders
        are kept on the peer (``dropped_senders``) for the fence of its session's next Hello."""
        for room in list(peer.rooms):
            sender = self.senders.get(room)
            if sender is None:  # offered on ``incoming``: a sender made later fails at once
                self.lost_before_sender[room] = LostDestination(reason, now)
            else:
                peer.dropped_senders.append(sender)
                if sender.state.fail(reason, now):
                    self._counters.request_failed(reason)
            self.destinations.pop(room, None)

    # ---- the tick (the control loop) -------------------------------------------------------

    def expire_locked(self, now: float) -> None:
        """Fail the requests past their deadline, forget the finished ones no write of which can
        still run, and the lost destinations older than the request timeout."""
        for sender in list(self.senders.values()):
            if sender.state.status not in TERMINAL and now > sender.state.deadline:
                self._reporter.fail_locked(sender, f"timed out after {self.request_timeout_s:.0f}s")
            if sender.can_release() and (sender.reported or now > sender.state.deadline
                                         or sender.state.status == KVPoll.Success):
                self._forget_locked(sender.room)
        if self.lost_before_sender:
            self.lost_before_sender = {room: lost for room, lost in self.lost_before_sender.items()
                                       if now - lost.at <= self.request_timeout_s}

    def refuse_unclaimed_locked(self, now: float) -> None:
        """Refuse the requests decode announced that no sender claimed within the timeout."""
        for room, destination in list(self.destinations.items()):
            if room not in self.senders and now - destination.received_at > self.request_timeout_s:
                del self.destinations[room]
                destination.peer.rooms.discard(room)
                self._reporter.refuse(destination.peer, room, "no prefill request for this room")

    def _forget_locked(self, room: int) -> None:
        """Drop a finished request; the application keeps its sender object and its state."""
        self.senders.pop(room, None)
        destination = self.destinations.pop(room, None)
        if destination is not None:
            destination.peer.rooms.discard(room)
