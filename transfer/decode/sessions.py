"""Decode's sessions with its prefill nodes: the handshake it initiates, and the re-handshake of a
prefill it marked dead.

``Handshaker`` builds this node's Hello (layout, hash, buffers, the indexer layers it reads, aux
buffers, its session and an epoch; signed with the shared secret when there is one) and checks a
prefill's answer (HandshakeError naming the problem). ``connect`` runs the first handshake with one
prefill, blocking, before the control loop starts; its control socket reconnects every
``RECONNECT_IVL_MS`` and reports its connect/disconnect events to a monitor (``liveness``).

``PeerSession`` is the re-handshake state machine, pure (time passed in): a prefill is alive, or
dead and offered a Hello of a new epoch of this node's session, from the control thread, which
never waits (the answer arrives as a message). The offer is repeated with backoff (``RETRY_FIRST_S``
doubling up to ``RETRY_MAX_S``) until the prefill answers, and at once when its control connection
is made again (a new process on the port gets a Hello, not the pile that would have queued while
nobody listened); only the answer to the latest Hello counts. A prefill answers only once none of
its old epochs' writes can still run.

``PrefillPeer`` is one prefill node as decode knows it: its control socket, what it writes into
this node, when it was last heard from, its session and its control link, and the aborts it is
owed (``owed_aborts``: requests failed before their pages while it counted dead), sent once its
re-handshake is answered, so that its senders of them fail then rather than at their timeout.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from ...plugin.descriptors import BufferDescriptor
from ...plugin.layout import DSALayout
from .. import auth, protocol, receive_limits
from ..backends.base import TransferBackend
from ..control import parse_endpoint, zmq_address
from ..counters import Counters
from ..handshake import BufferKey, HandshakeError, buffer_infos, check_peer, transfer_set
from ..liveness import RECONNECT_IVL_MS, ControlLink

log = logging.getLogger(__name__)

RETRY_FIRST_S, RETRY_MAX_S = 0.5, 10.0  # backoff of the re-handshakes with a dead prefill
OWED_ABORTS_MAX = 4096  # aborts kept for a dead prefill; beyond, the oldest rooms wait their timeout


@dataclass
class PeerSession:
    """Alive, or dead and offered new epochs of our session until one is answered."""

    alive: bool = True
    epoch: int = 0  # of our latest Hello to it
    hello: protocol.Hello | None = None  # a re-handshake waiting for its answer
    retry_at: float = 0.0
    backoff_s: float = RETRY_FIRST_S

    def dead(self, now: float) -> None:
        """The prefill went silent: offer it a new epoch at once."""
        self.alive = False
        self.retry_at = now
        self.backoff_s = RETRY_FIRST_S

    def reconnected(self, now: float) -> None:
        """Its control connection was made again: a Hello queued on the closed one may be lost."""
        if not self.alive:
            self.retry_at, self.backoff_s = now, RETRY_FIRST_S

    def retry_due(self, now: float) -> bool:
        return not self.alive and now >= self.retry_at

    def next_epoch(self, now: float) -> int:
        """The epoch of the Hello offered at ``now``; the next offer follows after the backoff,
        which doubles."""
        self.epoch += 1
        self.retry_at = now + self.backoff_s
        self.backoff_s = min(self.backoff_s * 2, RETRY_MAX_S)
        return self.epoch

    def awaiting(self, epoch: int) -> protocol.Hello | None:
        """The Hello an answer of ``epoch`` answers; None for the answer to an earlier Hello (a
        later one is on its way) or when no re-handshake is waiting."""
        if self.alive or self.hello is None or epoch != self.epoch:
            return None
        return self.hello

    def recovered(self) -> None:
        self.hello = None
        self.alive = True
        self.backoff_s = RETRY_FIRST_S


@dataclass
class PrefillPeer:
    """One prefill node this decode node handshook with."""

    endpoint: str
    node: str
    socket: zmq.Socket
    last_seen: float
    layout: DSALayout
    keys: list[BufferKey]  # the (layer, cache) buffers this prefill writes into ours
    page_bytes: int  # bytes it writes per request page: the item lengths of ``keys``
    monitor: zmq.Socket | None = None  # the control socket's connect/disconnect events
    session: PeerSession = field(default_factory=PeerSession)
    link: ControlLink = field(default_factory=ControlLink)
    staging: protocol.StagingArea | None = None  # our staging share it may write slices into
    owed_aborts: deque[protocol.Abort] = field(default_factory=lambda: deque(maxlen=OWED_ABORTS_MAX))

    @property
    def alive(self) -> bool:
        return self.session.alive

    @property
    def epoch(self) -> int:
        return self.session.epoch

    @property
    def proven_gone(self) -> bool:
        return self.link.proven_gone

    def dead(self, node: str, now: float, peer_timeout_s: float, dropped: str = "") -> str:
        """Mark it dead, to be offered a new handshake at once: silent for ``peer_timeout_s``, or
        ``dropped`` (prefill dropped ``node``, in prefill's words). Logged; returns why the
        requests it feeds fail."""
        self.session.dead(now)
        if dropped:
            log.warning("%s: prefill %s dropped this node: %s", node, self.endpoint, dropped)
            return f"prefill {self.endpoint} unpaired: {dropped}"
        log.warning("%s: prefill %s silent for %.1fs", node, self.endpoint, now - self.last_seen)
        return f"prefill {self.endpoint} unreachable (no heartbeat for {peer_timeout_s:.1f}s)"

    def send_owed_aborts(self, send: Callable[[zmq.Socket, protocol.Message], None]) -> None:
        """Send it the aborts it is owed (``owed_aborts``): its re-handshake was answered."""
        while self.owed_aborts:
            send(self.socket, self.owed_aborts.popleft())

    def watch_link(self, now: float) -> bool:
        """Follow the control connection's events; True once when the peer is dead and its
        process proven gone (``ControlLink.proves_gone``)."""
        for event in self._link_events():
            if event == zmq.EVENT_DISCONNECTED:
                self.link.disconnected(now)
            elif event == zmq.EVENT_CONNECTED:
                self.link.connected()
                self.session.reconnected(now)
        return not self.alive and self.link.proves_gone(now)

    def _link_events(self) -> Iterator[int]:
        """The monitor's events queued now (asked first: each tick would otherwise pay for a
        ``zmq.Again`` raised and caught)."""
        while self.monitor is not None and self.monitor.get(zmq.EVENTS) & zmq.POLLIN:
            try:
                yield recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return


class Handshaker:
    """This decode node's Hellos, its first handshake with a prefill, and its re-handshakes."""

    def __init__(self, name: str, backend: TransferBackend, layout: DSALayout,
                 buffers: Sequence[BufferDescriptor], aux_buffers: Sequence[BufferDescriptor],
                 index_reads: Sequence[int], *, secret: bytes, session: bytes, counters: Counters,
                 socket: Callable[[int, int], zmq.Socket], kv_page_zero: bool = False,
                 kv_on_index_pages: Sequence[int] = ()):
        self.name = name
        self.kv_page_zero = kv_page_zero  # its KV buffers hold no padding page
        self.kv_on_index_pages = sorted(kv_on_index_pages)  # KV layers kept with the indexer
        self.backend_name = backend.name
        self.engine_metadata = backend.metadata()
        self.layout = layout
        self.buffers = buffers
        self.aux_buffers = aux_buffers
        self.index_reads = index_reads
        self.secret = secret
        self.session = session
        self.counters = counters
        self._socket = socket  # a socket of a kind with a receive limit, closed with the node
        self._items = {(b.layer_id, b.kind): b.item_len for b in buffers}

    def hello(self, epoch: int, staging: protocol.StagingArea | None = None) -> protocol.Hello:
        hello = protocol.Hello(
            protocol.PROTOCOL_VERSION, self.name, self.backend_name, self.layout.to_dict(),
            self.layout.layout_hash(), self.engine_metadata, buffer_infos(self.buffers),
            list(self.index_reads), nonce=os.urandom(16), sent_at=time.time(),
            session=self.session, epoch=epoch,
            aux_buffers=self.aux_buffers, staging=staging, kv_page_zero=self.kv_page_zero,
            kv_on_index_pages=self.kv_on_index_pages)
        if self.secret:
            hello = msgspec.structs.replace(
                hello, auth=auth.sign(self.secret, protocol.signed_bytes(hello)))
        return hello

    def check_ack(self, endpoint: str, hello: protocol.Hello,
                  ack: protocol.HelloAck) -> tuple[DSALayout, list[BufferKey]]:
        """The prefill's layout and what it writes into us, from its answer to ``hello``."""
        if not ack.ok:
            raise HandshakeError(f"prefill {endpoint} refused the handshake: {ack.reason}")
        if self.secret and not auth.verify(self.secret, ack.auth, b"ack", hello.nonce,
                                           protocol.signed_bytes(ack)):
            raise HandshakeError(f"prefill {endpoint} did not prove the shared secret")
        layout = check_peer(self.layout, self.backend_name, version=ack.version,
                            peer_backend=self.backend_name, peer_layout=ack.layout,
                            peer_hash=ack.layout_hash)
        return layout, transfer_set(layout, self.layout, self.index_reads)

    def connect(self, endpoint: str, timeout_s: float,
                staging: protocol.StagingArea | None = None) -> PrefillPeer:
        """The first handshake (constructor thread, before the loop starts), offering the
        prefill ``staging``, our staging share for it (the staged route), when there is one."""
        host, port = parse_endpoint(endpoint, "prefill")
        sock = self._socket(zmq.DEALER, receive_limits.decode_receive_bytes(self.layout, self.buffers))
        sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 0)
        sock.connect(zmq_address(host, port))
        hello = self.hello(0, staging)
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
            layout, keys = self.check_ack(endpoint, hello, ack)
        except HandshakeError:
            sock.close(0)
            raise
        self.counters.add(handshakes_ok=1)
        return PrefillPeer(endpoint, ack.node, sock, time.monotonic(), layout, keys,
                           sum(self._items[key] for key in keys),
                           monitor=sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED),
                           staging=staging)

    def offer(self, peer: PrefillPeer, now: float) -> protocol.Hello:
        """The Hello of a new epoch for the dead ``peer``, for the control thread to send."""
        peer.session.hello = self.hello(peer.session.next_epoch(now), peer.staging)
        return peer.session.hello

    def answered(self, peer: PrefillPeer, ack: protocol.HelloAck, now: float) -> bool:
        """``peer``'s answer to a re-handshake: True when it answers the latest Hello and passes
        the checks with the layout it had: the peer is alive again."""
        hello = peer.session.awaiting(ack.epoch)
        if hello is None:
            return False
        try:
            layout, keys = self.check_ack(peer.endpoint, hello, ack)
            if layout.layout_hash() != peer.layout.layout_hash() or keys != peer.keys:
                raise HandshakeError("it came back with another layout")
        except HandshakeError as exc:
            self.counters.add(handshakes_refused=1)
            log.warning("%s: prefill %s: re-handshake refused: %s", self.name, peer.endpoint, exc)
            return False
        peer.session.recovered()
        peer.last_seen = now
        peer.link.reset()
        self.counters.add(handshakes_ok=1, peer_recoveries=1)
        log.warning("%s: prefill %s is back (epoch %d)", self.name, peer.endpoint, ack.epoch)
        return True
