"""The prefill side: accepts decode nodes, and writes each request's pages into them.

``PrefillNode`` listens on a control endpoint and coordinates the units that do the work:

- a Hello goes to the handshake responder (``sessions``): it authenticates the Hello,
  validates the decode node's handshake and pairs the buffers prefill writes into that node
  (``handshake.transfer_set``: the layers it holds, the indexers decode holds and reads) with the
  ones that node announced; its ``Sessions`` keep each decode node's epochs and hold a new epoch's
  answer until none of the earlier epochs' writes can still run;
- decode's requests (``RequestPages``, ``Abort``, ``Reserve``) and the application's
  ``KVSender`` calls go to the request book (``requests``: one ``PrefillRequest`` per room, which
  owns its sender, destinations and reservations): a ``KVSender`` per request takes the
  prefill's page ids, in one or more chunks; once decode has sent its page ids for the
  room, each chunk goes to the writer (``writer``: one lane per decode engine peer), which plans it
  (``plan.py``: every paired buffer, coalesced and bounds-checked), takes its page checksums when
  ``checksums`` is on (``checksums``) and writes it through the engine together with the
  other chunks queued for that peer;
- the writer's lane hands each chunk's outcome, with its request, forward to the reporter
  (``outcomes``), which updates that request, reports it to decode at once through the control
  loop and counts it;
- the stager (``stager``) holds this node's registered staging area and decode's staging slices:
  a chunk of many small descriptors goes through both (``route``: ``auto``, or forced
  ``direct`` / ``staged``), and decode's ``SliceFree`` returns its slices.

Requests decode announced that have no sender yet are offered to the application on ``incoming``.
Deferred allocation: a decode node may reserve a request (``Reserve``) before it allocates its
pages; the application's ``KVSender.prefill_complete`` tells it (``PrefillReady``) once the
request's prefill has run, and a ``deferred`` sender's deadline starts only then.
Aux buffers (``aux_buffers``: one slot per request in each) are paired with decode's by position; a
request's aux slot travels with its last chunk. The node's tick drops silent decode nodes, expires
requests, answers held handshakes and sends heartbeats. A decode node dropped as silent that is
still alive (it was frozen, then resumed) may count prefill alive: pages it announces then are
refused at once (``ChunkDone.unpaired``: it re-handshakes now), and that room's sender fails.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time

import zmq

from .. import auth, protocol, receive_limits
from ..backends.base import BackendError, TransferBackend
from ..control import parse_endpoint, zmq_address
from ..counters import Counters
from ..handshake import HandshakeError, pool_buffers
from ..node_runtime import NodeRuntime
from ..plan import as_aux_buffers
from ..staging import check_route
from .checksums import ChunkChecksums
from .outcomes import ChunkReporter
from .records import DecodePeer, IncomingRequest, KVSender
from .requests import RequestBook
from .sessions import HelloResponder, Sessions
from .stager import Stager
from .writer import Writer

log = logging.getLogger(__name__)


class PrefillNode:
    """Serves decode nodes from one pool through one engine backend.

    One plain lock guards the node's tables: the sessions' peers and held answers, the request
    book's requests. Each entry point takes it once (the
    application's calls, each message and tick, each outcome a writer lane hands the reporter),
    and methods named ``_..._locked`` expect it held. The writer's blocking ``close`` is never
    called with it held: its lanes take it to report."""

    def __init__(self, pool, backend: TransferBackend, *, listen: str = "127.0.0.1:0",
                 name: str = "prefill", request_timeout_s: float = 60.0,
                 peer_timeout_s: float = 5.0, heartbeat_s: float = 0.5,
                 write_timeout_s: float = 30.0, secret: bytes = b"",
                 allow_insecure: bool = False, checksums: bool = False,
                 aux_buffers=(), route: str = "auto", staging_bytes: int | None = None,
                 slice_bytes: int | None = None):
        host, port = parse_endpoint(listen, "listen")
        auth.check_listener(host, secret, allow_insecure)
        self.pool = pool
        self.layout = pool.layout
        self.backend = backend
        self.name = name
        self.request_timeout_s = request_timeout_s
        self.write_timeout_s = write_timeout_s
        self.counters = Counters()
        self.refusals: collections.deque[str] = collections.deque(maxlen=100)  # the latest
        # a Queue, not a SimpleQueue: CPython 3.11's SimpleQueue.get(timeout) blocks forever when
        # a signal interrupts it near its deadline, and applications wait on this one with a
        # timeout in their main thread, where SIGTERM arrives
        self.incoming: queue.Queue[IncomingRequest] = queue.Queue()
        self.buffers = pool_buffers(pool)
        self.aux_buffers = as_aux_buffers(aux_buffers)  # (ptr, nbytes, item_len): host memory

        self._lock = threading.Lock()
        self._sessions = Sessions()
        self._responder = HelloResponder(name, self.layout, backend.name, self.buffers,
                                         self.aux_buffers, secret)
        self._page_sums = ChunkChecksums(pool, self.counters, enabled=checksums)
        self._stager = Stager(pool, backend, self._send, route=route, staging_bytes=staging_bytes,
                              slice_bytes=slice_bytes, fence_s=write_timeout_s + 5.0)
        self.counters.add(staging_bytes=self._stager.nbytes)

        regions = self.buffers + self.aux_buffers + self._stager.regions()
        self._runtime = NodeRuntime(name, backend, regions, self.counters,
                                    on_message=self._on_message, on_tick=self._on_tick,
                                    heartbeat_s=heartbeat_s, peer_timeout_s=peer_timeout_s)
        self._liveness = self._runtime.liveness
        self._loop = self._runtime.loop
        try:
            self._socket = self._runtime.socket(
                zmq.ROUTER, receive_limits.prefill_receive_bytes(self.layout, backend.name, self.buffers))
            try:
                if port == 0:
                    port = self._socket.bind_to_random_port(zmq_address(host, 0).rsplit(":", 1)[0])
                else:
                    self._socket.bind(zmq_address(host, port))
            except zmq.ZMQError as exc:
                raise OSError(f"cannot listen on {listen}: {exc}") from exc
            self.endpoint = f"{host}:{port}"
            self._reporter = ChunkReporter(name, self._lock, self.counters, self._send)
            self._writer = Writer(backend, name=name, timeout_s=write_timeout_s,
                                  checksums=self._page_sums, outcomes=self._reporter,
                                  routes=self._stager)
            self._requests = RequestBook(
                name, self._lock, reporter=self._reporter, writer=self._writer,
                counters=self.counters, incoming=self.incoming, aux_buffers=self.aux_buffers,
                request_timeout_s=request_timeout_s)
            self._runtime.start([self._socket])
        except BaseException:
            self._runtime.close()
            raise
        log.info("%s listening on %s (backend %s, transport %s)", name, self.endpoint,
                 backend.name, backend.transport())

    # ---- application API -------------------------------------------------------------------

    def sender(self, room: int, *, deferred: bool = False) -> KVSender:
        """The request ``room``'s sender. ``deferred``: its prefill runs before decode allocates
        (decode reserves the request); it has no deadline until ``KVSender.prefill_complete``."""
        return self._requests.new_sender(room, deferred=deferred)

    def abort_all(self, reason: str) -> int:
        """Fail every request not finished yet, with ``reason`` (as its own ``abort``); how many."""
        with self._lock:
            return self._requests.abort_all_locked(reason)

    def peers(self) -> list[str]:
        with self._lock:
            return self._sessions.names()

    @property
    def checksums(self) -> bool:
        """Send each chunk's page checksums (may change between requests)."""
        return self._page_sums.enabled

    @checksums.setter
    def checksums(self, enabled: bool) -> None:
        self._page_sums.enabled = enabled

    @property
    def route(self) -> str:
        """How chunks go: ``auto`` (staged for many small descriptors), ``direct`` or ``staged``
        (may change between requests)."""
        return self._stager.route

    @route.setter
    def route(self, route: str) -> None:
        self._stager.route = check_route(route)

    def close(self) -> None:
        """Let the writer's lanes finish (their outcomes still reach decode), then close the
        runtime: loop, sockets, engine. Idempotent."""
        if self._runtime.closed:
            return
        self._writer.close(self.write_timeout_s + 5)
        self._stager.close()
        self._runtime.close()

    def __enter__(self) -> PrefillNode:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- control plane (loop thread) -------------------------------------------------------

    def _send(self, message: protocol.Message, identity: bytes) -> None:
        """Queue ``message`` for the decode node of ``identity`` (thread-safe)."""
        self._loop.send(self._socket, message, identity)

    def _on_message(self, sock: zmq.Socket, identity: bytes, message) -> None:
        if isinstance(message, protocol.Hello):
            self._on_hello(identity, message)
            return
        with self._lock:
            if isinstance(message, protocol.SliceFree):  # also from an epoch ended meanwhile
                peer = self._sessions.latest(identity)
                if peer is None:
                    raise protocol.ProtocolError("SliceFree before a handshake")
                self._stager.slices_freed(peer, message.slices)
                return
            peer = self._sessions.peers.get(identity)
            if peer is None:
                dropped = self._sessions.latest(identity)
                if dropped is not None and isinstance(message, protocol.RequestPages):
                    self._requests.from_dropped_locked(dropped, message, (
                        f"prefill dropped this decode node as silent (nothing heard for "
                        f"{self._liveness.peer_timeout_s:g}s); it re-handshakes"))
                    return
                raise protocol.ProtocolError(f"{type(message).__name__} before a handshake")
            peer.last_seen = time.monotonic()
            if isinstance(message, protocol.RequestPages):
                self._requests.announced_locked(peer, message)
            elif isinstance(message, protocol.Abort):
                self._requests.aborted_locked(peer, message)
            elif isinstance(message, protocol.Reserve):
                self._requests.reserved_locked(peer, message)
            elif not isinstance(message, protocol.Heartbeat):
                raise protocol.ProtocolError(f"unexpected {type(message).__name__} from decode")

    def _on_hello(self, identity: bytes, hello: protocol.Hello) -> None:
        try:
            pairing = self._responder.pair(hello)
            engine_peer = self.backend.connect(hello.engine_metadata)
        except (HandshakeError, BackendError) as exc:
            self.counters.add(handshakes_refused=1)
            self.refusals.append(f"{hello.node}: {exc}")
            log.warning("%s: refused %s: %s", self.name, hello.node, exc)
            self._send(self._responder.ack(hello, ok=False, reason=str(exc)), identity)
            return
        session = hello.session or identity
        with self._lock:
            # a re-handshake (same connection or same session) ends the earlier epochs: their
            # requests fail, and the answer waits until none of their writes can still run
            ended = self._sessions.end_epochs(identity, session)
            for peer in ended:
                self._drop_peer_locked(peer, "decode re-handshaked")
            self._sessions.begin(DecodePeer(identity, hello.node, engine_peer, pairing.pairs,
                                            time.monotonic(), session=session,
                                            aux_pairs=pairing.aux_pairs,
                                            staging=pairing.staging,
                                            kv_page_zero=hello.kv_page_zero), hello)
            for peer in ended:
                self._disconnect_engine_locked(peer)
            self.counters.add(handshakes_ok=1)
            log.info("%s: paired with %s (%d buffers)", self.name, hello.node, len(pairing.pairs))
            self._answer_held_locked()

    def _answer_held_locked(self) -> None:
        """Answer the Hellos none of whose session's earlier writes can still run; name the
        rooms a failed engine write of theirs may still land in."""
        for fence in self._sessions.answerable():
            self._send(self._responder.ack(fence.hello, in_flight=fence.in_flight()), fence.identity)

    def _drop_peer_locked(self, peer: DecodePeer, reason: str) -> None:
        """Fail an unpaired decode node's requests; keep it while its writes matter."""
        now = time.monotonic()
        self._requests.drop_peer_locked(peer, reason, now)
        self._sessions.dropped(peer, now)

    def _disconnect_engine_locked(self, peer: DecodePeer) -> None:
        """Release the engine's connections to a dropped decode node (Mooncake keeps them open
        otherwise), unless a paired node still uses the same engine peer."""
        if self._sessions.uses_engine(peer.engine_peer):
            return
        try:
            self.backend.disconnect(peer.engine_peer)
        except BackendError as exc:
            log.warning("%s: disconnecting the engine of %s: %s", self.name, peer.node, exc)

    def _on_tick(self, now: float) -> None:
        with self._lock:
            for peer in list(self._sessions.peers.values()):
                if self._liveness.silent(peer.last_seen, now):
                    log.warning("%s: decode %s silent for %.1fs: dropping it", self.name,
                                peer.node, now - peer.last_seen)
                    self._sessions.unpair(peer)
                    self._drop_peer_locked(peer, f"decode {peer.node} unreachable")
                    self._disconnect_engine_locked(peer)
            self._requests.expire_locked(now)
            self._answer_held_locked()
            self._sessions.prune(now, self.request_timeout_s)
            self._requests.refuse_unclaimed_locked(now)
            if self._liveness.heartbeat_due(now):
                for peer in self._sessions.peers.values():
                    self._send(protocol.Heartbeat(time.time()), peer.identity)
