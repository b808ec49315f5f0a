"""Request states (SGLang's KVPoll) and the forward-only state holder both sides share."""

from __future__ import annotations

import enum
import threading
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
    write into them has finished or can no longer land (invariant 8)."""

    def __init__(self, room: int, deadline_s: float):
        self.room = room
        self.created = time.monotonic()
        self.deadline = self.created + deadline_s
        self._status = KVPoll.Bootstrapping
        self._reason = ""
        self._release_at: float | None = None
        self.transferring_at: float | None = None
        self.finished_at: float | None = None
        self._lock = threading.Lock()

    @property
    def status(self) -> KVPoll:
        return self._status

    @property
    def reason(self) -> str:
        return self._reason

    def advance(self, status: KVPoll) -> bool:
        """Move forward to ``status``; returns False (and changes nothing) otherwise."""
        with self._lock:
            if self._status in TERMINAL or status <= self._status or status == KVPoll.Failed:
                return False
            self._status = status
            if status == KVPoll.Transferring:
                self.transferring_at = time.monotonic()
            if status == KVPoll.Success:
                self._release_at = self.finished_at = time.monotonic()
            return True

    def fail(self, reason: str, *, release_after_s: float | None = 0.0) -> bool:
        """Fail unless already terminal. ``release_after_s=None`` keeps the pages held until
        ``allow_release`` is called (a write into them may still be in flight)."""
        with self._lock:
            if self._status in TERMINAL:
                return False
            self._status = KVPoll.Failed
            self._reason = reason
            self.finished_at = time.monotonic()
            if release_after_s is not None:
                self._release_at = time.monotonic() + release_after_s
            return True

    def allow_release(self, after_s: float = 0.0) -> None:
        with self._lock:
            at = time.monotonic() + after_s
            if self._status in TERMINAL and (self._release_at is None or at < self._release_at):
                self._release_at = at

    def can_release(self) -> bool:
        with self._lock:
            return self._release_at is not None and time.monotonic() >= self._release_at

    def failure_exception(self) -> TransferFailed | None:
        if self._status != KVPoll.Failed:
            return None
        return TransferFailed(f"room {self.room}: {self._reason}")
