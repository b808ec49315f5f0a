"""A passive peer in its own OS process: one backend, one registered torch buffer, a command pipe.

The parent talks to it over a multiprocessing Pipe only (NIXL and UCX print to stdout, so stdout
is never a channel). The child announces ``(metadata, buffer address, size)``, then serves — it
calls ``progress()`` every ~2 ms — until told to stop or until its lifetime runs out.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from .. import forkserver

SENTINEL = 0xA5
REPLY_TIMEOUT_S = 90.0  # a start imports an engine: 30 s was too short at load 25


def serve(
    conn: Connection, backend: str, nbytes: int, lifetime_s: float, env: dict[str, str], host: str
) -> None:
    """The child's main: everything it does is bounded by ``lifetime_s``; ``env`` is its whole
    environment (a forked child starts with the fork server's)."""
    os.environ.clear()
    os.environ.update(env)
    import torch

    from dsa_bridge.plugin.descriptors import raw_region
    from dsa_bridge.transfer.backends import create_backend

    try:
        engine = create_backend(backend, host=host)
        buf = torch.full((nbytes,), SENTINEL, dtype=torch.uint8)
        engine.register([raw_region(buf.data_ptr(), nbytes, "cpu")])
    except Exception as exc:
        conn.send(("error", repr(exc), 0, 0))
        return
    conn.send(("ready", engine.metadata(), buf.data_ptr(), nbytes))
    view = buf.numpy()
    end = time.monotonic() + lifetime_s
    while time.monotonic() < end:
        if not conn.poll(0.002):
            engine.progress()
            continue
        command, *args = conn.recv()
        if command == "stop":
            break
        if command == "fill":
            buf.fill_(args[0])
            conn.send("ok")
        elif command == "digest":
            conn.send(hashlib.sha256(view.tobytes()).hexdigest())
        elif command == "read":
            offset, size = args
            conn.send(view[offset : offset + size].tobytes())
        else:
            conn.send(f"unknown command {command!r}")
    engine.close()
    engine.close()  # idempotent
    conn.send("closed")


@dataclass
class Peer:
    """The parent's handle on a peer process."""

    process: multiprocessing.process.BaseProcess
    conn: Connection
    metadata: bytes
    addr: int
    nbytes: int

    def ask(self, *command: object) -> object:
        self.conn.send(command)
        if not self.conn.poll(REPLY_TIMEOUT_S):
            raise TimeoutError(f"peer {self.process.pid} did not answer {command[0]!r}")
        return self.conn.recv()

    def signal(self, signum: int) -> None:
        try:
            os.kill(self.process.pid, signum)
        except ProcessLookupError:
            pass  # already gone

    def freeze(self, timeout_s: float = 5.0) -> None:
        """SIGSTOP it and wait, bounded, until every one of its threads is stopped: ``kill``
        returns once the signal is queued, before the engine's threads have all stopped."""
        self.signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while not self.threads_stopped():
            if time.monotonic() > deadline:
                raise TimeoutError(f"peer {self.process.pid} not stopped after {timeout_s} s")
            time.sleep(0.005)

    def threads_stopped(self) -> bool:
        """True when every thread of the process is in state T (stopped) or t (traced)."""
        states = []
        try:
            for task in os.listdir(f"/proc/{self.process.pid}/task"):
                with open(f"/proc/{self.process.pid}/task/{task}/stat") as stat:
                    states.append(stat.read().rsplit(")", 1)[1].split()[0])
        except OSError:
            return False
        return bool(states) and all(state in "Tt" for state in states)

    def stop(self) -> int | None:
        """Ask it to stop; kill it by PID if it does not within a few seconds. Returns exit code."""
        if self.process.is_alive():
            self.signal(signal.SIGCONT)
            try:
                self.conn.send(("stop",))
            except OSError:
                pass
            self.process.join(10)
        if self.process.is_alive():
            self.signal(signal.SIGKILL)
            self.process.join(5)
        self.conn.close()
        return self.process.exitcode


def start_peer(
    backend: str,
    nbytes: int,
    *,
    lifetime_s: float = 120.0,
    env: dict[str, str] | None = None,
    host: str = "127.0.0.1",
) -> Peer:
    """Start a peer, forked from the fork server (``tests/forkserver.py``: torch imported once;
    ``env`` added to its environment, its engine started for ``host``); wait, bounded, for it to
    announce itself."""
    context = forkserver.context()
    parent, child = context.Pipe()
    process = context.Process(
        target=serve,
        args=(child, backend, nbytes, lifetime_s, {**os.environ, **(env or {})}, host),
        name=f"peer-{backend}",
        daemon=True,
    )
    process.start()
    child.close()
    if not parent.poll(REPLY_TIMEOUT_S):
        os.kill(process.pid, signal.SIGKILL)
        process.join(5)
        raise TimeoutError(f"{backend} peer {process.pid} did not start")
    try:
        status, metadata, addr, size = parent.recv()
    except EOFError:
        status, metadata = "error", "it exited"
    if status != "ready":
        process.join(5)
        raise RuntimeError(f"{backend} peer {process.pid} failed to start: {metadata}")
    return Peer(process, parent, metadata, addr, size)
