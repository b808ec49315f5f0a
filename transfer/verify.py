"""The decode node's checksum verifier: a thread that checks each chunk's pages off the control
thread (which also runs heartbeats: a control loop blocked on hashing makes peers declare each
other dead).

The control thread queues every ok chunk of a checksummed request; the verifier takes them in
arrival order, computes the checksums of the pages the chunk wrote into this node's pool
(``checksum.verify_chunk``) and hands the outcome back to the node, which fails the request or,
after its last chunk, lets it turn Success. A request stays Transferring meanwhile.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from . import checksum, protocol
from .request import TERMINAL

log = logging.getLogger(__name__)

# (receiver, the chunk's report, the prefill peer it came from, problem or "", (buffer, page)
# checksums verified, seconds)
OnVerified = Callable[[object, protocol.ChunkDone, object, str, int, float], None]


class ChunkVerifier:
    """Verifies queued chunks in order, on its own thread, until ``close``."""

    def __init__(self, pool, name: str, on_verified: OnVerified):
        self._pool = pool
        self._views: dict | None = None  # made on first use: a node without checksums needs none
        self._on_verified = on_verified
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"{name}-verifier", daemon=True)
        self._thread.start()

    def submit(self, receiver, done: protocol.ChunkDone, peer) -> None:
        self._jobs.put((receiver, done, peer))

    def close(self, timeout_s: float = 10.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            receiver, done, peer = job
            if receiver.state.status in TERMINAL:  # failed meanwhile: nothing left to prove
                continue
            started = time.perf_counter()
            problem, verified = "", 0
            try:
                if self._views is None:
                    self._views = checksum.pool_views(self._pool)
                verified = checksum.verify_chunk(self._views, receiver.page_ids, done.checksums)
            except checksum.ChecksumError as exc:
                problem = str(exc)
            except Exception as exc:  # a bug must fail the request, not stop the verifier
                log.exception("room %d: verifying checksums failed", receiver.room)
                problem = f"internal error verifying checksums: {type(exc).__name__}: {exc}"
            self._on_verified(receiver, done, peer, problem, verified, time.perf_counter() - started)
