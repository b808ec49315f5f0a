"""Request states (SGLang's KVPoll), the forward-only state holder both sides share, and the
base of both sides' request handles.

``RequestState`` is pure: no locks, no clocks. The caller passes ``now`` (``time.monotonic()``)
into every transition and question, and the node that owns the state guards it with its lock.
``RequestHandle`` is what prefill's ``KVSender`` and decode's ``KVReceiver`` share: the room, its
state, ``poll`` and ``failure_exception``; each side says how it aborts and when its pages may go
back to the allocator.
"""

from __future__ import annotations

import abc
import enum
import time


class KVPoll(enum.IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


TERMINAL = (KVPoll.Failed, KVPoll.Success)


class TransferFailed(RuntimeError):
    """Why a request ended Failed."""


class RequestState:
    """A request's status: moves only forward, except to Failed; terminal states never change.

    ``release_at`` is when the request's pages may go back to the allocator: never before every
    write into them has finished or can no longer land (invariant 8). None: not yet known."""

    def __init__(self, room: int, deadline_s: float, now: float):
        self.room = room
        self.created = now
        self.deadline = now + deadline_s
        self._status = KVPoll.Bootstrapping
        self._reason = ""
        self.release_at: float | None = None
        self.transferring_at: float | None = None
        self.finished_at: float | None = None

    @property
    def status(self) -> KVPoll:
        return self._status

    @property
    def reason(self) -> str:
        return self._reason

    def advance(self, status: KVPoll, now: float) -> bool:
        """Move forward to ``status``; returns False (and changes nothing) otherwise."""
        if self._status in TERMINAL or status <= self._status or status == KVPoll.Failed:
            return False
        if status == KVPoll.Transferring:
            self.transferring_at = now
        if status == KVPoll.Success:
            self.release_at = self.finished_at = now
        self._status = status
        return True

    def fail(self, reason: str, now: float, *, release_after_s: float | None = 0.0) -> bool:
        """Fail unless already terminal. ``release_after_s=None`` keeps the pages held until
        ``allow_release`` is called (a write into them may still be in flight)."""
        if self._status in TERMINAL:
            return False
        self._reason = reason  # before the status: a reader that sees Failed sees the reason
        self.finished_at = now
        if release_after_s is not None:
            self.release_at = now + release_after_s
        self._status = KVPoll.Failed
        return True

    def allow_release(self, at: float) -> None:
        """Let a terminal request's pages go back to the allocator at ``at`` (or earlier, if
        already allowed earlier)."""
        if self._status in TERMINAL and (self.release_at is None or at < self.release_at):
            self.release_at = at

    def can_release(self, now: float) -> bool:
        return self.release_at is not None and now >= self.release_at

    def failure_exception(self) -> TransferFailed | None:
        if self._status != KVPoll.Failed:
            return None
        return TransferFailed(f"room {self.room}: {self._reason}")


class RequestHandle(abc.ABC):
    """One request on one side, as SGLang's sender and receiver are polled and aborted."""

    def __init__(self, room: int, timeout_s: float):
        self.room = room
        self.state = RequestState(room, timeout_s, time.monotonic())

    def poll(self) -> KVPoll:
        return self.state.status

    def failure_exception(self) -> TransferFailed | None:
        return self.state.failure_exception()

    @abc.abstractmethod
    def abort(self, reason: str) -> None:
        """Fail the request (no-op once terminal) and tell the other side."""

    @abc.abstractmethod
    def can_release(self) -> bool:
        """True once the request's pages may go back to the allocator (invariant 8)."""
