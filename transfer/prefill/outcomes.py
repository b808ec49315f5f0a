"""What prefill tells decode about a request, and what it counts: ``ChunkReporter``.

The reporter owns the prefill side's ``ChunkDone`` messages and the end of a request. It works
on the request it is handed (a ``PrefillRequest``: its sender, destinations and reservations)
and reads no table of the node's:

- ``finish``: a chunk left the writer (called in the writer lane's thread, once per job, in queue
  order, with the job's request; it takes the node's lock). Written: counted and, unless the
  request failed meanwhile, reported to decode at once; the request succeeds with its last chunk
  into every decode node. Failed: the request fails. Either way the job leaves ``KVSender.busy``;
- ``fail_locked``: a request fails (counted and logged once). Decode is told once
  (``ChunkDone(ok=False)``), and only once no write of ours into its pages can still run
  (``busy == 0``) and while decode's destination for it is on record: a destination dropped with
  its decode node is reported through that node's next handshake instead (the fence). With
  several decode nodes (``Destinations``), each is told, and the request succeeds once each
  received its last chunk. Each decode node that only reserved the request (``Reservation``: no
  page of its was named, no write can run) is refused at once;
- ``refuse``: a request decode announced is refused before any sender is involved.
- ``ready``: a decode node that reserved a request is told its prefill finished.

Messages go through ``send`` (the control loop's thread-safe queue), so a lane reports without
waiting for the loop's tick. The reporter never submits to the writer; methods named ``_locked``
expect the node's lock held.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .. import protocol
from ..counters import Counters
from ..request import KVPoll
from .prefill_request import PrefillRequest
from .records import Chunk, DecodeDestination, DecodePeer
from .writer import Result

log = logging.getLogger(__name__)

Send = Callable[[protocol.Message, bytes], None]  # a message to the decode node of this identity


def _positions(chunk: Chunk) -> list[int] | None:
    """The request's pages a share writer's chunk wrote (None: a whole chunk)."""
    return None if chunk.positions is None else chunk.positions.tolist()


class ChunkReporter:
    """Reports chunks and failures to decode and counts them (see the module docstring)."""

    def __init__(self, name: str, lock: threading.Lock, counters: Counters, send: Send):
        self.name = name
        self.counters = counters
        self._lock = lock
        self._send = send

    def finish(self, result: Result) -> None:
        """One chunk left the writer: written, failed, or skipped (its request had failed)."""
        job = result.job
        request, sender = job.request, job.sender
        with self._lock:
            if result.ok:
                self._chunk_written_locked(request, job.destination, result, job.chunk.last)
            elif result.reason:
                if result.engine_failure and result.batch_index == 0:
                    self.counters.add(engine_failures=1)
                if result.in_flight:
                    sender.write_failed = True
                self.fail_locked(request, result.reason, in_flight=result.in_flight)
            sender.busy -= 1
            if sender.state.status == KVPoll.Failed:
                self.report_failure_locked(request, in_flight=result.in_flight)

    def fail_locked(self, request: PrefillRequest, reason: str, *, in_flight: bool = False) -> None:
        """Fail ``request``'s sender (a no-op once it is terminal) and tell decode when it may be
        told; a sender that succeeded has nothing to tell."""
        sender = request.sender
        if sender.state.fail(reason, time.monotonic()):
            self.counters.request_failed(reason)
            log.warning("%s: room %d failed: %s", self.name, sender.room, reason)
        if sender.state.status == KVPoll.Failed:
            self.report_failure_locked(request, in_flight=in_flight)

    def report_failure_locked(self, request: PrefillRequest, *, in_flight: bool) -> None:
        """Tell each decode node once, when no write of ours into its pages is still running
        (not one that received every chunk already: its request is whole); each decode node
        that only reserved it, at once."""
        sender = request.sender
        if sender.state.status == KVPoll.Failed:
            for peer in request.unrefused():
                self.refuse(peer, request.room, sender.state.reason)
        if sender.reported or sender.busy or request.destinations is None:
            return
        sender.reported = True
        for destination in [d for d in request.to_write() if not d.finished]:
            self._send(protocol.ChunkDone(
                request.room, destination.chunks_written, ok=False, last=True,
                reason=sender.state.reason, in_flight=in_flight or sender.write_failed),
                destination.peer.identity)

    def refuse(self, peer: DecodePeer, room: int, reason: str, *, tell: bool = True,
               unpaired: bool = False) -> None:
        """Refuse a request ``peer`` announced (no write of ours into its pages ever ran);
        ``tell`` False for a decode node that keeps no request to tell (nothing to send);
        ``unpaired`` where ``peer`` was dropped (it re-handshakes)."""
        log.warning("%s: refused room %d from %s: %s", self.name, room, peer.node, reason)
        if tell:
            self._send(protocol.ChunkDone(room, 0, ok=False, last=True, reason=reason,
                                          unpaired=unpaired), peer.identity)

    def ready(self, peer: DecodePeer, room: int) -> None:
        """Tell ``peer``, which reserved ``room``, that the request's prefill finished."""
        self._send(protocol.PrefillReady(room), peer.identity)

    def _chunk_written_locked(self, request: PrefillRequest, destination: DecodeDestination,
                              result: Result, last: bool) -> None:
        plan = result.plan
        sender = request.sender
        self.counters.record_write(result.seconds, plan.nbytes, plan.descriptors)
        if result.slices:
            self.counters.add(staged_chunks=1, staging_slices=result.slices)
        sender.chunks_sent += 1
        sender.nbytes += plan.nbytes
        destination.chunks_written += 1
        if sender.state.status == KVPoll.Failed:  # aborted while writing: already reported
            return
        self._send(protocol.ChunkDone(
            request.room, destination.chunks_written - 1, ok=True, last=last, nbytes=plan.nbytes,
            descriptors=plan.descriptors, write_seconds=result.seconds, checksums=result.sums,
            slices=result.slices, positions=_positions(result.job.chunk)), destination.peer.identity)
        destination.finished = last
        everywhere = request.destinations is not None and all(
            d.finished for d in request.destinations.members)
        if everywhere and sender.state.advance(KVPoll.Success, time.monotonic()):
            state = sender.state
            self.counters.request_ok(state.finished_at - (state.transferring_at or state.created))
