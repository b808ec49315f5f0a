"""The prefill side: accepts decode nodes, and writes each request's pages into them.

``PrefillNode`` listens on a control endpoint, validates every decode node's handshake, and
pairs the buffers it writes into that node (``handshake.transfer_set``: the layers it holds, the
indexers decode holds and reads) with the ones that node announced. A ``KVSender`` per request
(room) takes the prefill's page ids, in one or more chunks; once decode has sent its page ids for
the room, each chunk goes to the writer (``writer.py``: one lane per decode engine peer), which
plans it (every paired buffer, coalesced and bounds-checked) and writes it through the engine
together with the other chunks queued for that peer; the node then reports the chunk to decode
(with its page checksums when ``checksums`` is on). Rooms that decode announced but that have no
sender yet are offered to the application on ``incoming``. Aux buffers
(``aux_buffers``: one slot per request in each) are paired with decode's by position; a
request's aux slot travels with its last chunk.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import msgspec
import numpy as np
import zmq

from ..plugin.descriptors import BufferDescriptor
from . import auth, checksum, protocol, receive_limits
from .backends.base import BackendError, TransferBackend
from .control import parse_endpoint, zmq_address
from .counters import Counters
from .handshake import (
    HandshakeError,
    check_index_reads,
    check_peer,
    pair_with_peer,
    pool_buffers,
    transfer_set,
)
from .node_runtime import NodeRuntime
from .plan import (
    AUX_KIND,
    BufferPair,
    PairTable,
    PlanError,
    as_aux_buffers,
    as_page_ids,
    check_aux_index,
    check_destination,
    pair_aux,
)
from .request import TERMINAL, KVPoll, RequestHandle
from .writer import Job, Result, Writer

log = logging.getLogger(__name__)

MAX_ROOM = 2**63 - 1  # room ids are SGLang bootstrap rooms: non-negative 63-bit


@dataclass
class DecodePeer:
    identity: bytes
    node: str
    engine_peer: str
    pairs: PairTable
    last_seen: float
    rooms: set[int] = field(default_factory=set)
    session: bytes = b""  # decode's session: a later Hello of it ends this epoch
    senders: list[KVSender] = field(default_factory=list)  # once dropped: its rooms' senders
    dropped_at: float = 0.0
    aux_pairs: list[BufferPair] = field(default_factory=list)


@dataclass
class _Fence:
    """A re-handshake's answer, held until none of the session's earlier writes can run."""

    identity: bytes
    hello: protocol.Hello
    senders: list[KVSender]


@dataclass(frozen=True)
class IncomingRoom:
    """A room decode has allocated pages for, waiting for the application's sender."""

    room: int
    num_pages: int
    num_tokens: int
    peer: str


@dataclass
class _Room:
    peer: DecodePeer
    dst_pages: np.ndarray
    num_tokens: int
    received_at: float
    aux_index: int | None = None  # decode's aux slot


class KVSender(RequestHandle):
    """One request on the prefill side (SGLang's BaseKVSender semantics)."""

    def __init__(self, node: PrefillNode, room: int, timeout_s: float):
        super().__init__(room, timeout_s)
        self.node = node
        self.num_pages: int | None = None
        self.pages_sent = 0
        self.chunks_sent = 0
        self.pending: list[tuple[int, np.ndarray, bool]] = []
        self.busy = 0  # chunks queued for or inside the writer
        self.reported = False
        self.write_failed = False  # an engine write failed: its bytes may still land
        self.aux_index: int | None = None  # this request's aux slot, written with the last chunk

    def init(self, num_pages: int, aux_index: int | None = None) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        try:
            self.aux_index = check_aux_index(self.node.aux_buffers, aux_index, "aux_index")
        except PlanError as exc:
            raise ValueError(str(exc)) from None
        self.node._init_sender(self, num_pages)

    def send(self, page_ids) -> None:
        """Queue a chunk of this request's prefill page ids; the chunk that completes
        ``num_pages`` is the last one."""
        self.node._send_chunk(self, as_page_ids(page_ids, "page_ids"))

    def abort(self, reason: str = "aborted by prefill") -> None:
        self.node._fail(self, reason)

    def can_release(self) -> bool:
        """True once no write reading this request's pages can still be running."""
        return self.state.status in TERMINAL and self.busy == 0


