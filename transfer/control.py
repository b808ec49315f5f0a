"""The control-plane loop: one thread owns a node's ZMQ sockets.

Other threads never touch a socket; they queue messages with ``send``, which also wakes the loop
through a pipe so that a queued message leaves at once rather than at the next poll timeout. The
loop sends what is queued, decodes what arrives (a malformed message is counted and dropped, never
fatal), and calls the node's ``on_tick`` every few milliseconds for heartbeats, deadlines and
engine progress.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable

import zmq

from dsa_bridge.transfer import protocol
from dsa_bridge.transfer.protocol import Message, ProtocolError

log = logging.getLogger(__name__)

OnMessage = Callable[[zmq.Socket, bytes, Message], None]


def parse_endpoint(text: str, name: str = "endpoint") -> tuple[str, int]:
    """'HOST:PORT' -> (host, port); port 0 means "any free port" when listening."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{name} must be HOST:PORT with a numeric port, got {text!r}")
    return host.strip("[]"), int(port)


def zmq_address(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class ControlLoop:
    """Runs ``on_message`` for each decoded message and ``on_tick`` periodically, in one thread."""

    def __init__(self, name: str, on_message: OnMessage, on_tick: Callable[[float], None],
                 poll_ms: int = 2):
        self.name = name
        self._on_message = on_message
        self._on_tick = on_tick
        self._poll_ms = poll_ms
        self._outbox: queue.SimpleQueue[tuple[zmq.Socket, bytes | None, bytes]] = queue.SimpleQueue()
        self._sockets: list[zmq.Socket] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.bad_messages = 0
        self.last_error = ""
        self.max_tick_gap_s = 0.0  # the longest interval between two tick starts (reset freely)
        self._wake_lock = threading.Lock()
        self._wake_r = self._wake_w = -1  # the wake-up pipe, open while the loop runs

    def add_socket(self, sock: zmq.Socket) -> None:
        if self._thread is not None:
            raise RuntimeError("add sockets before the loop starts")
        self._sockets.append(sock)

    def send(self, sock: zmq.Socket, message: Message, identity: bytes | None = None) -> None:
        """Queue a message (thread-safe). ``identity`` addresses a peer of a ROUTER socket."""
        self._outbox.put((sock, identity, protocol.encode(message)))
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

    def _receive(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity = frames[0] if sock.type == zmq.ROUTER else b""
            payload = frames[-1]
            try:
                if len(frames) != (2 if sock.type == zmq.ROUTER else 1):
                    raise ProtocolError(f"expected one payload frame, got {len(frames)} frames")
                message = protocol.decode(payload)
                self._on_message(sock, identity, message)
            except ProtocolError as exc:
                self.bad_messages += 1
                self.last_error = str(exc)
                log.warning("%s: dropped a message: %s", self.name, exc)
            except Exception as exc:  # a handler bug must not take the node down
                self.bad_messages += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("%s: handling a message failed", self.name)

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in self._sockets:
            poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        last_tick = time.monotonic()
        while not self._stop.is_set():
            self._flush()
            for sock, _ in poller.poll(self._poll_ms):
                if sock == self._wake_r:
                    self._drain_wakes()
                else:
                    self._receive(sock)
            now = time.monotonic()
            self.max_tick_gap_s, last_tick = max(self.max_tick_gap_s, now - last_tick), now
            try:
                self._on_tick(now)
            except Exception:  # a bug in a tick must not silently stop heartbeats
                log.exception("%s: tick failed", self.name)
        self._flush()
