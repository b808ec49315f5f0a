"""A page allocator for the demo and tests that hands out realistic, fragmented page ids.

The free list starts as the pool's pages (page 0, the padding page, excluded) shuffled in blocks
of a few consecutive pages, so requests get a mix of contiguous runs and jumps, as a serving
engine's allocator does after a while.
"""

from __future__ import annotations

import numpy as np


class PageAllocator:
    def __init__(self, num_pages: int, *, seed: int = 0, max_block: int = 16):
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is padding), got {num_pages}")
        rng = np.random.default_rng(seed)
        pages = np.arange(1, num_pages, dtype=np.int64)
        cuts = np.cumsum(rng.integers(1, max_block + 1, size=num_pages))
        blocks = np.split(pages, cuts[cuts < pages.size])
        order = rng.permutation(len(blocks))
        self._free = [int(p) for i in order for p in blocks[i]]
        self.capacity = num_pages - 1

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def free_list(self) -> np.ndarray:
        return np.array(self._free, dtype=np.int64)

    def alloc(self, count: int) -> np.ndarray | None:
        """``count`` page ids, or None when fewer are free."""
        if count <= 0:
            raise ValueError(f"count must be positive, got {count}")
        if count > len(self._free):
            return None
        taken, self._free = self._free[:count], self._free[count:]
        return np.array(taken, dtype=np.int64)

    def free(self, pages: np.ndarray) -> None:
        self._free.extend(int(p) for p in pages)
