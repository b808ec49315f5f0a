"""The control-plane loop: one thread owns a node's ZMQ sockets.

Other threads never touch a socket; they queue messages with ``send``, which also wakes the loop
through a pipe so that a queued message leaves at once rather than at the next poll timeout (the
first message queued since the loop's last flush writes to the pipe, the others of a burst ride
along). The loop sends what is queued, decodes what arrives (a malformed message is counted and
dropped, never fatal), and calls the node's ``on_tick`` every ``poll_ms`` for heartbeats,
deadlines and engine progress: on its schedule, not after every message, so that a burst of
messages does not run the node's whole tick once per message. ``on_round``, where given, runs
after every round (a wake-up, messages, or a tick's time): the work another thread hands back to
the loop's thread (decode's messages held behind staged slices) runs as soon as that thread's
``send`` wakes the loop.

The work between two ticks is bounded, so that no peer can starve the tick: each round takes at
most ``batch`` messages, one socket after another (a ROUTER socket fair-queues its own peers), and
stops early once ``budget_s`` has passed; a round so cut short is followed by the tick, due or
not, whatever is still queued. A round therefore lasts at most ``budget_s`` plus the handling of
one message, whose size the socket's receive limit (``limit_receive``, ZMQ_MAXMSGSIZE: larger
messages are dropped by ZMQ before any allocation and their connection is closed) and the
protocol's bounds keep small. Dropped messages are logged one by one up to ``LOG_BURST`` per
second and summarised beyond that, so that a flood cannot turn into a flood of log lines.
``max_tick_gap_s`` is the longest time between two ticks.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable

import zmq

from . import protocol
from .protocol import Message, ProtocolError

log = logging.getLogger(__name__)

OnMessage = Callable[[zmq.Socket, bytes, Message], None]

BATCH = 64  # messages per round, over all sockets
BUDGET_S = 0.005  # a round stops taking messages after this long; the tick runs next
LOG_BURST = 10  # dropped messages logged one by one per LOG_WINDOW_S; the rest summarised
LOG_WINDOW_S = 1.0


def parse_endpoint(text: str, name: str = "endpoint") -> tuple[str, int]:
    """'HOST:PORT' -> (host, port); port 0 means "any free port" when listening."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{name} must be HOST:PORT with a numeric port, got {text!r}")
    return host.strip("[]"), int(port)