class PrefillNode:
    """Serves decode nodes from one pool through one engine backend.

    One plain lock guards the peers, rooms, senders and fences; each entry point takes it once
    (the application's calls, each message and tick, each outcome a writer lane reports), and
    methods named ``_..._locked`` expect it held. The writer's blocking calls (``close``) are never
    made with it held: its lanes call back into the node (``_finish``) and take it."""

    def __init__(self, pool, backend: TransferBackend, *, listen: str = "127.0.0.1:0",
                 name: str = "prefill", request_timeout_s: float = 60.0,
                 peer_timeout_s: float = 5.0, heartbeat_s: float = 0.5,
                 write_timeout_s: float = 30.0, secret: bytes = b"",
                 allow_insecure: bool = False, checksums: bool = False,
                 aux_buffers=()):
        host, port = parse_endpoint(listen, "listen")
        auth.check_listener(host, secret, allow_insecure)
        self.pool = pool
        self.layout = pool.layout
        self.backend = backend
        self.name = name
        self.request_timeout_s = request_timeout_s
        self.write_timeout_s = write_timeout_s
        self.secret = secret
        self.checksums = checksums  # send each chunk's page checksums (may change between requests)
        self._views: dict | None = None  # the pool's page views, made when checksums first run
        self._replays = auth.ReplayGuard()
        self.counters = Counters()
        self.refusals: collections.deque[str] = collections.deque(maxlen=100)  # the latest
        # a Queue, not a SimpleQueue: CPython 3.11's SimpleQueue.get(timeout) blocks forever when
        # a signal interrupts it near its deadline, and applications wait on this one with a
        # timeout in their main thread, where SIGTERM arrives
        self.incoming: queue.Queue[IncomingRoom] = queue.Queue()
        self.buffers = pool_buffers(pool)
        self.aux_buffers = as_aux_buffers(aux_buffers)  # (ptr, nbytes, item_len): host memory

        self._lock = threading.Lock()
        self._peers: dict[bytes, DecodePeer] = {}
        self._rooms: dict[int, _Room] = {}
        self._senders: dict[int, KVSender] = {}
        self._gone: dict[int, tuple[str, float]] = {}  # room -> (why, when) its decode left
        self._departed: list[DecodePeer] = []  # dropped decode peers, while their writes matter
        self._fences: dict[bytes, _Fence] = {}  # session -> the answer it waits for

        self._runtime = NodeRuntime(name, backend, self.buffers + self.aux_buffers, self.counters,
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
            self._writer = Writer(backend, name=name, timeout_s=write_timeout_s,
                                  prepare=self._prepare, finish=self._finish)
            self._runtime.start([self._socket])
        except BaseException:
            self._runtime.close()
            raise
        log.info("%s listening on %s (backend %s, transport %s)", name, self.endpoint,
                 backend.name, backend.transport())

    # ---- application API -------------------------------------------------------------------

    def sender(self, room: int) -> KVSender:
        with self._lock:
            if room in self._senders:
                raise ValueError(f"room {room} already has a sender")
            sender = KVSender(self, room, self.request_timeout_s)
            self._senders[room] = sender
            if room in self._rooms:
                sender.state.advance(KVPoll.WaitingForInput, time.monotonic())
            gone = self._gone.pop(room, None)
            if gone is not None:  # its decode node was dropped before the application came
                self._fail_locked(sender, gone[0])
            return sender

    def peers(self) -> list[str]:
        with self._lock:
            return [p.node for p in self._peers.values()]

    def close(self) -> None:
        """Let the writer's lanes finish (their outcomes still reach decode), then close the
        runtime: loop, sockets, engine. Idempotent."""
        if self._runtime.closed:
            return
        self._writer.close(self.write_timeout_s + 5)
        self._runtime.close()

    def __enter__(self) -> PrefillNode:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- sender operations (application thread) --------------------------------------------

    def _init_sender(self, sender: KVSender, num_pages: int) -> None:
        with self._lock:
            if sender.num_pages is not None:
                raise ValueError(f"room {sender.room}: init called twice")
            sender.num_pages = num_pages
            room = self._rooms.get(sender.room)
            if room is not None and len(room.dst_pages) != num_pages:
                self._fail_locked(sender, f"page count mismatch: prefill has {num_pages} pages, "
                                   f"decode allocated {len(room.dst_pages)}")

    def _send_chunk(self, sender: KVSender, pages: np.ndarray) -> None:
        with self._lock:
            if sender.state.status in TERMINAL:
                return
            if sender.num_pages is None:
                raise ValueError(f"room {sender.room}: send before init")
            if pages.size == 0 or sender.pages_sent + pages.size > sender.num_pages:
                self._fail_locked(sender, f"chunk of {pages.size} pages after {sender.pages_sent} "
                                   f"does not fit the request's {sender.num_pages} pages")
                return
            offset = sender.pages_sent
            sender.pages_sent += pages.size
            sender.pending.append((offset, pages, sender.pages_sent == sender.num_pages))
            self._dispatch_locked(sender)

    def _dispatch_locked(self, sender: KVSender) -> None:
        """Hand queued chunks to the writer once decode's pages are known."""
        room = self._rooms.get(sender.room)
        if room is None or not sender.pending:
            return
        sender.state.advance(KVPoll.Transferring, time.monotonic())
        for offset, pages, last in sender.pending:
            sender.busy += 1
            self._writer.submit(Job(sender, room, room.peer.engine_peer, room.peer.pairs, offset,
                                    pages, room.dst_pages[offset:offset + pages.size], last,
                                    aux_pairs=room.peer.aux_pairs, aux_src=sender.aux_index,
                                    aux_dst=room.aux_index))
        sender.pending.clear()

    def _fail(self, sender: KVSender, reason: str) -> None:
        with self._lock:
            self._fail_locked(sender, reason)

    def _fail_locked(self, sender: KVSender, reason: str, *, in_flight: bool = False) -> None:
        if sender.state.fail(reason, time.monotonic()):
            self.counters.request_failed(reason)
            log.warning("%s: room %d failed: %s", self.name, sender.room, reason)
        self._report_failure_locked(sender, in_flight=in_flight)

    def _report_failure_locked(self, sender: KVSender, *, in_flight: bool) -> None:
        """Tell decode once, when no write of ours into its pages is still running."""
        room = self._rooms.get(sender.room)
        if sender.reported or sender.busy or room is None:
            return
        sender.reported = True
        self._loop.send(self._socket, protocol.ChunkDone(
            sender.room, sender.chunks_sent, ok=False, last=True, reason=sender.state.reason,
            in_flight=in_flight or sender.write_failed), room.peer.identity)

    # ---- the writer's outcomes (a lane's thread) -------------------------------------------

    def _prepare(self, job: Job, pairs: PairTable) -> protocol.PageChecksums | None:
        """What a chunk needs before its write: its page checksums, when they are on."""
        return self._checksums(job.pages, job.offset, pairs) if self.checksums else None

    def _finish(self, result: Result) -> None:
        """One chunk left the writer: written, failed, or skipped (its request had failed)."""
        sender = result.job.sender
        with self._lock:
            if result.ok:
                self._chunk_written_locked(sender, result.job.room, result.plan, result.job.last,
                                           result.seconds, result.sums)
            elif result.reason:
                if result.engine_failure and result.batch_index == 0:
                    self.counters.add(engine_failures=1)
                if result.in_flight:
                    sender.write_failed = True
                self._fail_locked(sender, result.reason, in_flight=result.in_flight)
            sender.busy -= 1
            if sender.state.status == KVPoll.Failed:
                self._report_failure_locked(sender, in_flight=result.in_flight)

    def _checksums(self, pages: np.ndarray, offset: int, pairs: PairTable) -> protocol.PageChecksums:
        started = time.perf_counter()
        if self._views is None:
            self._views = checksum.pool_views(self.pool)
        sums = checksum.chunk_checksums(self._views, [(p.src.layer_id, p.src.kind) for p in pairs],
                                        pages, offset, checksum.algorithm_for(self.pool.device))
        self.counters.add(checksums_computed=pages.size * len(pairs),
                          checksum_seconds=time.perf_counter() - started)
        return sums

    def _chunk_written_locked(self, sender: KVSender, room: _Room, plan, last: bool,
                              seconds: float, sums: protocol.PageChecksums | None) -> None:
        self.counters.add(chunks=1, bytes=plan.nbytes, descriptors=plan.descriptors,
                          write_seconds=seconds)
        sender.chunks_sent += 1
        if sender.state.status == KVPoll.Failed:  # aborted while writing: already reported
            return
        self._loop.send(self._socket, protocol.ChunkDone(
            sender.room, sender.chunks_sent - 1, ok=True, last=last, nbytes=plan.nbytes,
            descriptors=plan.descriptors, write_seconds=seconds, checksums=sums),
            room.peer.identity)
        if last and sender.state.advance(KVPoll.Success, time.monotonic()):
            state = sender.state
            self.counters.request_ok(state.finished_at - (state.transferring_at or state.created))

    # ---- control plane (loop thread) -------------------------------------------------------

    def _on_message(self, sock: zmq.Socket, identity: bytes, message) -> None:
        if isinstance(message, protocol.Hello):
            self._on_hello(identity, message)
            return
        with self._lock:
            peer = self._peers.get(identity)
            if peer is None:
                raise protocol.ProtocolError(f"{type(message).__name__} before a handshake")
            peer.last_seen = time.monotonic()
            if isinstance(message, protocol.RequestPages):
                self._on_request_locked(peer, message)
            elif isinstance(message, protocol.Abort):
                self._on_abort_locked(peer, message)
            elif not isinstance(message, protocol.Heartbeat):
                raise protocol.ProtocolError(f"unexpected {type(message).__name__} from decode")

    def _authenticate(self, hello: protocol.Hello) -> None:
        if not self.secret:
            return
        if not auth.verify(self.secret, hello.auth, protocol.signed_bytes(hello)):
            raise HandshakeError("authentication failed: no valid proof of the shared secret")
        replay = self._replays.check(hello.nonce, hello.sent_at)
        if replay:
            raise HandshakeError(f"authentication failed: {replay}")

    def _on_hello(self, identity: bytes, hello: protocol.Hello) -> None:
        try:
            self._authenticate(hello)
            layout = check_peer(self.layout, self.backend.name, version=hello.version,
                                peer_backend=hello.backend, peer_layout=hello.layout,
                                peer_hash=hello.layout_hash)
            try:
                reads = check_index_reads(layout, hello.index_reads)
            except ValueError as exc:
                raise HandshakeError(str(exc)) from None
            keys = transfer_set(self.layout, layout, reads)
            pairs = pair_with_peer(layout, self.buffers, hello.buffers, keys)
            aux_pairs = self._pair_aux(hello)
            engine_peer = self.backend.connect(hello.engine_metadata)
        except (HandshakeError, BackendError) as exc:
            self.counters.add(handshakes_refused=1)
            self.refusals.append(f"{hello.node}: {exc}")
            log.warning("%s: refused %s: %s", self.name, hello.node, exc)
            self._loop.send(self._socket, self._ack(False, str(exc), hello), identity)
            return
        session = hello.session or identity
        with self._lock:
            # a re-handshake (same connection or same session) ends the earlier epochs: their
            # rooms are dropped, and the answer waits until none of their writes can still run
            old = [p for p in self._peers.values() if p.identity == identity or p.session == session]
            for peer in old:
                del self._peers[peer.identity]
                self._drop_peer_locked(peer, "decode re-handshaked")
            self._peers[identity] = DecodePeer(identity, hello.node, engine_peer, pairs,
                                               time.monotonic(), session=session,
                                               aux_pairs=aux_pairs)
            for peer in old:
                self._disconnect_engine_locked(peer)
            self._fences[session] = _Fence(identity, hello, [
                s for p in self._departed if p.session == session for s in p.senders])
            self.counters.add(handshakes_ok=1)
            log.info("%s: paired with %s (%d buffers)", self.name, hello.node, len(pairs))
            self._answer_fenced_locked()

    def _answer_fenced_locked(self) -> None:
        """Answer the handshakes none of whose session's earlier writes can still run
        (``busy == 0``); name the rooms a failed engine write of theirs may still land in."""
        for session, fence in list(self._fences.items()):
            if any(s.busy for s in fence.senders):
                continue
            del self._fences[session]
            ack = msgspec.structs.replace(
                self._ack(True, "", fence.hello, unsigned=True),
                in_flight=sorted({s.room for s in fence.senders if s.write_failed}))
            self._loop.send(self._socket, self._sign(ack, fence.hello), fence.identity)

    def _pair_aux(self, hello: protocol.Hello) -> list[BufferPair]:
        remote = [BufferDescriptor(i, AUX_KIND, a.ptr, a.nbytes, a.item_len)  # numbered here
                  for i, a in enumerate(hello.aux_buffers)]
        try:
            return pair_aux(self.aux_buffers, remote)
        except PlanError as exc:
            raise HandshakeError(str(exc)) from None

    def _ack(self, ok: bool, reason: str, hello: protocol.Hello, *,
             unsigned: bool = False) -> protocol.HelloAck:
        """The answer to ``hello``, signed together with its nonce when a secret is set."""
        ack = protocol.HelloAck(protocol.PROTOCOL_VERSION, ok, reason, self.name,
                                self.layout.to_dict(), self.layout.layout_hash(), epoch=hello.epoch)
        return ack if unsigned else self._sign(ack, hello)

    def _sign(self, ack: protocol.HelloAck, hello: protocol.Hello) -> protocol.HelloAck:
        if not self.secret:
            return ack
        return msgspec.structs.replace(ack, auth=auth.sign(
            self.secret, b"ack", hello.nonce, protocol.signed_bytes(ack)))

    def _refuse_request(self, peer: DecodePeer, room: int, reason: str) -> None:
        log.warning("%s: refused room %d from %s: %s", self.name, room, peer.node, reason)
        self._loop.send(self._socket, protocol.ChunkDone(room, 0, ok=False, last=True,
                                                         reason=reason), peer.identity)

    def _on_request_locked(self, peer: DecodePeer, request: protocol.RequestPages) -> None:
        if not 0 <= request.room <= MAX_ROOM:
            self._refuse_request(peer, request.room, f"room {request.room} is not in 0..2**63-1")
            return
        if request.room in self._rooms:
            self._on_duplicate_locked(peer, request.room)
            return
        try:
            dst = check_destination(peer.pairs, request.dst_pages)
            aux = check_aux_index([p.dst for p in peer.aux_pairs], request.aux_index, "decode's aux_index")
        except PlanError as exc:
            self._refuse_request(peer, request.room, f"bad pages: {exc}")
            return
        self._rooms[request.room] = _Room(peer, dst, request.num_tokens, time.monotonic(), aux)
        peer.rooms.add(request.room)
        sender = self._senders.get(request.room)
        if sender is None:
            self.incoming.put(IncomingRoom(request.room, dst.size, request.num_tokens, peer.node))
            return
        if sender.state.status == KVPoll.Failed:  # failed before decode's pages arrived
            self._report_failure_locked(sender, in_flight=False)
            return
        sender.state.advance(KVPoll.WaitingForInput, time.monotonic())
        if sender.num_pages is not None and sender.num_pages != dst.size:
            self._fail_locked(sender, f"page count mismatch: prefill has {sender.num_pages} pages, "
                               f"decode allocated {dst.size}")
            return
        self._dispatch_locked(sender)

    def _on_duplicate_locked(self, peer: DecodePeer, room_id: int) -> None:
        """A room announced again. From another decode node, the newcomer's request is the one
        refused. From the same node, it no longer knows which pages it meant: the room fails,
        and, like any failure, is reported only once no write of ours into it can still land."""
        room = self._rooms[room_id]
        sender = self._senders.get(room_id)
        if room.peer is not peer or sender is None:
            if room.peer is peer:
                del self._rooms[room_id]
                peer.rooms.discard(room_id)
            self._refuse_request(peer, room_id, f"duplicate room {room_id}")
            return
        self._fail_locked(sender, f"duplicate room {room_id}")

    def _on_abort_locked(self, peer: DecodePeer, abort: protocol.Abort) -> None:
        room = self._rooms.get(abort.room)
        if room is not None and room.peer is not peer:
            raise protocol.ProtocolError(f"abort of room {abort.room}, which another decode "
                                         f"node announced")
        sender = self._senders.get(abort.room)
        if sender is None or room is None:
            self._rooms.pop(abort.room, None)
            peer.rooms.discard(abort.room)
            self._refuse_request(peer, abort.room, f"aborted by decode: {abort.reason}")
            return
        self._fail_locked(sender, f"aborted by decode: {abort.reason}")

    def _forget_locked(self, room_id: int) -> None:
        """Drop a finished room; the application keeps its sender object and its state."""
        self._senders.pop(room_id, None)
        room = self._rooms.pop(room_id, None)
        if room is not None:
            room.peer.rooms.discard(room_id)

    def _drop_peer_locked(self, peer: DecodePeer, reason: str) -> None:
        """Fail a dropped decode node's rooms; its senders are kept (``_departed``) for the fence
        of its session's next handshake."""
        now = time.monotonic()
        for room in list(peer.rooms):
            sender = self._senders.get(room)
            if sender is None:  # offered on ``incoming``: a sender made later fails at once
                self._gone[room] = (reason, now)
            else:
                peer.senders.append(sender)
                if sender.state.fail(reason, now):
                    self.counters.request_failed(reason)
            self._rooms.pop(room, None)
        peer.dropped_at = now
        self._departed.append(peer)

    def _disconnect_engine_locked(self, peer: DecodePeer) -> None:
        """Release the engine's connections to a dropped decode node (Mooncake keeps them open
        otherwise), unless a paired node still uses the same engine peer."""
        if any(other.engine_peer == peer.engine_peer for other in self._peers.values()):
            return
        try:
            self.backend.disconnect(peer.engine_peer)
        except BackendError as exc:
            log.warning("%s: disconnecting the engine of %s: %s", self.name, peer.node, exc)

    def _on_tick(self, now: float) -> None:
        with self._lock:
            for identity, peer in list(self._peers.items()):
                if self._liveness.silent(peer.last_seen, now):
                    log.warning("%s: decode %s silent for %.1fs: dropping it", self.name,
                                peer.node, now - peer.last_seen)
                    del self._peers[identity]
                    self._drop_peer_locked(peer, f"decode {peer.node} unreachable")
                    self._disconnect_engine_locked(peer)
            for sender in list(self._senders.values()):
                if sender.state.status not in TERMINAL and now > sender.state.deadline:
                    self._fail_locked(sender, f"timed out after {self.request_timeout_s:.0f}s")
                if sender.can_release() and (sender.reported or now > sender.state.deadline
                                             or sender.state.status == KVPoll.Success):
                    self._forget_locked(sender.room)
            if self._gone:
                self._gone = {r: g for r, g in self._gone.items()
                              if now - g[1] <= self.request_timeout_s}
            if self._fences:
                self._answer_fenced_locked()
            if self._departed:  # kept while a write may run, and long enough for a re-handshake
                self._departed = [p for p in self._departed if any(s.busy for s in p.senders)
                                  or now - p.dropped_at <= self.request_timeout_s]
            for room_id, room in list(self._rooms.items()):
                if room_id not in self._senders and now - room.received_at > self.request_timeout_s:
                    del self._rooms[room_id]
                    room.peer.rooms.discard(room_id)
                    self._refuse_request(room.peer, room_id, "no prefill request for this room")
            if self._liveness.heartbeat_due(now):
                for peer in self._peers.values():
                    self._loop.send(self._socket, protocol.Heartbeat(time.time()), peer.identity)
