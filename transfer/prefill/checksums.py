"""The page checksums prefill sends with a chunk: computed from its pool, when they are on.

``ChunkChecksums`` is what the prefill node's writer asks for each chunk before its write (see
``writer.PageSums``): the checksums of the chunk's pages in every buffer it writes
(``checksum.chunk_checksums``), or None while ``enabled`` is off. ``enabled`` may change between
requests. The pool's page views are made when checksums first run; the time and count go to the
node's counters.

On the staged route the checksums are taken over the staging slice as it is gathered, on the
gather thread while the previous slice is written (``of_slice``: the slice's rows are the pages'
bytes), and joined into the chunk's ``PageChecksums`` once every slice is (``packed``).
"""

from __future__ import annotations

import time

import numpy as np
import torch

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

    def check_size(self, pages: int, buffers: int) -> None:
        """ChecksumError, before any write, when a chunk's checksums would not fit a message."""
        if pages > checksum.max_chunk_pages(buffers):
            raise checksum.ChecksumError(
                f"a chunk of {pages} pages x {buffers} buffers needs more checksum bytes than a "
                f"message holds: send chunks of at most {checksum.max_chunk_pages(buffers)} pages")

    def of_slice(self, area: torch.Tensor, offsets: np.ndarray, pages: int) -> np.ndarray:
        """The checksums of a gathered slice, (buffers, pages) uint64: buffer ``i``'s ``pages``
        rows at ``area[offsets[i]:offsets[i + 1]]``."""
        started = time.perf_counter()
        algorithm = checksum.algorithm_for(self.pool.device)
        rows = np.arange(pages)
        values = np.stack([checksum.page_checksums(area[offsets[i]:offsets[i + 1]].view(pages, -1),
                                                   rows, algorithm)
                           for i in range(len(offsets) - 1)])
        self.counters.add(checksums_computed=values.size,
                          checksum_seconds=time.perf_counter() - started)
        return values

    def packed(self, pairs: PairTable, parts: list[np.ndarray],
               offset: int) -> protocol.PageChecksums:
        """A chunk's checksums from its slices' (``of_slice``, in page order), buffer-major."""
        values = np.concatenate(parts, axis=1)
        return protocol.PageChecksums(checksum.algorithm_for(self.pool.device), int(offset),
                                      [(p.src.layer_id, p.src.kind) for p in pairs],
                                      values.astype("<u8").tobytes())
