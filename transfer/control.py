"""The control-plane loop: one thread owns a node's ZMQ sockets.

Other threads never touch a socket; they queue messages with ``send``. The loop sends what is
queued, decodes what arrives (a malformed message is counted and dropped, never fatal), and
calls the node's ``on_tick`` every few milliseconds for heartbeats, deadlines and engine progress.
"""

from __future__ import annotations

import logging
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

    def add_socket(self, sock: zmq.Socket) -> None:
        if self._thread is not None:
            raise RuntimeError("add sockets before the loop starts")
        self._sockets.append(sock)

    def send(self, sock: zmq.Socket, message: Message, identity: bytes | None = None) -> None:
        """Queue a message (thread-safe). ``identity`` addresses a peer of a ROUTER socket."""
        self._outbox.put((sock, identity, protocol.encode(message)))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-control", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

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
        while not self._stop.is_set():
            self._flush()
            for sock, _ in poller.poll(self._poll_ms):
                self._receive(sock)
            try:
                self._on_tick(time.monotonic())
            except Exception:  # a bug in a tick must not silently stop heartbeats
                log.exception("%s: tick failed", self.name)
        self._flush()