def zmq_address(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def limit_receive(sock: zmq.Socket, max_bytes: int) -> None:
    """Make ZMQ drop any received message larger than ``max_bytes`` before allocating it, and
    close the connection it came on (the peer may reconnect; the node is untouched). Call before
    ``bind``/``connect``: ZMQ copies the option into each listener and connection it makes."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)


class ControlLoop:
    """Runs ``on_message`` for each decoded message and ``on_tick`` periodically, in one thread."""

    def __init__(self, name: str, on_message: OnMessage, on_tick: Callable[[float], None],
                 poll_ms: int = 2, *, batch: int = BATCH, budget_s: float = BUDGET_S,
                 on_round: Callable[[float], None] | None = None):
        if batch < 1 or budget_s <= 0:
            raise ValueError(f"batch must be >= 1 and budget_s > 0, got {batch} and {budget_s}")
        self.name = name
        self._on_message = on_message
        self._on_tick = on_tick
        self._on_round = on_round
        self._poll_ms = poll_ms
        self._batch = batch
        self._budget_s = budget_s
        self._outbox: queue.SimpleQueue[tuple[zmq.Socket, bytes | None, bytes]] = queue.SimpleQueue()
        self._sockets: list[zmq.Socket] = []
        self._limits: dict[zmq.Socket, int] = {}  # the largest message each socket may decode
        self._next = 0  # the socket the next round starts with
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.bad_messages = 0
        self.last_error = ""
        self.max_tick_gap_s = 0.0  # longest time between two ticks (or the start and the first)
        self._window_start = 0.0
        self._logged = 0  # dropped messages logged one by one in this window
        self._suppressed = 0  # ...and not logged
        self._wake_lock = threading.Lock()
        self._wake_r = self._wake_w = -1  # the wake-up pipe, open while the loop runs
        self._wake_pending = False  # a send has woken the loop since its last flush

    def add_socket(self, sock: zmq.Socket) -> None:
        if self._thread is not None:
            raise RuntimeError("add sockets before the loop starts")
        self._sockets.append(sock)
        limit = sock.getsockopt(zmq.MAXMSGSIZE)
        self._limits[sock] = limit if limit > 0 else protocol.MAX_MESSAGE_BYTES

    def send(self, sock: zmq.Socket, message: Message, identity: bytes | None = None) -> None:
        """Queue a message (thread-safe). ``identity`` addresses a peer of a ROUTER socket.
        Only the first message queued since the loop last flushed wakes it: a burst (64
        requests' ``RequestPages``, a batch's ``ChunkDone``) costs one write to the pipe, not one
        each, and so one hand-over of the GIL instead of one per message."""
        self._outbox.put((sock, identity, protocol.encode(message)))
        if not self._wake_pending:
            self._wake_pending = True
            self._wake()

    def _wake(self) -> None:
        with self._wake_lock:  # never write to a closed (possibly reused) descriptor
            if self._wake_w < 0:
                return
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:  # the pipe is full: the loop is already due to wake
                pass

    def start(self) -> None:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        with self._wake_lock:
            self._wake_r, self._wake_w = wake_r, wake_w
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-control", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():  # still polling the pipe: leave it open
                return
        with self._wake_lock:
            if self._wake_w >= 0:
                os.close(self._wake_r)
                os.close(self._wake_w)
                self._wake_r = self._wake_w = -1

    def _flush(self) -> None:
        self._wake_pending = False  # before taking the messages: a later send wakes the loop
        while True:
            try:
                sock, identity, data = self._outbox.get_nowait()
            except queue.Empty:
                return
            try:
                if identity is None:
                    sock.send(data, zmq.NOBLOCK)
                else:
                    sock.send_multipart([identity, data], zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # peer gone or queue full: heartbeats notice the peer
                log.debug("%s: send failed: %s", self.name, exc)

    def _drain_wakes(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass

    def _receive_one(self, sock: zmq.Socket) -> bool:
        """Take and handle one message from ``sock``; False when none is waiting."""
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return False
        self.handle(self._decode_and_handle, sock, frames)
        return True

    def _decode_and_handle(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        if len(frames) != (2 if sock.type == zmq.ROUTER else 1):
            raise ProtocolError(f"expected one payload frame, got {len(frames)} frames")
        message = protocol.decode(frames[-1], self._limits[sock])
        self._on_message(sock, frames[0] if sock.type == zmq.ROUTER else b"", message)

    def handle(self, handler: Callable[..., None], *args: object) -> None:
        """``handler(*args)``, the handling of a message, on the loop's thread: a ProtocolError
        it raises, or a bug, is counted and logged as a dropped message, never raised (a message
        the node held and handles later, decode's behind its staged slices, as well)."""
        try:
            handler(*args)
        except ProtocolError as exc:
            self._dropped(str(exc))
        except Exception as exc:  # a handler bug must not take the node down
            self._dropped(f"{type(exc).__name__}: {exc}", bug=True)

    def _receive(self, ready: list[zmq.Socket]) -> bool:
        """One round: up to ``batch`` messages, the ready sockets in turn, within the budget;
        True when the batch or the budget ended it (messages may still be waiting)."""
        if not ready:
            return False
        start = self._next % len(ready)
        pending = ready[start:] + ready[:start]
        self._next += 1
        deadline = time.monotonic() + self._budget_s
        taken = 0
        while pending:
            for sock in list(pending):
                if not self._receive_one(sock):
                    pending.remove(sock)
                    continue
                taken += 1
                if taken >= self._batch or time.monotonic() >= deadline:
                    return True
        return False

    def _dropped(self, error: str, *, bug: bool = False) -> None:
        """Count a message dropped as malformed or out of place (``bad_messages``) and log it
        within the burst."""
        self.bad_messages += 1
        self.last_error = error
        if self._logged >= LOG_BURST:
            self._suppressed += 1
            return
        self._logged += 1
        if bug:
            log.exception("%s: handling a message failed", self.name)
        else:
            log.warning("%s: dropped a message: %s", self.name, error)

    def _log_window(self, now: float, *, final: bool = False) -> None:
        """Every LOG_WINDOW_S (and on stop): summarise the drops not logged one by one."""
        if not final and now - self._window_start < LOG_WINDOW_S:
            return
        suppressed, last, start = self._suppressed, self.last_error, self._window_start
        self._window_start, self._logged, self._suppressed = now, 0, 0
        if suppressed:
            log.warning("%s: dropped %d more messages in %.1fs, not logged one by one; last: %s",
                        self.name, suppressed, now - start, last)

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in self._sockets:
            poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        last_tick = next_tick = self._window_start = time.monotonic()
        while not self._stop.is_set():
            self._flush()
            wait_ms = math.ceil(max(0.0, next_tick - time.monotonic()) * 1e3)
            events = dict(poller.poll(wait_ms))
            if self._wake_r in events:
                self._drain_wakes()
            cut = self._receive([sock for sock in self._sockets if sock in events])
            now = time.monotonic()
            if self._on_round is not None:
                try:
                    self._on_round(now)
                except Exception:  # a bug in a round must not stop the loop
                    log.exception("%s: round failed", self.name)
            if not cut and now < next_tick:
                continue
            self.max_tick_gap_s = max(self.max_tick_gap_s, now - last_tick)
            last_tick, next_tick = now, now + self._poll_ms / 1e3
            try:
                self._on_tick(now)
            except Exception:  # a bug in a tick must not silently stop heartbeats
                log.exception("%s: tick failed", self.name)
            self._log_window(now)
        self._flush()
        self._log_window(time.monotonic(), final=True)
