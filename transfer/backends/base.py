"""The one small interface every transfer engine sits behind, and its errors.

A backend moves bytes from this process's registered memory into a peer's registered memory
(WRITE, push model). It knows nothing of layers, pages or requests: the planner turns those into
flat ``(src_addr, dst_addr, length)`` arrays, and the node checks every address against the
regions both sides announced before calling ``write``.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ...plugin.descriptors import BufferDescriptor


class BackendError(Exception):
    """An engine operation failed: carries the operation, the peer (if any) and the engine code."""

    def __init__(self, backend: str, op: str, detail: str, *, peer: str = "", code: int | None = None):
        self.backend, self.op, self.peer, self.code = backend, op, peer, code
        where = f" peer={peer}" if peer else ""
        rc = f" code={code}" if code is not None else ""
        super().__init__(f"{backend} {op} failed{where}{rc}: {detail}")


class BackendUnavailable(BackendError):
    """The engine cannot be used on this machine (package missing, no usable transport)."""


class TransferTimeout(BackendError):
    """A write did not complete before its deadline; its destination may still be written."""


class TransferBackend(Protocol):
    """What the transfer layer needs of an engine. All methods raise BackendError on failure."""

    name: str

    def register(self, regions: list[BufferDescriptor]) -> None:
        """Register each region once. Zero-length, null or duplicate regions are refused."""

    def metadata(self) -> bytes:
        """What a peer needs to ``connect`` to this engine (session id, agent metadata)."""

    def connect(self, peer_metadata: bytes) -> str:
        """Make a peer known; returns the handle to pass to ``write``."""

    def write(
        self, peer: str, src: np.ndarray, dst: np.ndarray, length: np.ndarray, *, timeout_s: float
    ) -> None:
        """Write ``length[i]`` bytes from local ``src[i]`` to the peer's ``dst[i]``; block until all
        landed or raise. On any failure, the destination ranges may be partly or later written."""

    def disconnect(self, peer: str) -> None:
        """Forget a departed peer and release the engine's connections to it; never blocks on
        the peer. Later writes to it are refused until it is ``connect``-ed again. Unknown peers
        are ignored."""

    def progress(self) -> None:
        """Let a passive engine make progress (NIXL without a progress thread); cheap, non-blocking."""

    def transport(self) -> str:
        """The transport actually in use (e.g. "tcp" even when "rdma" was asked for)."""

    def close(self) -> None:
        """Deregister everything and release the engine. Idempotent."""
