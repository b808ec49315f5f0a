"""The decode side: handshakes with prefill nodes and receives requests into its pool.

``DecodeNode`` registers its pool, connects to one or more prefill control endpoints and
handshakes with each (layout, hash, buffers and the indexer layers it reads; a mismatch raises
HandshakeError before anything else happens). A ``KVReceiver`` per request sends the pages decode
allocated to the prefill node that holds all its layers, or to the pipeline stages that together
hold each layer once, and follows the request to Success — every stage's part arrived, exactly
once — or to Failed with a reason: a prefill failure, an abort, a missed deadline, or a prefill
that stopped answering. With ``checksums`` on, a stage's part counts as arrived only once the
verifier thread has checked each of its pages in each of its buffers against the checksums
prefill sent. Pages of a failed request are held back until no write into them can still land
(``request_fence.RoomBook`` decides): a prefill that went silent while it might still write keeps them
quarantined until it is proven unable to (it answers a new handshake of this node's session,
which it sends only once none of its old writes can run, or its process is gone), or until
``quarantine_timeout_s`` (counted as an expiry). A prefill marked dead is offered that new
handshake, with backoff, from the control thread; requests to it meanwhile fail at once.
Aux buffers (``aux_buffers``: one slot per request in each) are announced in the handshake; a
request's slot (``init(..., aux_index=)``) is filled by the stage that holds the last layer, and
counted in that stage's bytes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import msgspec
import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from ..plugin.layout import DSALayout
from . import auth, checksum, protocol, receive_limits
from .backends.base import TransferBackend
from .control import parse_endpoint, zmq_address
from .counters import Counters
from .handshake import (
    BufferKey,
    HandshakeError,
    buffer_infos,
    check_index_reads,
    check_peer,
    check_stages,
    pool_buffers,
    transfer_set,
)
from .node_runtime import NodeRuntime
from .plan import PlanError, as_aux_buffers, as_page_ids, check_aux_index, check_pages
from .request import TERMINAL, KVPoll, RequestHandle
from .request_fence import RoomBook
from .verify import ChunkVerifier

log = logging.getLogger(__name__)


# A prefill's control connection closed and its port refusing connections (ZMQ reconnects every
# RECONNECT_IVL_MS; a live process, even a frozen one, accepts them) for this long proves its
# process gone; the time also covers bytes already queued in our own engine.
DEAD_PEER_GRACE_S = 1.0
RECONNECT_IVL_MS = 100
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 10.0  # backoff of the re-handshakes with a dead prefill


@dataclass
class PrefillPeer:
    endpoint: str
    node: str
    socket: zmq.Socket
    last_seen: float
    layout: DSALayout
    keys: list[BufferKey]  # the (layer, cache) buffers this prefill writes into ours
    page_bytes: int  # bytes it writes per request page: the item lengths of ``keys``
    monitor: zmq.Socket | None = None  # the control socket's connect/disconnect events
    alive: bool = True
    epoch: int = 0  # of our latest Hello to it
    hello: protocol.Hello | None = None  # a re-handshake waiting for its answer
    retry_at: float = 0.0
    backoff_s: float = RETRY_FIRST_S
    link_down_since: float | None = None  # control connection closed, no reconnect since
    proven_gone: bool = False  # its old process can write no more (until it comes back)


class KVReceiver(RequestHandle):
    """One request on the decode side (SGLang's BaseKVReceiver semantics), fed by one prefill
    node or by several that each hold a part of the layers (pipeline stages). Success once every
    one of them has written all of its part, exactly once."""

    def __init__(self, node: DecodeNode, room: int, peers: list[PrefillPeer], timeout_s: float):
        super().__init__(room, timeout_s)
        self.node = node
        self.peers = peers
        self.book = RoomBook(p.endpoint for p in peers)
        self.page_ids: np.ndarray | None = None
        self.aux_index: int | None = None
        self.chunks = 0
        self.nbytes = 0
        self.descriptors = 0
        self.write_seconds = 0.0
        self.checksums_verified = 0
        self.started_at: float | None = None

    @property
    def components(self) -> list[BufferKey]:
        """Every (layer, cache) buffer this request fills, in layer order."""
        return sorted(key for p in self.peers for key in p.keys)

    @property
    def received(self) -> dict[str, int]:
        return self.book.received

    @property
    def finished(self) -> set[str]:
        return self.book.finished

    def init(self, page_ids, num_tokens: int = 0, aux_index: int | None = None) -> None:
        """Send the pages decode allocated for this request (and its aux slot) to its prefill
        node(s)."""
        try:
            self.aux_index = check_aux_index(self.node.aux_buffers, aux_index, "aux_index")
        except PlanError as exc:
            raise ValueError(str(exc)) from None
        self.node._init_receiver(self, page_ids, num_tokens)

    def _aux_peer(self) -> PrefillPeer | None:
        """The prefill that writes the aux slot: the one holding the last layer."""
        if self.aux_index is None:
            return None
        return max(self.peers, key=lambda p: max(p.layout.layer_ids))

    def abort(self, reason: str = "aborted by decode") -> None:
        self.node._abort(self, reason)

    def can_release(self) -> bool:
        """True once the request's pages may go back to the allocator (invariant 8)."""
        return self.node._can_release(self)


class DecodeNode:
    """Receives requests from prefill nodes into one pool through one engine backend.

    One plain lock guards the request table, every request's state and book, and the peers'
    liveness; the application thread, the control thread and the verifier thread take it, never
    twice (methods named ``_..._locked`` and the ones they call expect it held)."""

    def __init__(self, pool, backend: TransferBackend, prefill: str | list[str], *,
                 name: str | None = None, handshake_timeout_s: float = 10.0,
                 request_timeout_s: float = 60.0, peer_timeout_s: float = 5.0,
                 heartbeat_s: float = 0.5, in_flight_grace_s: float = 35.0,
                 quarantine_timeout_s: float = 600.0,
                 secret: bytes = b"", index_reads: Iterable[int] | None = None,
                 checksums: bool = False, aux_buffers=()):
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
        self._page_limit = min(b.num_items for b in self.buffers)
        self._items = {(b.layer_id, b.kind): b.item_len for b in self.buffers}
        self._runtime = NodeRuntime(self.name, backend, self.buffers + self.aux_buffers, self.counters,
                                    on_message=self._on_message, on_tick=self._on_tick,
                                    heartbeat_s=heartbeat_s, peer_timeout_s=peer_timeout_s)
        self._liveness = self._runtime.liveness
        self._loop = self._runtime.loop
        endpoints = [prefill] if isinstance(prefill, str) else list(prefill)
        try:
            self._engine_metadata = backend.metadata()
            self.peers = [self._handshake(e, handshake_timeout_s) for e in endpoints]
            held = {lid for peer in self.peers for lid in peer.layout.layer_ids}
            missing = [lid for lid in self.layout.layer_ids if lid not in held]
            if missing:
                raise HandshakeError(f"layer sets: layer {missing[0]} is held by none of the prefill "
                                     f"nodes ({', '.join(endpoints)})")
        except BaseException:
            self._runtime.close()
            raise
        self._stages: dict[str | tuple[str, ...] | None, list[PrefillPeer]] = {}  # checked choices
        self._verifier = ChunkVerifier(pool, self.name, self._on_verified)
        self._runtime.start([peer.socket for peer in self.peers])

    # ---- application API -------------------------------------------------------------------

    def receiver(self, room: int, prefill: str | list[str] | None = None) -> KVReceiver:
        """A request fed by ``prefill``: one endpoint, or the endpoints of pipeline stages that
        together hold each of this pool's layers exactly once (ValueError naming the layer
        otherwise). Default: the first prefill node that holds every layer, else all of them."""
        peers = self._request_peers(prefill)
        with self._lock:
            if room in self._receivers:
                raise ValueError(f"room {room} already has a receiver")
            receiver = KVReceiver(self, room, peers, self.request_timeout_s)
            self._receivers[room] = receiver
        return receiver

    def forget(self, receiver: KVReceiver) -> None:
        """Drop a finished request whose pages went back to the allocator."""
        with self._lock:
            if not receiver.state.can_release(time.monotonic()):
                raise RuntimeError(f"room {receiver.room}: pages may still be written")
            self._receivers.pop(receiver.room, None)

    def held_pages(self) -> int:
        """Pages of failed requests that may not go back to the allocator yet (invariant 8),
        quarantined ones included."""
        now = time.monotonic()
        with self._lock:
            return sum(r.page_ids.size for r in self._receivers.values()
                       if r.page_ids is not None and r.state.status == KVPoll.Failed
                       and not r.state.can_release(now))

    def quarantined_pages(self) -> int:
        """Pages held because a prefill that may still write into them went silent."""
        with self._lock:
            return sum(r.page_ids.size for r in self._receivers.values()
                       if r.page_ids is not None and r.book.quarantined)

    def close(self) -> None:
        """Let the verifier finish what is queued, then close the runtime: loop, sockets,
        engine. Idempotent."""
        if self._runtime.closed:
            return
        self._verifier.close()
        self._runtime.close()

    def __enter__(self) -> DecodeNode:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- handshake -------------------------------------------------------------------------

    def _hello(self, epoch: int) -> protocol.Hello:
        hello = protocol.Hello(
            protocol.PROTOCOL_VERSION, self.name, self.backend.name, self.layout.to_dict(),
            self.layout.layout_hash(), self._engine_metadata, buffer_infos(self.buffers),
            list(self.index_reads), nonce=os.urandom(16), sent_at=time.time(),
            session=self.session, epoch=epoch,
            aux_buffers=self.aux_buffers)
        if self.secret:
            hello = msgspec.structs.replace(
                hello, auth=auth.sign(self.secret, protocol.signed_bytes(hello)))
        return hello

    def _check_ack(self, endpoint: str, hello: protocol.Hello,
                   ack: protocol.HelloAck) -> tuple[DSALayout, list[BufferKey]]:
        """The prefill's layout and what it writes into us, from its answer to ``hello``."""
        if not ack.ok:
            raise HandshakeError(f"prefill {endpoint} refused the handshake: {ack.reason}")
        if self.secret and not auth.verify(self.secret, ack.auth, b"ack", hello.nonce,
                                           protocol.signed_bytes(ack)):
            raise HandshakeError(f"prefill {endpoint} did not prove the shared secret")
        layout = check_peer(self.layout, self.backend.name, version=ack.version,
                            peer_backend=self.backend.name, peer_layout=ack.layout,
                            peer_hash=ack.layout_hash)
        return layout, transfer_set(layout, self.layout, self.index_reads)

    def _handshake(self, endpoint: str, timeout_s: float) -> PrefillPeer:
        """The first handshake (constructor thread, before the loop starts)."""
        host, port = parse_endpoint(endpoint, "prefill")
        limit = receive_limits.decode_receive_bytes(self.layout, self.buffers)
        sock = self._runtime.socket(zmq.DEALER, limit)
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 0)
        sock.connect(zmq_address(host, port))
        hello = self._hello(0)
        sock.send(protocol.encode(hello))
        deadline = time.monotonic() + timeout_s
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not sock.poll(remaining_ms):
                sock.close(0)
                raise HandshakeError(f"prefill {endpoint} did not answer within {timeout_s:.0f}s")
            try:
                ack = protocol.decode(sock.recv())
            except protocol.ProtocolError as exc:
                sock.close(0)
                raise HandshakeError(f"prefill {endpoint}: {exc}") from exc
            if isinstance(ack, protocol.HelloAck):
                break
        try:
            layout, keys = self._check_ack(endpoint, hello, ack)
        except HandshakeError:
            sock.close(0)
            raise
        self.counters.add(handshakes_ok=1)
        return PrefillPeer(endpoint, ack.node, sock, time.monotonic(), layout, keys,
                           sum(self._items[key] for key in keys),
                           monitor=sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED))

    def _rehandshake_locked(self, peer: PrefillPeer, now: float) -> None:
        """Offer a dead prefill a new epoch of our session (control thread, never waits: its
        answer arrives as a message); retried with backoff until it answers, and at once when
        the control connection is made again (a new process on the port gets a Hello, not the
        pile that would have queued while nobody listened)."""
        peer.epoch += 1
        peer.hello = self._hello(peer.epoch)
        peer.retry_at = now + peer.backoff_s
        peer.backoff_s = min(peer.backoff_s * 2, RETRY_MAX_S)
        self._loop.send(peer.socket, peer.hello)

    def _on_ack_locked(self, peer: PrefillPeer, ack: protocol.HelloAck, now: float) -> None:
        """A prefill answered a re-handshake: it is back, and (it answers only once none of the
        old epochs' writes can still run) every room quarantined on it is free, but the rooms it
        names as possibly still written by a failed engine write."""
        if peer.alive or peer.hello is None or ack.epoch != peer.epoch:
            return  # the answer to an earlier Hello: a later one is on its way
        try:
            layout, keys = self._check_ack(peer.endpoint, peer.hello, ack)
            if layout.layout_hash() != peer.layout.layout_hash() or keys != peer.keys:
                raise HandshakeError("it came back with another layout")
        except HandshakeError as exc:
            self.counters.add(handshakes_refused=1)
            log.warning("%s: prefill %s: re-handshake refused: %s", self.name, peer.endpoint, exc)
            return
        peer.hello = None
        peer.alive = True
        peer.last_seen = now
        peer.backoff_s = RETRY_FIRST_S
        self.counters.add(handshakes_ok=1, peer_recoveries=1)
        log.warning("%s: prefill %s is back (epoch %d)", self.name, peer.endpoint, ack.epoch)
        self._peer_gone_locked(peer, now, set(ack.in_flight))
        peer.proven_gone = False
        peer.link_down_since = None

    def _peer(self, endpoint: str) -> PrefillPeer:
        for peer in self.peers:
            if peer.endpoint == endpoint:
                return peer
        raise ValueError(f"not connected to prefill {endpoint}")

    def _request_peers(self, prefill: str | list[str] | None) -> list[PrefillPeer]:
        """The peers of a request, checked once per choice (the peers and their layouts are
        fixed: a prefill that comes back with another layout is refused)."""
        key = prefill if prefill is None or isinstance(prefill, str) else tuple(prefill)
        try:
            peers = self._stages.get(key)
        except TypeError:  # an unhashable name: refused by the check, naming what was given
            return self._check_request_peers(prefill)
        if peers is None:
            peers = self._stages[key] = self._check_request_peers(prefill)
        return list(peers)

    def _check_request_peers(self, prefill: str | list[str] | None) -> list[PrefillPeer]:
        if prefill is None:
            whole = [p for p in self.peers if set(self.layout.layer_ids) <= set(p.layout.layer_ids)]
            peers = whole[:1] or list(self.peers)
        elif isinstance(prefill, str):
            peers = [self._peer(prefill)]
        else:
            peers = [self._peer(endpoint) for endpoint in prefill]
            if len({p.endpoint for p in peers}) != len(peers):
                raise ValueError(f"a prefill node is named twice: {list(prefill)}")
        check_stages(self.layout, [(p.endpoint, p.layout) for p in peers])
        return peers

    # ---- receiver operations (application thread) ------------------------------------------

    def _init_receiver(self, receiver: KVReceiver, page_ids, num_tokens: int) -> None:
        if receiver.page_ids is not None:
            raise ValueError(f"room {receiver.room}: init called twice")
        try:
            pages = as_page_ids(page_ids, "page_ids")
            check_pages(pages, self._page_limit, "page_ids")
        except PlanError as exc:
            raise ValueError(str(exc)) from None
        with self._lock:
            now = time.monotonic()
            receiver.page_ids = pages
            receiver.started_at = now
            if receiver.state.status in TERMINAL:  # aborted before init: ask no prefill node
                return
            dead = [p.endpoint for p in receiver.peers if not p.alive]
            if dead:
                self._fail_locked(receiver, f"prefill {dead[0]} unreachable (awaiting its new "
                                            f"handshake)", now, release_after_s=0.0)
                receiver.book.nothing_sent()
                return
            receiver.state.advance(KVPoll.WaitingForInput, now)
        aux_peer = receiver._aux_peer()
        for peer in receiver.peers:
            aux = receiver.aux_index if peer is aux_peer else -1
            self._loop.send(peer.socket, protocol.RequestPages(receiver.room, pages.tolist(),
                                                               int(num_tokens), aux))

    def _abort(self, receiver: KVReceiver, reason: str) -> None:
        with self._lock:
            self._abort_locked(receiver, reason, time.monotonic())

    def _can_release(self, receiver: KVReceiver) -> bool:
        with self._lock:
            return receiver.state.can_release(time.monotonic())

    def _abort_locked(self, receiver: KVReceiver, reason: str, now: float) -> None:
        if receiver.page_ids is None:  # nothing was asked of any prefill node
            if self._fail_locked(receiver, reason, now, release_after_s=0.0):
                receiver.book.nothing_sent()
            return
        self._fail_sent_locked(receiver, reason, now)

    def _fail_locked(self, receiver: KVReceiver, reason: str, now: float, *,
                     release_after_s: float | None) -> bool:
        if receiver.state.fail(reason, now, release_after_s=release_after_s):
            self.counters.request_failed(reason)
            log.warning("%s: room %d failed: %s", self.name, receiver.room, reason)
            return True
        return False

    def _fail_sent_locked(self, receiver: KVReceiver, reason: str, now: float) -> None:
        """Fail a request whose pages the prefill nodes know: ask every one that may still write
        to stop, and hold the pages until the fence lets them go."""
        if self._fail_locked(receiver, reason, now, release_after_s=None):
            for peer in receiver.peers:
                if peer.endpoint in receiver.book.outstanding and peer.alive:
                    self._loop.send(peer.socket, protocol.Abort(receiver.room, reason))
        self._settle_locked(receiver, now)

    def _settle_locked(self, receiver: KVReceiver, now: float) -> None:
        """Release a failed request's pages once no prefill can still write into them, or once
        the quarantine's upper bound has passed (counted as an expiry)."""
        if receiver.state.status != KVPoll.Failed:
            return
        at, expired = receiver.book.fence(receiver.state.finished_at, now, self.quarantine_timeout_s)
        if expired:
            self.counters.add(quarantine_expiries=1, pages_expired=receiver.page_ids.size)
            log.warning("%s: room %d: pages released after %.0fs without proof that no write "
                        "into them can still land", self.name, receiver.room,
                        self.quarantine_timeout_s)
        if at is not None:
            receiver.state.allow_release(at)

    # ---- peers' liveness (control thread) --------------------------------------------------

    def _peer_dead_locked(self, peer: PrefillPeer, now: float) -> None:
        """``peer`` went silent: every request it may still write into is quarantined (its
        pages held until the peer is proven gone), the running ones fail."""
        peer.alive = False
        peer.retry_at = now
        peer.backoff_s = RETRY_FIRST_S
        log.warning("%s: prefill %s silent for %.1fs", self.name, peer.endpoint, now - peer.last_seen)
        reason = (f"prefill {peer.endpoint} unreachable (no heartbeat for "
                  f"{self._liveness.peer_timeout_s:.1f}s)")
        for receiver in self._receivers.values():
            if peer not in receiver.peers:
                continue
            if receiver.page_ids is not None and receiver.book.silent(peer.endpoint):
                self.counters.add(quarantines=1, pages_quarantined=receiver.page_ids.size)
            if receiver.state.status in TERMINAL:
                self._settle_locked(receiver, now)
            else:
                self._abort_locked(receiver, reason, now)

    def _peer_gone_locked(self, peer: PrefillPeer, now: float, in_flight: set[int]) -> None:
        """Proof that ``peer``'s old writes can no longer land (but the failed ones of the rooms
        in ``in_flight``, which the engine's own bound covers): lift its quarantines."""
        for receiver in self._receivers.values():
            if peer.endpoint in receiver.book.quarantined:
                receiver.book.confirmed(peer.endpoint, now, in_flight=receiver.room in in_flight,
                                        grace_s=self.in_flight_grace_s)
                self._settle_locked(receiver, now)

    def _watch_link_locked(self, peer: PrefillPeer, now: float) -> None:
        """Follow the control connection; when it has been down (closed, every reconnect
        refused) for DEAD_PEER_GRACE_S, the dead peer's process is proven gone."""
        while peer.monitor is not None:
            try:
                event = recv_monitor_message(peer.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                break
            if event == zmq.EVENT_DISCONNECTED:
                peer.link_down_since = now if peer.link_down_since is None else peer.link_down_since
            elif event == zmq.EVENT_CONNECTED:
                peer.link_down_since = None
                if not peer.alive:  # a Hello queued on the closed connection may be lost
                    peer.retry_at, peer.backoff_s = now, RETRY_FIRST_S
        if (not peer.alive and not peer.proven_gone and peer.link_down_since is not None
                and now - peer.link_down_since >= DEAD_PEER_GRACE_S):
            peer.proven_gone = True
            log.warning("%s: prefill %s: connection closed and refused for %.1fs: its process is "
                        "gone", self.name, peer.endpoint, now - peer.link_down_since)
            self._peer_gone_locked(peer, now, set())

    # ---- control plane (loop thread) -------------------------------------------------------

    def _on_message(self, sock: zmq.Socket, identity: bytes, message) -> None:
        with self._lock:
            peer = next((p for p in self.peers if p.socket is sock), None)
            if peer is None:
                return
            now = time.monotonic()
            peer.last_seen = now
            if isinstance(message, protocol.ChunkDone):
                self._on_chunk_locked(peer, message, now)
            elif isinstance(message, protocol.HelloAck):
                self._on_ack_locked(peer, message, now)
            elif not isinstance(message, protocol.Heartbeat):
                raise protocol.ProtocolError(f"unexpected {type(message).__name__} from prefill")

    def _on_chunk_locked(self, peer: PrefillPeer, done: protocol.ChunkDone, now: float) -> None:
        receiver = self._receivers.get(done.room)
        if receiver is None or peer not in receiver.peers:
            raise protocol.ProtocolError(f"chunk report for unknown room {done.room}")
        book = receiver.book
        if not done.ok:  # the prefill's final word: none of its writes is still running...
            book.confirmed(peer.endpoint, now, in_flight=done.in_flight,  # ...unless one may land
                           grace_s=self.in_flight_grace_s)
            self._fail_sent_locked(receiver, f"prefill {peer.endpoint}: {done.reason}", now)
            return
        if done.last:
            book.confirmed(peer.endpoint, now)
        if receiver.state.status in TERMINAL:
            self._settle_locked(receiver, now)
            return
        receiver.chunks += 1
        receiver.nbytes += done.nbytes
        receiver.descriptors += done.descriptors
        receiver.write_seconds += done.write_seconds
        book.chunk(peer.endpoint, done.nbytes)
        self.counters.add(chunks=1, bytes=done.nbytes, descriptors=done.descriptors,
                          write_seconds=done.write_seconds)
        receiver.state.advance(KVPoll.Transferring, now)
        if self.checksums:  # the part counts once the verifier has checked every chunk
            self._verifier.submit(receiver, done, peer)
        elif done.last:
            self._on_part_done_locked(receiver, peer, now)

    def _on_part_done_locked(self, receiver: KVReceiver, peer: PrefillPeer, now: float) -> None:
        """A prefill node's last chunk: its part must be complete, and reported only once."""
        aux_bytes = sum(b.item_len for b in self.aux_buffers) if peer is receiver._aux_peer() else 0
        problem = receiver.book.part_done(
            peer.endpoint, receiver.page_ids.size * peer.page_bytes + aux_bytes,
            f"{len(peer.keys)} buffers x {receiver.page_ids.size} pages")
        if problem:
            self._fail_sent_locked(receiver, problem, now)
        elif receiver.book.complete and receiver.state.advance(KVPoll.Success, now):
            self.counters.request_ok(receiver.state.finished_at - receiver.started_at)

    def _on_verified(self, receiver: KVReceiver, done: protocol.ChunkDone, peer: PrefillPeer,
                     problem: str, verified: int, seconds: float) -> None:
        """The verifier's outcome for one chunk of ``peer`` (verifier thread)."""
        with self._lock:
            now = time.monotonic()
            self.counters.add(checksums_verified=verified, checksum_seconds=seconds)
            receiver.checksums_verified += verified
            receiver.book.verify(peer.endpoint, verified)
            if not problem and done.last:
                try:
                    checksum.check_coverage(receiver.book.verified[peer.endpoint],
                                            receiver.page_ids.size, len(peer.keys))
                except checksum.ChecksumError as exc:
                    problem = str(exc)
            if problem:  # later chunks may still be written: held until every prefill confirms
                self._fail_sent_locked(receiver, problem, now)
            elif done.last and receiver.state.status not in TERMINAL:
                self._on_part_done_locked(receiver, peer, now)

    def _on_tick(self, now: float) -> None:
        with self._lock:
            for peer in self.peers:
                self._watch_link_locked(peer, now)
                if peer.alive and self._liveness.silent(peer.last_seen, now):
                    self._peer_dead_locked(peer, now)
                elif not peer.alive and peer.link_down_since is None and now >= peer.retry_at:
                    self._rehandshake_locked(peer, now)  # (while the link is down: at reconnect)
            for receiver in list(self._receivers.values()):
                status = receiver.state.status
                if status == KVPoll.Failed and receiver.state.release_at is None:
                    self._settle_locked(receiver, now)  # the quarantine's upper bound
                elif status not in TERMINAL:
                    dead = [p.endpoint for p in receiver.peers if not p.alive]
                    if dead:  # made while its prefill was dead, not yet initialized
                        self._abort_locked(receiver, f"prefill {dead[0]} unreachable", now)
                    elif now > receiver.state.deadline:
                        self._abort_locked(receiver, f"timed out after "
                                                     f"{self.request_timeout_s:.0f}s", now)
            if self._liveness.heartbeat_due(now):
                for peer in self.peers:  # not into a closed connection: a new process on
                    if peer.link_down_since is None:  # the port would get them first
                        self._loop.send(peer.socket, protocol.Heartbeat(time.time()))
