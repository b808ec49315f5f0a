"""The decode node's checksum verifier: a thread that checks each chunk's pages off the control
thread (which also runs heartbeats: a control loop blocked on hashing makes peers declare each
other dead).

The control thread queues every counted chunk of a checksummed request, with decode's page ids
the chunk's checksums index (``KVReceiver.chunk_pages``); the verifier takes them in arrival
order, computes the checksums of those pages in this node's pool (``checksum.verify_chunk``) and
hands the outcome forward to the chunk's request (``KVReceiver.chunk_verified``), which fails
itself or, after its last chunk, turns Success: it reads nothing else of the request but whether
it ended. A request stays Transferring meanwhile; one that failed meanwhile is skipped.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import numpy as np

from .. import checksum, protocol
from ..request import TERMINAL, RequestState
from .job_thread import JobThread

log = logging.getLogger(__name__)


class VerifiedRequest(Protocol):
    """A request whose chunks are verified (``receiver.KVReceiver``)."""

    room: int
    state: RequestState

    def chunk_verified(self, done: protocol.ChunkDone, peer, problem: str, verified: int,
                       seconds: float) -> None:
        """The outcome for one chunk of ``peer``: problem or "", (buffer, page) checksums
        verified, seconds; called on the verifier's thread."""


class ChunkVerifier:
    """Verifies queued chunks in order, on its own thread, until ``close``."""

    def __init__(self, pool, name: str, kv_on_index_pages: frozenset[int] = frozenset()):
        self._pool = pool
        self._kv_on_index_pages = kv_on_index_pages  # KV layers at a request's indexer pages
        self._views: dict | None = None  # made on first use: a node without checksums needs none
        self._thread = JobThread(f"{name}-verifier", self._verify)

    def submit(self, request: VerifiedRequest, done: protocol.ChunkDone, peer, pages: np.ndarray,
               index_pages: np.ndarray | None) -> None:
        """Queue a chunk ``peer`` reported for ``request``, whose checksums index decode's
        ``pages`` of the KV and ``index_pages`` of the indexer (None: ``pages``)."""
        self._thread.put((request, done, peer, pages, index_pages))

    def close(self, timeout_s: float = 10.0) -> None:
        self._thread.close(timeout_s)

    def _verify(self, job: tuple) -> None:
        request, done, peer, pages, index_pages = job
        if request.state.status in TERMINAL:  # failed meanwhile: nothing left to prove
            return
        started = time.perf_counter()
        problem, verified = "", 0
        try:
            if self._views is None:
                self._views = checksum.pool_views(self._pool)
            if pages.size:  # (a share writer's last chunk, or a request of no page, is empty)
                verified = checksum.verify_chunk(self._views, pages, done.checksums,
                                                 index_pages=index_pages,
                                                 kv_on_index_pages=self._kv_on_index_pages)
        except checksum.ChecksumError as exc:
            problem = str(exc)
        except Exception as exc:  # a bug must fail the request, not stop the verifier
            log.exception("room %d: verifying checksums failed", request.room)
            problem = f"internal error verifying checksums: {type(exc).__name__}: {exc}"
        request.chunk_verified(done, peer, problem, verified, time.perf_counter() - started)
