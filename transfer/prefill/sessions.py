"""The prefill side of the handshake: answering decode's Hellos, and decode's sessions and epochs.

``HelloResponder`` checks a Hello: its proof of the shared secret and its freshness (a replay
guard on its nonce and send time), then the peer's version, engine, layout, indexer reads and
buffers (``handshake``), and pairs the buffers and aux buffers prefill writes with decode's; a
staging area decode offers must lie clear of its buffers (``staging.check_area``). It builds the
``HelloAck``, signed together with the Hello's nonce when a secret is set.

``Sessions`` is pure bookkeeping (time passed in): the paired decode nodes (``peers``, one
``DecodePeer`` per connection: an epoch of that node's session), the dropped ones
(``dropped_peers``, kept while a write of theirs may run and long enough for a re-handshake), and
the fences. A Hello on the same connection or of the same session ends the earlier epochs; its
answer (a ``Fence``) is held until none of the session's earlier writes can still run (no sender
of theirs ``busy``), and names the requests whose failed engine write may still land.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from ...plugin.descriptors import BufferDescriptor
from ...plugin.layout import DSALayout
from .. import auth, protocol
from ..handshake import (
    HandshakeError,
    check_index_reads,
    check_kv_on_index_pages,
    check_peer,
    pair_with_peer,
    transfer_set,
)
from ..plan import AUX_KIND, BufferPair, PairTable, PlanError, pair_aux
from ..staging import StagingError, check_area
from .records import DecodePeer, KVSender


@dataclass(frozen=True)
class Pairing:
    """What a valid Hello pairs: prefill's buffers and aux buffers with decode's."""

    pairs: PairTable
    aux_pairs: list[BufferPair]
    staging: protocol.StagingArea | None = None


class HelloResponder:
    """Checks decode's Hellos against this node and builds its answers."""

    def __init__(self, name: str, layout: DSALayout, backend_name: str,
                 buffers: list[BufferDescriptor], aux_buffers: list[BufferDescriptor],
                 secret: bytes):
        self.name = name
        self.layout = layout
        self.backend_name = backend_name
        self.buffers = buffers
        self.aux_buffers = aux_buffers
        self.secret = secret
        self._replays = auth.ReplayGuard()

    def pair(self, hello: protocol.Hello) -> Pairing:
        """The buffers to write for the decode node of ``hello``; HandshakeError naming why not."""
        self._authenticate(hello)
        layout = check_peer(self.layout, self.backend_name, version=hello.version,
                            peer_backend=hello.backend, peer_layout=hello.layout,
                            peer_hash=hello.layout_hash)
        try:
            reads = check_index_reads(layout, hello.index_reads)
            kv_on_index = check_kv_on_index_pages(layout, hello.kv_on_index_pages)
        except ValueError as exc:
            raise HandshakeError(str(exc)) from None
        keys = transfer_set(self.layout, layout, reads)
        pairs = PairTable(pair_with_peer(layout, self.buffers, hello.buffers, keys), kv_on_index)
        remote = [BufferDescriptor(i, AUX_KIND, a.ptr, a.nbytes, a.item_len)  # numbered here
                  for i, a in enumerate(hello.aux_buffers)]
        area = hello.staging
        try:
            if area is not None:
                check_area(area.ptr, area.slice_bytes, area.slices,
                           [(b.ptr, b.nbytes) for b in (*hello.buffers, *hello.aux_buffers)])
            return Pairing(pairs, pair_aux(self.aux_buffers, remote), area)
        except (PlanError, StagingError) as exc:
            raise HandshakeError(str(exc)) from None

    def ack(self, hello: protocol.Hello, *, ok: bool = True, reason: str = "",
            in_flight: list[int] | None = None) -> protocol.HelloAck:
        """The answer to ``hello`` (``in_flight``: the rooms of its session's earlier epochs whose
        failed write may still land), signed together with its nonce when a secret is set."""
        ack = protocol.HelloAck(protocol.PROTOCOL_VERSION, ok, reason, self.name,
                                self.layout.to_dict(), self.layout.layout_hash(), epoch=hello.epoch,
                                in_flight=in_flight or [])
        if not self.secret:
            return ack
        return msgspec.structs.replace(ack, auth=auth.sign(
            self.secret, b"ack", hello.nonce, protocol.signed_bytes(ack)))

    def _authenticate(self, hello: protocol.Hello) -> None:
        if not self.secret:
            return
        if not auth.verify(self.secret, hello.auth, protocol.signed_bytes(hello)):
            raise HandshakeError("authentication failed: no valid proof of the shared secret")
        replay = self._replays.check(hello.nonce, hello.sent_at)
        if replay:
            raise HandshakeError(f"authentication failed: {replay}")


