"""The decode side's node: handshakes with prefill nodes and receives requests into its pool.

``DecodeNode`` registers its pool (``node_runtime``), connects to one or more prefill control
endpoints and handshakes with each (``sessions.Handshaker``: layout, hash, buffers and the
indexer layers it reads; a mismatch, or a layer of decode's that no prefill holds, raises
HandshakeError before anything else happens). ``receiver`` makes a ``receiver.KVReceiver`` for a
request, fed by the prefill node that holds all its layers or by the pipeline stages that together
hold each layer once (``stages``); the request sends them its pages and settles itself,
to Success (every stage's part arrived, exactly once) or to Failed with a reason: a prefill
failure, an abort, a missed deadline, or a prefill that stopped answering. Aux buffers
(``aux_buffers``: one slot per request in each) are announced in the handshake; a request's slot
(``init(..., aux_index=)``) is filled by the stage that holds the last layer, and counted in that
stage's bytes. Deferred allocation (``receiver(..., reserve=True)``): the request is reserved with
its prefill nodes before any page is allocated, and ``KVReceiver.prefill_ready`` says when they
have computed it (``PrefillReady``); the application then allocates and calls ``init``.

Decode's own indexer pages (``init(..., index_page_ids=)``): where the application holds the
KV and the indexer in different pools (sglang's HiSparse decode: KV in a host pool whose page 0
is a page, ``kv_page_zero``, the indexer in the device pool), the request names both lists,
as many pages each; prefill then writes each cache into its own pages, on the direct route. KV
layers the application keeps with the indexer (``kv_on_index_pages``: HiSparse's draft model
KV, on the device) are written into the indexer's pages.

A staging area (``staging_bytes``; ``scatter.SliceScatter``) is registered with the pool and
split among the prefill nodes, each offered its share in its Hello: a prefill node may then send
a chunk of many small descriptors as a few slices written there, which decode scatters into the
request's pages (the staged route; ``staging_bytes=0``: none offered, every chunk direct).

The node coordinates; its control thread routes what arrives and runs the tick:

- a staged slice goes to the scatter thread (``SliceScatter.slice_written_locked``); a chunk
  report or a re-handshake's answer keeps its order behind the slices queued before them
  (``SliceScatter.hold_locked``) and is handled here, on the control thread, once they are
  through (``_release_held``, run after every round of the control loop);
- a chunk report goes to its request (``KVReceiver.chunk_reported_locked``); with ``checksums`` on,
  a counted chunk then goes, with its pages, to the verifier thread (``verify.ChunkVerifier``),
  which hands its outcome forward to the request (``KVReceiver.chunk_verified``); without, a
  last chunk completes the prefill's part (``KVReceiver.part_done_locked``);
- the tick marks a prefill silent for ``peer_timeout_s`` dead (``liveness``): every request it may
  still write into is quarantined and the running ones fail; requests to it meanwhile fail at once.
  A dead prefill is offered a new handshake of this node's session, with backoff
  (``sessions.PeerSession``); its answer, sent only once none of its old writes can run, or
  its process proven gone (its control connection closed and refused, ``PrefillPeer.watch_link``),
  lifts the quarantines. ``quarantine_timeout_s`` bounds a quarantine (counted as an expiry). The
  tick also runs the requests' deadlines and sends the heartbeats.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable

import zmq

from .. import protocol
from ..backends.base import TransferBackend
from ..counters import Counters
from ..handshake import check_index_reads, check_kv_on_index_pages, pool_buffers
from ..node_runtime import NodeRuntime
from ..plan import as_aux_buffers
from ..request import KVPoll
from .receiver import KVReceiver, PageLimits, ReceiverContext
from .scatter import SliceScatter
from .sessions import Handshaker, PrefillPeer
from .stages import StageChoice
from .verify import ChunkVerifier

log = logging.getLogger(__name__)


class DecodeNode:
    """Receives requests from prefill nodes into one pool through one engine backend.

    One plain lock guards the request table, every request's state, parts and fence, and the
    peers' liveness; the application thread, the control thread and the verifier thread take it,
    never twice (methods named ``..._locked``, here and in ``KVReceiver``, expect it held)."""

    def __init__(self, pool, backend: TransferBackend, prefill: str | list[str], *,
                 name: str | None = None, handshake_timeout_s: float = 10.0,
                 request_timeout_s: float = 60.0, peer_timeout_s: float = 5.0,
                 heartbeat_s: float = 0.5, in_flight_grace_s: float = 35.0,
                 quarantine_timeout_s: float = 600.0, secret: bytes = b"",
                 index_reads: Iterable[int] | None = None, checksums: bool = False,
                 aux_buffers=(), staging_bytes: int | None = None, slice_bytes: int | None = None,
                 kv_page_zero: bool = False, kv_on_index_pages: Iterable[int] = ()):
        if not quarantine_timeout_s > 0:
            raise ValueError(f"quarantine_timeout_s must be > 0, got {quarantine_timeout_s}")
        self.pool = pool
        self.layout = pool.layout
        self.index_reads = check_index_reads(self.layout, index_reads)
        self.backend = backend
        self.name = name or f"decode-{os.getpid()}"
        self.request_timeout_s = request_timeout_s
        self.in_flight_grace_s = in_flight_grace_s
        self.quarantine_timeout_s = quarantine_timeout_s
        self.secret = secret
        self.checksums = checksums  # verify every chunk's pages (may change between requests)
        self.session = os.urandom(16)
        self.counters = Counters()
        self._lock = threading.Lock()
        self._receivers: dict[int, KVReceiver] = {}
        self.buffers = pool_buffers(pool)
        self.aux_buffers = as_aux_buffers(aux_buffers)  # (ptr, nbytes, item_len): host memory
        limits = PageLimits.of(self.buffers, kv_page_zero,
                               check_kv_on_index_pages(self.layout, kv_on_index_pages))
        endpoints = [prefill] if isinstance(prefill, str) else list(prefill)
        self._scatter = SliceScatter(pool, self.name, self._lock, peers=len(endpoints),
                                     send=self._send, staging_bytes=staging_bytes,
                                     slice_bytes=slice_bytes)
        self.counters.add(staging_bytes=self._scatter.nbytes)
        try:
            regions = self.buffers + self.aux_buffers + self._scatter.regions()
            self._runtime = NodeRuntime(self.name, backend, regions, self.counters,
                                        on_message=self._on_message, on_tick=self._on_tick,
                                        on_round=self._release_held, heartbeat_s=heartbeat_s,
                                        peer_timeout_s=peer_timeout_s, paced=True)
        except BaseException:
            self._scatter.close()
            raise
        self._liveness = self._runtime.liveness
        self._loop = self._runtime.loop
        try:
            self._handshaker = Handshaker(self.name, backend, self.layout, self.buffers,
                                          self.aux_buffers, self.index_reads, secret=secret,
                                          session=self.session, counters=self.counters,
                                          socket=self._runtime.socket, kv_page_zero=kv_page_zero,
                                          kv_on_index_pages=limits.kv_on_index_pages)
            self.peers = [self._handshaker.connect(e, handshake_timeout_s, area)
                          for e, area in zip(endpoints, self._scatter.areas, strict=True)]
            self._stages = StageChoice(self.layout, self.peers)
        except BaseException:
            self._scatter.close()
            self._runtime.close()
            raise
        self._context = ReceiverContext(self.name, self._lock, self.counters, self._loop.send,
                                        limits, self.aux_buffers, request_timeout_s,
                                        in_flight_grace_s, quarantine_timeout_s)
        self._verifier = ChunkVerifier(pool, self.name, limits.kv_on_index_pages)
        self._runtime.start([peer.socket for peer in self.peers])

    # ---- application API -------------------------------------------------------------------

    def receiver(self, room: int, prefill: str | list[str] | None = None, *,
                 reserve: bool = False, shares: bool = False) -> KVReceiver:
        """A request fed by ``prefill``: one endpoint, or the endpoints of pipeline stages that
        together hold each of this pool's layers exactly once (ValueError naming the layer
        otherwise). Default: the first prefill node that holds every layer, else all of them.
        ``shares``: the ``prefill`` nodes each hold every layer and write a share of the
        request's pages, which only they know (sglang's KV sharding, prefill CP's page split):
        each of their chunks names its pages, and the request succeeds once every page was
        written by exactly one of them.
        ``reserve`` (deferred allocation): tell them now (``Reserve``) that this node will
        allocate the request's pages once its prefill has run (``KVReceiver.prefill_ready``)."""
        peers = self._stages.peers_for(prefill, shares=shares)
        if reserve and not 0 <= room <= protocol.MAX_ROOM:
            raise ValueError(f"room {room} is not in 0..2**63-1")
        with self._lock:
            if room in self._receivers:
                raise ValueError(f"room {room} already has a receiver")
            receiver = KVReceiver(room, peers, self._context, reserve=reserve, shares=shares)
            self._receivers[room] = receiver
            for peer in peers if reserve else []:
                if peer.alive:  # a dead one fails the request at the next tick
                    self._loop.send(peer.socket, protocol.Reserve(room))
        return receiver

    def nothing_to_send(self, room: int, prefill: list[str], *, prefix_tokens: int = 0) -> None:
        """Tell the prefill nodes ``prefill`` (endpoints of this node's peers) that this node
        reads ``room`` from another prefill node, so their senders of it end with their last
        chunk, writing nothing (a prefill wider than decode's attention TP: sglang's dummy
        ranks); ``prefix_tokens`` as the request's own ``init`` gives it. Nothing is kept here:
        no page of this node is named."""
        if not 0 <= room <= protocol.MAX_ROOM:
            raise ValueError(f"room {room} is not in 0..2**63-1")
        if not isinstance(prefix_tokens, int) or prefix_tokens < 0:
            raise ValueError(f"prefix_tokens must be a non-negative int, got {prefix_tokens!r}")
        peers = {peer.endpoint: peer for peer in self.peers}
        unknown = [endpoint for endpoint in prefill if endpoint not in peers]
        if unknown:
            raise ValueError(f"{', '.join(unknown)}: not a prefill node of {self.name}")
        for endpoint in prefill:
            self._loop.send(peers[endpoint].socket,
                            protocol.RequestPages(room, [], 0, prefix_tokens=prefix_tokens,
                                                  nothing_to_send=True))

    def forget(self, receiver: KVReceiver) -> None:
        """Drop a finished request whose pages went back to the allocator."""
        with self._lock:
            if not receiver.releasable_locked(time.monotonic()):
                raise RuntimeError(f"room {receiver.room}: pages may still be written")
            self._receivers.pop(receiver.room, None)

    def unreachable(self) -> list[str]:
        """The prefill endpoints this node cannot reach now: silent, or their connection down."""
        with self._lock:
            return [peer.endpoint for peer in self.peers if not peer.alive or not peer.link.up]

    @property
    def requests(self) -> int:
        """Requests not yet forgotten (the application still holds them, or their pages)."""
        with self._lock:
            return len(self._receivers)

    def held_pages(self) -> int:
        """Failed requests' pages that may not go back to the allocator yet (quarantined too)."""
        now = time.monotonic()
        with self._lock:
            return sum(r.page_ids.size for r in self._receivers.values()
                       if r.page_ids is not None and r.state.status == KVPoll.Failed
                       and not r.releasable_locked(now))

    def quarantined_pages(self) -> int:
        """Pages held because a prefill that may still write into them went silent."""
        with self._lock:
            return sum(r.page_ids.size for r in self._receivers.values()
                       if r.page_ids is not None and r.fence.quarantined)

    def close(self) -> None:
        """Let the scatter and verifier finish what is queued, close loop, sockets, engine; once."""
        if self._runtime.closed:
            return
        self._scatter.close()
        self._verifier.close()
        self._runtime.close()

    def __enter__(self) -> DecodeNode:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- control plane (loop thread) -------------------------------------------------------

    def _on_message(self, sock: zmq.Socket, identity: bytes, message) -> None:
        with self._lock:
            peer = next((p for p in self.peers if p.socket is sock), None)
            if peer is None:
                return
            now = time.monotonic()
            peer.last_seen = now
            if isinstance(message, protocol.SliceWritten):
                self._scatter.slice_written_locked(peer, self._receivers.get(message.room), message)
            elif isinstance(message, (protocol.ChunkDone, protocol.HelloAck)):
                handler = self._on_chunk_locked if isinstance(message, protocol.ChunkDone) \
                    else self._on_ack_locked
                if not self._scatter.hold_locked((handler, peer, message)):  # behind the slices
                    handler(peer, message, now)
            elif isinstance(message, protocol.PrefillReady):  # a receiver gone meanwhile: ignored
                receiver = self._receivers.get(message.room)
                if receiver is not None and peer in receiver.peers:
                    receiver.prefill_ready_locked(peer, now)
            elif not isinstance(message, protocol.Heartbeat):
                raise protocol.ProtocolError(f"unexpected {type(message).__name__} from prefill")

    def _send(self, sock: zmq.Socket, message: protocol.Message) -> None:
        self._loop.send(sock, message)

    def _release_held(self, now: float) -> None:
        """Handle the messages held behind staged slices now through, in order (``_on_message``)."""
        if self._scatter.holding:
            with self._lock:
                for handler, peer, message in self._scatter.release_locked():
                    self._loop.handle(handler, peer, message, now)

    def _on_chunk_locked(self, peer: PrefillPeer, done: protocol.ChunkDone, now: float) -> None:
        """A chunk report goes to its request; a counted one then to the verifier, which hands
        its outcome to the request, or, without checksums, a last one completes the part. A
        refusal because prefill dropped this node (``unpaired``) first marks that prefill dead."""
        if done.unpaired and peer.alive:  # re-handshake now, not after a peer timeout of silence
            self._peer_dead_locked(peer, now, dropped=done.reason)
        receiver = self._receivers.get(done.room)
        if receiver is None or peer not in receiver.peers:
            raise protocol.ProtocolError(f"chunk report for unknown room {done.room}")
        if not receiver.chunk_reported_locked(peer, done, now):
            return
        if self.checksums:  # the part counts once the verifier has checked every chunk
            self._verifier.submit(receiver, done, peer, *receiver.chunk_pages(done))
        elif done.last:
            receiver.part_done_locked(peer, now)

    def _on_ack_locked(self, peer: PrefillPeer, ack: protocol.HelloAck, now: float) -> None:
        """A prefill answered a re-handshake (only once none of its old epochs' writes can run):
        every room quarantined on it is free, but those a failed engine write may still reach."""
        if self._handshaker.answered(peer, ack, now):
            self._peer_gone_locked(peer, now, set(ack.in_flight))
            peer.send_owed_aborts(self._loop.send)

    def _on_tick(self, now: float) -> None:
        with self._lock:
            for peer in self.peers:
                if peer.watch_link(now):
                    log.warning("%s: prefill %s: connection closed and refused for %.1fs: its "
                                "process is gone", self.name, peer.endpoint, now - peer.link.down_since)
                    self._peer_gone_locked(peer, now, set())
                if peer.alive and self._liveness.silent(peer.last_seen, now):
                    self._peer_dead_locked(peer, now)
                elif peer.session.retry_due(now) and peer.link.up:  # (link down: at reconnect)
                    self._loop.send(peer.socket, self._handshaker.offer(peer, now))
            for receiver in list(self._receivers.values()):
                receiver.tick_locked(now)
            if self._liveness.heartbeat_due(now):
                for peer in self.peers:  # not into a closed connection: a new process on
                    if peer.link.up:  # the port would get them first
                        self._loop.send(peer.socket, protocol.Heartbeat(time.time()))

    # ---- peers' liveness (control thread) --------------------------------------------------

    def _peer_dead_locked(self, peer: PrefillPeer, now: float, dropped: str = "") -> None:
        """``peer`` went silent, or dropped this node (``dropped``: prefill's words): the requests
        it may write into are quarantined, running ones fail, and it is offered a new handshake."""
        reason = peer.dead(self.name, now, self._liveness.peer_timeout_s, dropped)
        for receiver in self._receivers.values():
            if peer in receiver.peers:
                receiver.peer_silent_locked(peer, reason, now)

    def _peer_gone_locked(self, peer: PrefillPeer, now: float, in_flight: set[int]) -> None:
        """Proof that ``peer``'s old writes can no longer land (but the failed ones of the rooms
        in ``in_flight``, which the engine's own bound covers): lift its quarantines."""
        for receiver in self._receivers.values():
            receiver.peer_gone_locked(peer, now, in_flight=receiver.room in in_flight)
