"""An in-process engine for unit tests of the node logic: memmove between registered regions.

It refuses writes outside the peer's registered regions (as both real engines do) and can fail
every Nth write, so tests can drive the failure paths. Real engines are tested in tests/backends
and in the two-process integration tests."""

from __future__ import annotations

import ctypes
import itertools
import threading

import numpy as np

from dsa_bridge.plugin.descriptors import BufferDescriptor
from dsa_bridge.transfer.backends.base import BackendError

_engines: dict[str, FakeBackend] = {}
_ids = itertools.count()


class FakeBackend:
    name = "mooncake"  # handshakes compare backend names; the fake poses as the default
    tick_ms = 2
    needs_progress = True  # ticks at 2 ms as NIXL's, so the fast logic tests stay fast

    def __init__(self, *, fail_every: int = 0):
        self.id = f"fake-{next(_ids)}"
        self.regions: list[BufferDescriptor] = []
        self.fail_every = fail_every
        self.writes = 0
        self.disconnected: list[str] = []
        self.closed = False
        self._lock = threading.Lock()
        _engines[self.id] = self

    def register(self, regions):
        self.regions.extend(regions)

    def unregister(self, regions):
        for region in regions:
            self.regions.remove(region)

    def metadata(self) -> bytes:
        return self.id.encode()

    def connect(self, peer_metadata: bytes) -> str:
        peer = peer_metadata.decode(errors="replace")
        if peer not in _engines:
            raise BackendError(self.name, "connect", "unknown peer", peer=peer)
        return peer

    def write(self, peer, src, dst, length, *, timeout_s):
        with self._lock:
            self.writes += 1
            if self.fail_every and self.writes % self.fail_every == 0:
                raise BackendError(self.name, "write", "injected failure", peer=peer, code=-1)
        target = _engines[peer]
        for s, d, n in zip(src.tolist(), dst.tolist(), np.asarray(length).tolist(), strict=True):
            if not any(r.ptr <= d and d + n <= r.ptr + r.nbytes for r in target.regions):
                raise BackendError(self.name, "write", "outside registered memory", peer=peer)
            ctypes.memmove(d, s, n)

    def disconnect(self, peer: str) -> None:
        self.disconnected.append(peer)

    def progress(self) -> None:
        pass

    def transport(self) -> str:
        return "memmove"

    def close(self) -> None:
        self.closed = True
        _engines.pop(self.id, None)
