"""The order a prefill node's messages keep behind the staged slices queued before them.

A prefill node reports a staged chunk (``ChunkDone``) after the slices that carry it
(``SliceWritten``); decode's scatter thread copies those slices into the request's pages while the
control thread goes on receiving. A report must count, and its checksums be verified, over the
pages as the scatter left them, and a re-handshake's answer (``HelloAck``) must not lift a
quarantine while a slice of the old session is still being scattered. ``BehindSlices`` holds such
a message until every slice queued before it is through (scattered, or dropped with its request),
and every message held before it has been released: the order of arrival, kept.

Pure: no threads, no clock. The decode node's lock is held by every caller: the control thread
queues slices and holds and releases messages; the scatter thread says when a slice is through.
"""

from __future__ import annotations

from collections import deque


class BehindSlices:
    """Slices queued and through, and the messages held behind them (module docstring)."""

    def __init__(self) -> None:
        self._queued = 0  # slices queued to the scatter thread so far
        self._through = 0  # ...and through it
        self._held: deque[tuple[int, object]] = deque()  # (slices queued before it, message)

    @property
    def held(self) -> int:
        """Messages held now."""
        return len(self._held)

    def slice_queued(self) -> None:
        self._queued += 1

    def slice_through(self) -> None:
        if self._through >= self._queued:
            raise RuntimeError("a slice went through that was never queued")
        self._through += 1

    def hold(self, message: object) -> bool:
        """True when ``message`` must wait (and is held): a slice queued before it is not through,
        or a message that arrived before it is still held. False: handle it now."""
        if not self._held and self._through == self._queued:
            return False
        self._held.append((self._queued, message))
        return True

    def release(self) -> list[object]:
        """The held messages whose slices are all through, in the order they arrived (no longer
        held)."""
        released = []
        while self._held and self._held[0][0] <= self._through:
            released.append(self._held.popleft()[1])
        return released
