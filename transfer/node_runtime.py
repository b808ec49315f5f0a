"""What a prefill and a decode node share: engine registration, the control loop, liveness, close.

``NodeRuntime`` registers the node's regions (its pool buffers and aux buffers) with the engine
backend, and from then on owns the backend, a ZMQ context with the sockets the node makes on it
(``socket``), and the ``ControlLoop`` that owns those sockets once started (``start``). Its tick,
every ``tick_ms`` (the engine's ``backend.tick_ms``; for a ``paced`` node, whose tick is only its
heartbeats and deadlines, ``Liveness.tick_ms``: decode over Mooncake every 50 ms at the default
heartbeat), runs ``backend.progress()``, then the node's tick, then copies the
loop's ``bad_messages`` and ``max_tick_gap_s`` into the node's counters where they changed (a write
replaces the counters' whole struct under their lock: idle ticks need none). ``close`` stops the
loop (which sends what is queued), closes every socket with the context — giving the messages still
in ZMQ's queues ``CLOSE_LINGER_MS`` to leave, so a request's last ``ChunkDone`` reaches a live peer
when the node closes right after its request succeeded — then closes the backend: in that order,
once, and as well from a construction that failed half-way (the node calls it on any failure after
the runtime exists; a failed registration closes the backend at once).

``liveness`` is the node's ``liveness.Liveness`` (pure, time passed in): when the next heartbeat
is due, and when a peer that has not been heard from counts as silent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import zmq

from ..plugin.descriptors import BufferDescriptor
from .backends.base import TransferBackend
from .control import ControlLoop, OnMessage, limit_receive
from .counters import Counters
from .liveness import Liveness

CLOSE_LINGER_MS = 500  # at close, the longest queued messages may take to leave (a dead peer's wait)


class NodeRuntime:
    """A node's registered engine, ZMQ context and control loop, from registration to close."""

    def __init__(self, name: str, backend: TransferBackend, regions: list[BufferDescriptor],
                 counters: Counters, *, on_message: OnMessage, on_tick: Callable[[float], None],
                 heartbeat_s: float, peer_timeout_s: float,
                 on_round: Callable[[float], None] | None = None, paced: bool = False):
        self.name = name
        self.backend = backend
        self.counters = counters
        self.liveness = Liveness(heartbeat_s, peer_timeout_s)
        self.tick_ms = (self.liveness.tick_ms(backend.tick_ms, needs_progress=backend.needs_progress)
                        if paced else backend.tick_ms)
        self._on_tick = on_tick
        self._loop_figures = (0, 0.0)  # (bad_messages, max_tick_gap_s) as last copied
        self.closed = False
        try:
            backend.register(regions)
            self.context = zmq.Context()
        except BaseException:
            self.closed = True
            backend.close()
            raise
        self.loop = ControlLoop(name, on_message, self._tick, self.tick_ms, on_round=on_round)

    def socket(self, kind: int, receive_limit: int) -> zmq.Socket:
        """A socket of ``kind`` on the runtime's context: no linger, messages larger than
        ``receive_limit`` dropped by ZMQ (``control.limit_receive``). Closed by ``close``."""
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        limit_receive(sock, receive_limit)
        return sock

    def start(self, sockets: Iterable[zmq.Socket]) -> None:
        """Hand ``sockets`` to the control loop and start its thread."""
        for sock in sockets:
            self.loop.add_socket(sock)
        self.loop.start()

    def close(self) -> None:
        """Stop the loop, close the sockets and the context, close the backend; idempotent."""
        if self.closed:
            return
        self.closed = True
        self.loop.stop()
        self.context.destroy(CLOSE_LINGER_MS)
        self.backend.close()

    def _tick(self, now: float) -> None:
        self.backend.progress()
        try:
            self._on_tick(now)
        finally:
            figures = (self.loop.bad_messages, self.loop.max_tick_gap_s)
            if figures != self._loop_figures:
                self._loop_figures = figures
                self.counters.bad_messages, self.counters.max_tick_gap_s = figures
