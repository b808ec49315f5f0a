"""A daemon thread that handles queued jobs one at a time, in order, until it is closed: the
decode node's checksum verifier (``verify.py``) and its scatter of staged slices
(``scatter.py``)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class JobThread:
    """Runs ``handle(job)`` for each ``put`` job, in order, on a thread of its own."""

    def __init__(self, name: str, handle: Callable[[object], None]):
        self._handle = handle
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, job: object) -> None:
        self._jobs.put(job)

    def close(self, timeout_s: float = 10.0) -> None:
        """Let the jobs queued so far run, then end the thread (waiting at most ``timeout_s``)."""
        self._jobs.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._handle(job)
