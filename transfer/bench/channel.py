"""The command channel between ``dsa-bridge bench`` and a process it drives (ZMQ PAIR, msgpack).

- ``serve_commands``: the driven process's loop. It says it started, answers each command with
  its handler's reply (or the handler's error), and ends on ``quit``, once its parent is gone,
  or after ``idle_exit_s`` without a command.
- ``Driven``: the bench's side. It starts the process (``python -m MODULE --control ...``)
  without waiting for it (its first ``reply`` is that it started), sends a command (``submit``)
  and takes its answer later (``reply``) or at once (``call``), so that several processes can
  work at once; ``stop`` ends the process by PID, whatever happened.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable

import msgspec
import zmq


def serve_commands(control: str, handlers: dict[str, Callable[..., dict]], *,
                   idle_exit_s: float | None = None) -> int:
    """Answer the commands from ``control`` with ``handlers[op](**fields)``; 0 after ``quit``,
    1 when the parent is gone or the process was idle ``idle_exit_s``."""
    parent = os.getppid()
    context = zmq.Context()
    sock = context.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(control)
    try:
        sock.send(msgspec.msgpack.encode({"ok": True, "pid": os.getpid()}))
        idle_since = time.monotonic()
        while True:
            if not sock.poll(1000):
                idle = idle_exit_s is not None and time.monotonic() - idle_since > idle_exit_s
                if os.getppid() != parent or idle:
                    return 1
                continue
            command = msgspec.msgpack.decode(sock.recv())
            op = command.pop("op", "")
            if op == "quit":
                sock.send(msgspec.msgpack.encode({"ok": True}))
                return 0
            try:
                if op not in handlers:
                    raise ValueError(f"unknown command {op!r}")
                reply = {"ok": True, **handlers[op](**command)}
            except Exception as exc:  # reported to the bench process, which raises it
                traceback.print_exc()
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            sock.send(msgspec.msgpack.encode(reply))
            idle_since = time.monotonic()
    finally:
        sock.close(0)
        context.term()


class Driven:
    """A process the bench drives (module docstring): ``name`` in its errors, ``args`` after
    ``python -m module``, ``env`` its environment."""

    def __init__(self, name: str, module: str, args: list[str], *, env: dict | None = None,
                 start_timeout_s: float, command_timeout_s: float) -> None:
        self.name = name
        self.command_timeout_s = command_timeout_s
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PAIR)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDTIMEO, int(command_timeout_s * 1000))
        try:
            port = self._socket.bind_to_random_port("tcp://127.0.0.1")
            self.process = subprocess.Popen(
                [sys.executable, "-m", module, "--control", f"tcp://127.0.0.1:{port}", *args],
                env=env, stdout=sys.stderr, stdin=subprocess.DEVNULL)
        except BaseException:  # a context left with an open socket hangs when collected
            self._socket.close(0)
            self._context.term()
            raise
        self.start_timeout_s = start_timeout_s
        self._pending: str | None = "start"  # its first answer: it started

    def submit(self, op: str, **fields: object) -> None:
        """Send ``op``; its answer is taken by ``reply`` (a command still unanswered first)."""
        if self._pending is not None:
            self.reply()
        try:
            self._socket.send(msgspec.msgpack.encode({"op": op, **fields}))
        except zmq.Again:
            raise RuntimeError(f"bench {self.name} did not take the {op} command") from None
        self._pending = op

    def reply(self) -> dict:
        """The answer to the command sent last (at first: that it started)."""
        op, self._pending = self._pending, None
        return self._receive(op, self.start_timeout_s if op == "start" else self.command_timeout_s)

    def call(self, op: str, **fields: object) -> dict:
        self.submit(op, **fields)
        return self.reply()

    def _receive(self, op: str, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while not self._socket.poll(100):
            if self.process.poll() is not None:
                raise RuntimeError(f"bench {self.name} exited with code "
                                   f"{self.process.returncode} during {op}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"bench {self.name} did not answer {op} in {timeout_s:.0f} s")
        reply = msgspec.msgpack.decode(self._socket.recv())
        if not reply["ok"]:
            raise RuntimeError(f"bench {self.name}: {op} failed: {reply['error']}")
        return reply

    def stop(self) -> None:
        """Ask it to quit; terminate, then kill it by PID if it does not."""
        try:
            if self.process.poll() is None:
                try:
                    self._socket.send(msgspec.msgpack.encode({"op": "quit"}), zmq.NOBLOCK)
                    self.process.wait(20)
                except (zmq.ZMQError, subprocess.TimeoutExpired):
                    self.process.terminate()
                    try:
                        self.process.wait(10)
                    except subprocess.TimeoutExpired:
                        self.process.kill()
                        self.process.wait(10)
        finally:
            self._socket.close(0)
            self._context.term()
