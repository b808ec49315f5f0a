"""The decode side: handshakes with prefill nodes and receives requests into its pool.

``DecodeNode`` registers its pool, connects to one or more prefill control endpoints and
handshakes with each (layout, hash, buffers and the indexer layers it reads; a mismatch raises
HandshakeError before anything else happens). A ``KVReceiver`` per request sends the pages decode
allocated to the prefill node that holds all its layers, or to the pipeline stages that together
hold each layer once, and follows the request to Success — every stage's part arrived, exactly
once — or to Failed with a reason: a prefill failure, an abort, a missed deadline, or a prefill
that stopped answering. With ``checksums`` on, a stage's part counts as arrived only once the
verifier thread has checked each of its pages in each of its buffers against the checksums
prefill sent. Pages of a failed request are held back until no write into them can still land.
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

from dsa_bridge.plugin.layout import DSALayout
from dsa_bridge.transfer import auth, checksum, protocol
from dsa_bridge.transfer.backends.base import MemoryRegion, TransferBackend
from dsa_bridge.transfer.control import ControlLoop, parse_endpoint, zmq_address
from dsa_bridge.transfer.counters import Counters
from dsa_bridge.transfer.handshake import (
    BufferKey,
    HandshakeError,
    buffer_infos,
    check_index_reads,
    check_peer,
    check_stages,
    pool_buffers,
    transfer_set,
)
from dsa_bridge.transfer.plan import PlanError, as_aux_buffers, as_page_ids, check_aux_index, check_pages
from dsa_bridge.transfer.request import TERMINAL, KVPoll, RequestState
from dsa_bridge.transfer.verify import ChunkVerifier

log = logging.getLogger(__name__)


DEAD_PEER_GRACE_S = 1.0  # after a prefill went silent: bytes already queued in our own engine


@dataclass
class PrefillPeer:
    endpoint: str
    node: str
    socket: zmq.Socket
    last_seen: float
    layout: DSALayout
    keys: list[BufferKey]  # the (layer, cache) buffers this prefill writes into ours
    page_bytes: int  # bytes it writes per request page: the item lengths of ``keys``
    alive: bool = True


class KVReceiver:
    """One request on the decode side (SGLang's BaseKVReceiver semantics), fed by one prefill
    node or by several that each hold a part of the layers (pipeline stages). Success once every
    one of them has written all of its part, exactly once."""

    def __init__(self, node: DecodeNode, room: int, peers: list[PrefillPeer], timeout_s: float):
        self.node = node
        self.room = room
        self.peers = peers
        self.state = RequestState(room, timeout_s)
        self.page_ids: np.ndarray | None = None
        self.aux_index: int | None = None
        self.chunks = 0
        self.nbytes = 0
        self.descriptors = 0
        self.write_seconds = 0.0
        self.checksums_verified = 0
        self.started_at: float | None = None
        self.received = {p.endpoint: 0 for p in peers}  # bytes each prefill reported written
        self.verified = {p.endpoint: 0 for p in peers}  # (buffer, page) checksums verified
        self.finished: set[str] = set()  # prefills whose last chunk arrived
        self.outstanding = {p.endpoint for p in peers}  # prefills that may still write
        self.in_flight = False  # a prefill reported a failed write whose bytes may still land
        self.dead_peer = False  # a prefill went silent while it may still have been writing

    @property
    def components(self) -> list[BufferKey]:
        """Every (layer, cache) buffer this request fills, in layer order."""
        return sorted(key for p in self.peers for key in p.keys)

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

    def poll(self) -> KVPoll:
        return self.state.status

    def abort(self, reason: str = "aborted by decode") -> None:
        self.node._abort(self, reason)

    def failure_exception(self) -> Exception | None:
        return self.state.failure_exception()

    def can_release(self) -> bool:
        """True once the request's pages may go back to the allocator (invariant 8)."""
        return self.state.can_release()


class DecodeNode:
    """Receives requests from prefill nodes into one pool through one engine backend."""

    def __init__(self, pool, backend: TransferBackend, prefill: str | list[str], *,
                 name: str | None = None, handshake_timeout_s: float = 10.0,
                 request_timeout_s: float = 60.0, peer_timeout_s: float = 5.0,
                 heartbeat_s: float = 0.5, in_flight_grace_s: float = 35.0,
                 secret: bytes = b"", index_reads: Iterable[int] | None = None,
                 checksums: bool = False, aux_buffers=()):
        self.pool = pool
        self.layout = pool.layout
        self.index_reads = check_index_reads(self.layout, index_reads)
        self.backend = backend
        self.name = name or f"decode-{os.getpid()}"
        self.request_timeout_s = request_timeout_s
        self.peer_timeout_s = peer_timeout_s
        self.heartbeat_s = heartbeat_s
        self.in_flight_grace_s = in_flight_grace_s
        self.secret = secret
        self.checksums = checksums  # verify every chunk's pages (may change between requests)
        self.counters = Counters()
        self._lock = threading.RLock()
        self._receivers: dict[int, KVReceiver] = {}
        self._next_heartbeat = 0.0
        self._context = zmq.Context()
        self._loop = ControlLoop(self.name, self._on_message, self._on_tick)
        self._closed = False
        self.buffers = pool_buffers(pool)
        self.aux_buffers = as_aux_buffers(aux_buffers)  # (ptr, nbytes, item_len): host memory
        self._page_limit = min(b.num_items for b in self.buffers)
        backend.register([MemoryRegion(d.ptr, d.nbytes, d.device) for d in pool.buffer_descriptors()]
                         + [MemoryRegion(b.ptr, b.nbytes, "cpu") for b in self.aux_buffers])
        endpoints = [prefill] if isinstance(prefill, str) else list(prefill)
        try:
            self.peers = [self._handshake(e, handshake_timeout_s) for e in endpoints]
            held = {lid for peer in self.peers for lid in peer.layout.layer_ids}
            missing = [lid for lid in self.layout.layer_ids if lid not in held]
            if missing:
                raise HandshakeError(f"layer sets: layer {missing[0]} is held by none of the prefill "
                                     f"nodes ({', '.join(endpoints)})")
        except BaseException:
            self._context.destroy(0)
            backend.close()
            raise
        for peer in self.peers:
            self._loop.add_socket(peer.socket)
        self._verifier = ChunkVerifier(pool, self.name, self._on_verified)
        self._loop.start()

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
        if not receiver.can_release():
            raise RuntimeError(f"room {receiver.room}: pages may still be written")
        with self._lock:
            self._receivers.pop(receiver.room, None)

    def held_pages(self) -> int:
        """Pages of failed requests that may not go back to the allocator yet (invariant 8)."""
        with self._lock:
            return sum(r.page_ids.size for r in self._receivers.values()
                       if r.page_ids is not None and r.poll() == KVPoll.Failed and not r.can_release())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.stop()
        self._verifier.close()
        self._context.destroy(0)
        self.backend.close()

    def __enter__(self) -> DecodeNode:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- handshake (constructor thread, before the loop starts) ----------------------------

    def _handshake(self, endpoint: str, timeout_s: float) -> PrefillPeer:
        host, port = parse_endpoint(endpoint, "prefill")
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(zmq_address(host, port))
        hello = protocol.Hello(
            protocol.PROTOCOL_VERSION, self.name, self.backend.name, self.layout.to_dict(),
            self.layout.layout_hash(), self.backend.metadata(), buffer_infos(self.buffers),
            list(self.index_reads), nonce=os.urandom(16), sent_at=time.time(),
            aux_buffers=[protocol.AuxInfo(b.ptr, b.nbytes, b.item_len) for b in self.aux_buffers])
        if self.secret:
            hello = msgspec.structs.replace(
                hello, auth=auth.sign(self.secret, protocol.signed_bytes(hello)))
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
            if not ack.ok:
                raise HandshakeError(f"prefill {endpoint} refused the handshake: {ack.reason}")
            if self.secret and not auth.verify(self.secret, ack.auth, b"ack", hello.nonce,
                                               protocol.signed_bytes(ack)):
                raise HandshakeError(f"prefill {endpoint} did not prove the shared secret")
            layout = check_peer(self.layout, self.backend.name, version=ack.version,
                                peer_backend=self.backend.name, peer_layout=ack.layout,
                                peer_hash=ack.layout_hash)
            keys = transfer_set(layout, self.layout, self.index_reads)
        except HandshakeError:
            sock.close(0)
            raise
        self.counters.add(handshakes_ok=1)
        items = {(b.layer_id, b.kind): b.item_len for b in self.buffers}
        return PrefillPeer(endpoint, ack.node, sock, time.monotonic(), layout, keys,
                           sum(items[key] for key in keys))

    def _peer(self, endpoint: str) -> PrefillPeer:
        for peer in self.peers:
            if peer.endpoint == endpoint:
                return peer
        raise ValueError(f"not connected to prefill {endpoint}")

    def _request_peers(self, prefill: str | list[str] | None) -> list[PrefillPeer]:
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
        receiver.page_ids = pages
        receiver.started_at = time.monotonic()
        with self._lock:
            dead = [p.endpoint for p in receiver.peers if not p.alive]
            if dead:
                receiver.state.fail(f"prefill {dead[0]} unreachable")
                return
            receiver.state.advance(KVPoll.WaitingForInput)
        aux_peer = receiver._aux_peer()
        for peer in receiver.peers:
            aux = receiver.aux_index if peer is aux_peer else -1
            self._loop.send(peer.socket, protocol.RequestPages(receiver.room, pages.tolist(),
                                                               int(num_tokens), aux))

    def _abort(self, receiver: KVReceiver, reason: str) -> None:
        with self._lock:
            if receiver.page_ids is None:  # nothing was asked of any prefill node
                if self._fail(receiver, reason, release_after_s=0.0):
                    receiver.outstanding.clear()
                return
            self._fail_sent(receiver, reason)

    def _fail(self, receiver: KVReceiver, reason: str, *,
              release_after_s: float | None = 0.0) -> bool:
        if receiver.state.fail(reason, release_after_s=release_after_s):
            self.counters.request_failed(reason)
            log.warning("%s: room %d failed: %s", self.name, receiver.room, reason)
            return True
        return False

    def _fail_sent(self, receiver: KVReceiver, reason: str) -> None:
        """Fail a request whose pages the prefill nodes know: ask every one that may still write
        to stop, and hold the pages until each has confirmed, or the grace period ends."""
        if self._fail(receiver, reason, release_after_s=None):
            receiver.state.allow_release(self.in_flight_grace_s)
            for peer in receiver.peers:
                if peer.endpoint in receiver.outstanding and peer.alive:
                    self._loop.send(peer.socket, protocol.Abort(receiver.room, reason))
        self._settle(receiver)

    def _settle(self, receiver: KVReceiver) -> None:
        """Release a failed request's pages once no prefill can still write into them."""
        if receiver.outstanding or receiver.in_flight:
            return
        receiver.state.allow_release(DEAD_PEER_GRACE_S if receiver.dead_peer else 0.0)

    # ---- control plane (loop thread) -------------------------------------------------------

    def _on_message(self, sock: zmq.Socket, identity: bytes, message) -> None:
        with self._lock:
            peer = next((p for p in self.peers if p.socket is sock), None)
            if peer is None:
                return
            peer.last_seen = time.monotonic()
            if isinstance(message, protocol.ChunkDone):
                self._on_chunk(peer, message)
            elif not isinstance(message, protocol.Heartbeat | protocol.HelloAck):
                raise protocol.ProtocolError(f"unexpected {type(message).__name__} from prefill")

    def _on_chunk(self, peer: PrefillPeer, done: protocol.ChunkDone) -> None:
        receiver = self._receivers.get(done.room)
        if receiver is None or peer not in receiver.peers:
            raise protocol.ProtocolError(f"chunk report for unknown room {done.room}")
        if not done.ok:  # the prefill's final word: none of its writes is still running...
            receiver.outstanding.discard(peer.endpoint)
            receiver.in_flight |= done.in_flight  # ...unless it says one may still land
            self._fail_sent(receiver, f"prefill {peer.endpoint}: {done.reason}")
            return
        if done.last:
            receiver.outstanding.discard(peer.endpoint)
        if receiver.state.status in TERMINAL:
            self._settle(receiver)
            return
        receiver.chunks += 1
        receiver.nbytes += done.nbytes
        receiver.descriptors += done.descriptors
        receiver.write_seconds += done.write_seconds
        receiver.received[peer.endpoint] += done.nbytes
        self.counters.add(chunks=1, bytes=done.nbytes, descriptors=done.descriptors,
                          write_seconds=done.write_seconds)
        receiver.state.advance(KVPoll.Transferring)
        if self.checksums:  # the part counts once the verifier has checked every chunk
            self._verifier.submit(receiver, done, peer)
        elif done.last:
            self._on_part_done(receiver, peer)

    def _on_part_done(self, receiver: KVReceiver, peer: PrefillPeer) -> None:
        """A prefill node's last chunk: its part must be complete, and reported only once."""
        if peer.endpoint in receiver.finished:
            self._fail_sent(receiver, f"prefill {peer.endpoint} reported its last chunk twice")
            return
        receiver.finished.add(peer.endpoint)
        expected = receiver.page_ids.size * peer.page_bytes
        if peer is receiver._aux_peer():
            expected += sum(b.item_len for b in self.aux_buffers)
        if receiver.received[peer.endpoint] != expected:
            self._fail_sent(receiver, f"prefill {peer.endpoint} wrote {receiver.received[peer.endpoint]} "
                                      f"bytes, expected {expected} ({len(peer.keys)} buffers x "
                                      f"{receiver.page_ids.size} pages)")
            return
        if len(receiver.finished) == len(receiver.peers) and receiver.state.advance(KVPoll.Success):
            self.counters.request_ok(receiver.state.finished_at - receiver.started_at)

    def _on_verified(self, receiver: KVReceiver, done: protocol.ChunkDone, peer: PrefillPeer,
                     problem: str, verified: int, seconds: float) -> None:
        """The verifier's outcome for one chunk of ``peer`` (verifier thread)."""
        with self._lock:
            self.counters.add(checksums_verified=verified, checksum_seconds=seconds)
            receiver.checksums_verified += verified
            receiver.verified[peer.endpoint] += verified
            if not problem and done.last:
                try:
                    checksum.check_coverage(receiver.verified[peer.endpoint],
                                            receiver.page_ids.size, len(peer.keys))
                except checksum.ChecksumError as exc:
                    problem = str(exc)
            if problem:  # later chunks may still be written: held until every prefill confirms
                self._fail_sent(receiver, problem)
            elif done.last and receiver.state.status not in TERMINAL:
                self._on_part_done(receiver, peer)

    def _on_tick(self, now: float) -> None:
        self.backend.progress()
        with self._lock:
            for peer in self.peers:
                if peer.alive and now - peer.last_seen > self.peer_timeout_s:
                    peer.alive = False
                    log.warning("%s: prefill %s silent for %.1fs", self.name, peer.endpoint,
                                now - peer.last_seen)
            for receiver in self._receivers.values():
                if receiver.state.status in TERMINAL:
                    continue
                dead = [p.endpoint for p in receiver.peers if not p.alive]
                if dead:
                    # a dead engine writes nothing more; a short grace covers bytes already
                    # queued in our own engine
                    receiver.outstanding.difference_update(dead)
                    receiver.dead_peer = True
                    self._fail_sent(receiver, f"prefill {dead[0]} unreachable (no heartbeat "
                                              f"for {self.peer_timeout_s:.1f}s)")
                elif now > receiver.state.deadline:
                    self._abort(receiver, f"timed out after {self.request_timeout_s:.0f}s")
            if now >= self._next_heartbeat:
                self._next_heartbeat = now + self.heartbeat_s
                for peer in self.peers:
                    self._loop.send(peer.socket, protocol.Heartbeat(time.time()))
        self.counters.bad_messages = self._loop.bad_messages