@dataclass
class Fence:
    """A new epoch's answer, held until none of its session's earlier writes can run."""

    identity: bytes
    hello: protocol.Hello
    senders: list[KVSender]  # the requests of the session's dropped epochs

    def blocked(self) -> bool:
        return any(s.busy for s in self.senders)

    def in_flight(self) -> list[int]:
        """The rooms whose failed engine write may still land."""
        return sorted({s.room for s in self.senders if s.write_failed})


class Sessions:
    """Decode's sessions: the paired peers, the dropped ones, the held answers (see the module
    docstring). Guarded by the node's lock."""

    def __init__(self) -> None:
        self.peers: dict[bytes, DecodePeer] = {}  # identity -> the paired decode node
        self.dropped_peers: list[DecodePeer] = []  # while their writes matter
        self._fences: dict[bytes, Fence] = {}  # session -> the answer it waits for

    def end_epochs(self, identity: bytes, session: bytes) -> list[DecodePeer]:
        """Unpair the peers a Hello on connection ``identity`` of ``session`` ends."""
        ended = [p for p in self.peers.values() if p.identity == identity or p.session == session]
        for peer in ended:
            self.unpair(peer)
        return ended

    def begin(self, peer: DecodePeer, hello: protocol.Hello) -> None:
        """Pair ``peer`` (its ``hello`` accepted) and hold the answer behind its session's
        dropped epochs."""
        self.peers[peer.identity] = peer
        self._fences[peer.session] = Fence(peer.identity, hello, [
            s for p in self.dropped_peers if p.session == peer.session for s in p.dropped_senders])

    def dropped(self, peer: DecodePeer, now: float) -> None:
        """Keep an unpaired ``peer``, whose requests were failed, while its writes matter."""
        peer.dropped_at = now
        self.dropped_peers.append(peer)

    def answerable(self) -> list[Fence]:
        """Take the held answers none of whose session's earlier writes can still run."""
        ready = [(session, fence) for session, fence in self._fences.items() if not fence.blocked()]
        for session, _ in ready:
            del self._fences[session]
        return [fence for _, fence in ready]

    def unpair(self, peer: DecodePeer) -> None:
        del self.peers[peer.identity]

    def prune(self, now: float, keep_s: float) -> None:
        """Forget the dropped peers no write of which can run, after ``keep_s``."""
        if self.dropped_peers:
            self.dropped_peers = [p for p in self.dropped_peers
                                  if any(s.busy for s in p.dropped_senders) or now - p.dropped_at <= keep_s]

    def latest(self, identity: bytes) -> DecodePeer | None:
        """The paired peer of connection ``identity``, else its latest dropped epoch."""
        peer = self.peers.get(identity)
        if peer is not None:
            return peer
        return next((p for p in reversed(self.dropped_peers) if p.identity == identity), None)

    def uses_engine(self, engine_peer: str) -> bool:
        return any(peer.engine_peer == engine_peer for peer in self.peers.values())

    def names(self) -> list[str]:
        return [peer.node for peer in self.peers.values()]
