"""Peer liveness, pure (time passed in): the heartbeat schedule, when a peer counts as silent, and
when a silent peer's process is proven gone.

``Liveness`` is what both nodes use: heartbeats are due at once, then once per ``heartbeat_s``; a
peer not heard from for longer than ``peer_timeout_s`` is silent. ``tick_ms`` says how often a
node ticks whose tick is only this schedule and its deadlines (decode over an engine with threads
of its own): each wake-up of a control thread costs about 0.1 ms of CPU on our machines, so at
Mooncake's 10 ms an idle decode spent 15 ms of CPU a second doing nothing.

``ControlLink`` is decode's view of one control connection to a prefill node, fed with the events
of the connection's monitor. A silent process is not a gone one (a frozen process resumes), but a
live process, even a frozen one, accepts connections: a connection that closed and whose every
reconnect was refused for ``DEAD_PEER_GRACE_S`` proves the process gone. ZMQ retries every
``RECONNECT_IVL_MS``; the grace also covers bytes already queued in decode's own engine.
"""

from __future__ import annotations

from dataclasses import dataclass

DEAD_PEER_GRACE_S = 1.0
RECONNECT_IVL_MS = 100
TICKS_PER_HEARTBEAT = 5  # a paced node's ticks per heartbeat interval...
SLOW_TICK_MS = 50  # ...and at least this often: how late its deadlines and re-handshakes may run


@dataclass
class Liveness:
    """A node's heartbeat schedule and its rule for a silent peer."""

    heartbeat_s: float
    peer_timeout_s: float
    next_heartbeat: float = 0.0

    def heartbeat_due(self, now: float) -> bool:
        """True when heartbeats are due at ``now`` (at the first call, then once per
        ``heartbeat_s``); a True schedules the next ones ``heartbeat_s`` after ``now``."""
        if now < self.next_heartbeat:
            return False
        self.next_heartbeat = now + self.heartbeat_s
        return True

    def tick_ms(self, engine_tick_ms: int, *, needs_progress: bool) -> int:
        """How often a node ticks whose tick is only its heartbeats and deadlines: its engine's
        tick where the engine needs ``progress`` from it (NIXL); otherwise ``TICKS_PER_HEARTBEAT``
        ticks a heartbeat interval, at least one every ``SLOW_TICK_MS``, never more often than
        the engine's."""
        if needs_progress:
            return engine_tick_ms
        paced = int(self.heartbeat_s * 1e3 / TICKS_PER_HEARTBEAT)
        return max(engine_tick_ms, min(SLOW_TICK_MS, paced))

    def silent(self, last_seen: float, now: float) -> bool:
        """True when a peer last heard from at ``last_seen`` has been silent for longer than
        ``peer_timeout_s`` at ``now``."""
        return now - last_seen > self.peer_timeout_s


@dataclass
class ControlLink:
    """One control connection: down since when, and whether its peer's process is proven gone."""

    down_since: float | None = None  # closed, and not connected again since
    proven_gone: bool = False  # the peer's old process can write no more (until it comes back)

    @property
    def up(self) -> bool:
        return self.down_since is None

    def disconnected(self, now: float) -> None:
        if self.down_since is None:
            self.down_since = now

    def connected(self) -> None:
        self.down_since = None

    def proves_gone(self, now: float) -> bool:
        """True once, when the link has been down for ``DEAD_PEER_GRACE_S`` at ``now``: the
        process behind it is gone. Ask only about a peer that went silent."""
        if self.proven_gone or self.down_since is None or now - self.down_since < DEAD_PEER_GRACE_S:
            return False
        self.proven_gone = True
        return True

    def reset(self) -> None:
        """The peer answered a new handshake: a process listens again, connected."""
        self.down_since = None
        self.proven_gone = False
