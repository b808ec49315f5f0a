"""The page checksums prefill sends with a chunk: computed from its pool, when they are on.

``ChunkChecksums`` is what the prefill node's writer asks for each chunk before its write (see
``writer.PageSums``): the checksums of the chunk's pages in every buffer it writes
(``checksum.chunk_checksums``), or None while ``enabled`` is off. ``enabled`` may change between
requests. The pool's page views are made when checksums first run; the time and count go to the
node's counters.
"""

from __future__ import annotations

import time

import numpy as np

from .. import checksum, protocol
from ..counters import Counters
from ..plan import PairTable


class ChunkChecksums:
    """A chunk's page checksums from ``pool`` (None while ``enabled`` is off)."""

    def __init__(self, pool, counters: Counters, *, enabled: bool):
        self.pool = pool
        self.counters = counters
        self.enabled = enabled
        self._views: dict | None = None  # the pool's page views, made when checksums first run

    def of_chunk(self, pairs: PairTable, pages: np.ndarray,
                 offset: int) -> protocol.PageChecksums | None:
        """The checksums of ``pages`` (the chunk's first is page ``offset`` of its request) in
        the source buffer of every pair; raises ChecksumError when they do not fit a message."""
        if not self.enabled:
            return None
        started = time.perf_counter()
        if self._views is None:
            self._views = checksum.pool_views(self.pool)
        sums = checksum.chunk_checksums(self._views, [(p.src.layer_id, p.src.kind) for p in pairs],
                                        pages, offset, checksum.algorithm_for(self.pool.device))
        self.counters.add(checksums_computed=pages.size * len(pairs),
                          checksum_seconds=time.perf_counter() - started)
        return sums
