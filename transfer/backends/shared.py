"""One engine shared by the nodes of one process: ``SharedEngine``.

sglang's own managers keep one transfer engine per rank, shared by every peer, with the cache
registered once. A decode rank of dsa-bridge runs a ``DecodeNode`` per prefill it reads from,
and a node owns its backend (registers its regions, closes it). ``SharedEngine.user()`` gives
each node a ``TransferBackend`` over the one engine: its ``register`` counts each region (the
engine registers a region for its first user and deregisters it after its last), its ``close``
releases its own regions; the engine itself closes with ``SharedEngine.close`` once the last
user closed. Everything else goes to the engine as it is.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from ...plugin.descriptors import BufferDescriptor
from .base import BackendError, TransferBackend

log = logging.getLogger(__name__)


class SharedEngine:
    """One engine backend, its regions counted over its users (module docstring)."""

    def __init__(self, engine: TransferBackend):
        self.engine = engine
        self.name = engine.name
        self._lock = threading.Lock()
        self._users: dict[BufferDescriptor, int] = {}  # region -> how many users registered it
        self._open_users = 0
        self._closing = False

    def user(self) -> SharedUser:
        with self._lock:
            if self._closing:
                raise BackendError(self.name, "user", "the shared engine is closed")
            self._open_users += 1
        return SharedUser(self)

    @property
    def registered(self) -> int:
        """Regions the engine holds registered now."""
        with self._lock:
            return len(self._users)

    def register(self, regions: list[BufferDescriptor]) -> None:
        """Count ``regions``; the engine registers those no user had (all or none)."""
        with self._lock:
            new = list(dict.fromkeys(r for r in regions if r not in self._users))
            if new:
                self.engine.register(new)
            for region in regions:
                self._users[region] = self._users.get(region, 0) + 1

    def release(self, regions: list[BufferDescriptor], *, last: bool) -> None:
        """Uncount ``regions`` (a user's, at its close); the engine deregisters those no user
        holds any more; ``last``: the user's close, which may close the engine."""
        with self._lock:
            gone = []
            for region in regions:
                self._users[region] -= 1
                if not self._users[region]:
                    del self._users[region]
                    gone.append(region)
            if gone:
                try:
                    self.engine.unregister(gone)
                except BackendError as exc:  # the user is gone either way: said, not raised
                    log.error("%s: deregistering a closed user's regions: %s", self.name, exc)
            if last:
                self._open_users -= 1
            close = self._closing and not self._open_users
        if close:
            self.engine.close()

    def close(self) -> None:
        """Close the engine now if no user is open, else when the last one closes."""
        with self._lock:
            self._closing = True
            close = not self._open_users
        if close:
            self.engine.close()


class SharedUser:
    """One node's ``TransferBackend`` over a ``SharedEngine``."""

    def __init__(self, shared: SharedEngine):
        self._shared = shared
        self._engine = shared.engine
        self.name = shared.name
        self.tick_ms = shared.engine.tick_ms
        self.needs_progress = shared.engine.needs_progress
        self._regions: list[BufferDescriptor] = []
        self._closed = False

    def register(self, regions: list[BufferDescriptor]) -> None:
        if self._closed:
            raise BackendError(self.name, "register", "backend is closed")
        self._shared.register(regions)
        self._regions.extend(regions)

    def unregister(self, regions: list[BufferDescriptor]) -> None:
        missing = [r for r in regions if r not in self._regions]
        if missing:
            raise BackendError(self.name, "unregister", f"{missing[0]}: not registered")
        for region in regions:
            self._regions.remove(region)
        self._shared.release(regions, last=False)

    def metadata(self) -> bytes:
        return self._engine.metadata()

    def connect(self, peer_metadata: bytes) -> str:
        return self._engine.connect(peer_metadata)

    def write(self, peer: str, src: np.ndarray, dst: np.ndarray, length: np.ndarray, *,
              timeout_s: float) -> None:
        self._engine.write(peer, src, dst, length, timeout_s=timeout_s)

    def disconnect(self, peer: str) -> None:
        self._engine.disconnect(peer)

    def progress(self) -> None:
        self._engine.progress()

    def transport(self) -> str:
        return self._engine.transport()

    def close(self) -> None:
        """Release this user's regions; the engine closes with its last user (idempotent)."""
        if self._closed:
            return
        self._closed = True
        regions, self._regions = self._regions, []
        self._shared.release(regions, last=True)
