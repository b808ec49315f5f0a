"""The staged route's pure planning: staging sizes, the route of a chunk, slice groups and
offsets, a peer's staging area, and the slice ring (free, in use, fenced until a time)."""

from __future__ import annotations

import numpy as np
import pytest

from dsa_bridge.transfer.staging import (
    DEFAULT_SLICE_BYTES,
    DEFAULT_STAGING_BYTES,
    MIB,
    SliceRing,
    StagingError,
    check_area,
    check_route,
    slice_groups,
    slice_offsets,
    split_area,
    staging_size,
)


def test_staging_defaults_to_256_mib_or_the_pool_if_smaller():
    assert staging_size(None, 10 << 30) == (DEFAULT_STAGING_BYTES, DEFAULT_SLICE_BYTES)
    assert staging_size(None, 6 * MIB) == (6 * MIB, 3 * MIB)
    assert staging_size(None, 6 * MIB, parts=3) == (6 * MIB, MIB)
    assert staging_size(0, 10 << 30) == (0, 0)
    assert staging_size(100 * MIB, 10 << 30, 16 * MIB) == (96 * MIB, 16 * MIB)  # whole slices


def test_too_small_a_staging_area_names_the_options():
    with pytest.raises(StagingError, match="raise staging_bytes or lower slice_bytes"):
        staging_size(40 * MIB, 10 << 30, 32 * MIB)
    with pytest.raises(StagingError, match="staging_bytes must be >= 0"):
        staging_size(-1, 10 << 30)
    with pytest.raises(StagingError, match="fewer than 2 slices: raise staging_bytes"):
        split_area(8 * MIB, 2 * MIB, 3)


def test_split_area_gives_each_prefill_an_equal_share():
    assert split_area(8 * MIB, MIB, 2) == [(0, 4), (4 * MIB, 4)]
    assert split_area(9 * MIB, MIB, 2) == [(0, 4), (4 * MIB, 4)]


def test_an_unknown_route_is_refused():
    with pytest.raises(StagingError, match="route must be one of"):
        check_route("fast")


def test_slice_groups_cover_every_page_once_in_order():
    groups = slice_groups(10, 100, 350)
    assert groups == [(0, 3), (3, 3), (6, 3), (9, 1)]
    assert slice_groups(3, 100, 300) == [(0, 3)]
    covered = np.concatenate([np.arange(s, s + n) for s, n in slice_groups(1000, 7, 64)])
    assert np.array_equal(covered, np.arange(1000))


def test_a_page_larger_than_a_slice_is_refused_naming_the_option():
    with pytest.raises(StagingError, match="raise slice_bytes"):
        slice_groups(4, 500, 499)


def test_slice_offsets_are_buffer_major():
    assert slice_offsets([41984, 8448, 41984], 3).tolist() == [0, 125952, 151296, 277248]


def test_check_area_refuses_null_wrapping_and_overlapping_areas():
    check_area(1 << 20, 4096, 4, [(0x1000, 4096), ((1 << 20) + 16384, 100)])
    with pytest.raises(StagingError, match="empty or null"):
        check_area(0, 4096, 4, [])
    with pytest.raises(StagingError, match="wraps around"):
        check_area(2**64 - 4096, 4096, 2, [])
    with pytest.raises(StagingError, match="overlaps the buffer at 0x104000"):
        check_area(1 << 20, 4096, 5, [((1 << 20) + 16384, 100)])


def test_ring_hands_out_each_slice_once_until_released():
    ring = SliceRing(3)
    taken = {ring.take(0.0) for _ in range(3)}
    assert taken == {0, 1, 2}
    assert ring.take(0.0) is None
    ring.release(1)
    assert ring.take(0.0) == 1
    with pytest.raises(StagingError, match="not in use"):
        ring.release(7)


def test_a_fenced_slice_stays_out_of_the_ring_until_its_time():
    ring = SliceRing(2)
    first, second = ring.take(0.0), ring.take(0.0)
    ring.fence(first, until=10.0)
    ring.release(second)
    assert ring.take(5.0) == second
    assert ring.take(9.9) is None
    assert ring.fenced == {first: 10.0}
    assert ring.take(10.0) == first
    assert ring.fenced == {}
    with pytest.raises(StagingError, match="not in use"):
        ring.fence(first + 5, 1.0)
