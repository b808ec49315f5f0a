"""Pure planning of the staged route: staging sizes, which route a chunk takes, how its pages fill
the slices of a staging area, and the ring of those slices.

On the **direct** route a chunk is one engine descriptor per (run of pages, buffer). On the
**staged** route prefill gathers the chunk's pages of every buffer it writes into a slice of its
registered staging area, writes that slice into a slice of decode's registered staging area (one
descriptor), and decode scatters it into its pages, then tells prefill the slice is free again.

- ``staging_size``: the bytes and slice size of a node's staging area from what was asked and the
  pool's size (at most ``DEFAULT_STAGING_BYTES``, and no more than the pool itself);
- ``check_route``: a node's route (``auto`` weighs each chunk's routes by what they have cost:
  ``route_costs.RouteCosts``);
- ``slice_groups``: a chunk's pages cut into groups that each fill at most one slice;
  ``slice_offsets``: where each buffer's pages lie in a slice (buffer-major, pages in the chunk's
  order: both sides compute the same from the pair order and item lengths);
- ``SliceRing``: the slices of one staging area, free, in use, or fenced until a time (a failed
  write may still land in a fenced slice; time passed in).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MIB = 1 << 20
DEFAULT_STAGING_BYTES = 256 * MIB
DEFAULT_SLICE_BYTES = 32 * MIB
MIN_SLICES = 2  # one being scattered while the next is written
ROUTES = ("auto", "direct", "staged")
DIRECT, STAGED = "direct", "staged"


class StagingError(ValueError):
    """A staging configuration that cannot work, naming the option to change."""


def staging_size(requested: int | None, pool_bytes: int, slice_bytes: int | None = None,
                 parts: int = 1) -> tuple[int, int]:
    """(staging bytes, slice bytes): ``requested`` (None: ``DEFAULT_STAGING_BYTES`` or the pool's
    size if smaller; 0: no staging) cut into slices of ``slice_bytes`` (default
    ``DEFAULT_SLICE_BYTES``, or smaller), at least ``MIN_SLICES`` for each of ``parts`` shares
    (``split_area``); the total is a whole number of slices."""
    if requested is None:
        requested = min(DEFAULT_STAGING_BYTES, pool_bytes)
    if requested < 0:
        raise StagingError(f"staging_bytes must be >= 0, got {requested}")
    if requested == 0:
        return 0, 0
    least = MIN_SLICES * parts
    size = slice_bytes or min(DEFAULT_SLICE_BYTES, requested // least)
    if size <= 0 or requested // size < least:
        raise StagingError(f"staging_bytes {requested} holds fewer than {least} slices of "
                           f"{size} bytes: raise staging_bytes or lower slice_bytes")
    return requested // size * size, size


def check_area(ptr: int, slice_bytes: int, slices: int,
               announced: Sequence[tuple[int, int]]) -> None:
    """A peer's staging area: non-null, not wrapping around, and clear of every (ptr, nbytes)
    region it ``announced`` (a write into a slice must never land in a pool or aux buffer)."""
    if ptr <= 0 or slice_bytes <= 0 or slices <= 0:
        raise StagingError(f"staging area at {ptr:#x} of {slices} slices of {slice_bytes} bytes "
                           "is empty or null")
    end = ptr + slice_bytes * slices
    if end > 2**64:
        raise StagingError(f"staging area at {ptr:#x} wraps around")
    for start, nbytes in announced:
        if start < end and ptr < start + nbytes:
            raise StagingError(f"staging area at {ptr:#x} overlaps the buffer at {start:#x}")


def split_area(nbytes: int, slice_bytes: int, parts: int) -> list[tuple[int, int]]:
    """(byte offset, slices) of each of ``parts`` equal shares of a staging area; StagingError
    when a share would hold fewer than ``MIN_SLICES`` slices."""
    slices = nbytes // slice_bytes // parts if slice_bytes else 0
    if slices < MIN_SLICES:
        raise StagingError(f"staging of {nbytes} bytes in slices of {slice_bytes} gives each of "
                           f"{parts} prefill nodes fewer than {MIN_SLICES} slices: raise "
                           "staging_bytes or lower slice_bytes")
    return [(i * slices * slice_bytes, slices) for i in range(parts)]


def check_route(route: str) -> str:
    if route not in ROUTES:
        raise StagingError(f"route must be one of {', '.join(ROUTES)}, got {route!r}")
    return route


def slice_groups(num_pages: int, page_bytes: int, slice_bytes: int) -> list[tuple[int, int]]:
    """(first page, page count) of each group of a chunk's ``num_pages`` pages whose bytes
    (``page_bytes`` a page, every buffer) fit one slice; StagingError when one page does not."""
    if page_bytes <= 0 or num_pages <= 0:
        raise StagingError(f"nothing to stage: {num_pages} pages of {page_bytes} bytes")
    per_slice = slice_bytes // page_bytes
    if per_slice == 0:
        raise StagingError(f"one page of every buffer is {page_bytes} bytes, more than a staging "
                           f"slice ({slice_bytes}): raise slice_bytes")
    return [(start, min(per_slice, num_pages - start)) for start in range(0, num_pages, per_slice)]


def slice_offsets(item_lens: Sequence[int], pages: int) -> np.ndarray:
    """Byte offset in a slice of each buffer's ``pages`` pages, and the end: buffer-major."""
    return np.concatenate(([0], np.cumsum(np.asarray(item_lens, dtype=np.int64) * pages)))


class SliceRing:
    """The slices of one staging area: each free, in use (taken, until ``release``), or fenced
    until a time (``fence``: a failed write may still land in it). Not thread-safe: its owner
    locks."""

    def __init__(self, count: int):
        if count <= 0:
            raise StagingError(f"a staging ring needs at least one slice, got {count}")
        self.count = count
        self._free = list(range(count - 1, -1, -1))  # a stack: the slice freed last goes first
        self._in_use: set[int] = set()
        self._fenced: dict[int, float] = {}  # slice -> until

    def take(self, now: float) -> int | None:
        """A free slice, now in use (fences past their time lifted first); None if none."""
        for index, until in list(self._fenced.items()):
            if until <= now:
                del self._fenced[index]
                self._free.append(index)
        if not self._free:
            return None
        index = self._free.pop()
        self._in_use.add(index)
        return index

    def release(self, index: int) -> None:
        """Slice ``index``, in use, is free again; StagingError for one not in use."""
        if index not in self._in_use:
            raise StagingError(f"staging slice {index} is not in use")
        self._in_use.discard(index)
        self._free.append(index)

    def fence(self, index: int, until: float) -> None:
        """Slice ``index``, in use, stays out of the ring until ``until``."""
        if index not in self._in_use:
            raise StagingError(f"staging slice {index} is not in use")
        self._in_use.discard(index)
        self._fenced[index] = until

    @property
    def in_use(self) -> frozenset[int]:
        return frozenset(self._in_use)

    @property
    def fenced(self) -> dict[int, float]:
        return dict(self._fenced)

    @property
    def free(self) -> int:
        return len(self._free)
