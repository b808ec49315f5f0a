"""The bench's route sweeps measure each page list once: no two points of a size's sweeps (page
pattern, pages, requests, route) move the same pages (``runs_1`` was ``per_page`` again). The
sizes whose figures are reported: tiny's 4-page request, a smoke test, may draw a fragmented
list that is contiguous."""

from __future__ import annotations

import numpy as np
import pytest

from dsa_bridge.transfer.bench.measure import page_ids, route_points
from dsa_bridge.transfer.bench.sizes import SIZES


@pytest.mark.parametrize("size", ["full", "quick"])
def test_no_two_route_points_move_the_same_pages(size):
    seen: dict[tuple, str] = {}
    for _, pattern, pages, requests, route in route_points(SIZES[size]):
        lists = page_ids(pattern, pages, requests)
        key = (route, *(tuple(np.concatenate(pair).tolist()) for pair in lists))
        assert key not in seen, f"{size}: {pattern} on {route} moves {seen.get(key)}'s pages"
        seen[key] = pattern


def test_runs_of_one_page_are_the_per_page_lists():
    """Why the crossover starts at 2 pages per descriptor."""
    (src1, dst1), = page_ids("runs_1", 64)
    (src, dst), = page_ids("per_page", 64)
    assert (src1 == src).all() and (dst1 == dst).all()
    assert all(min(SIZES[s].crossover_runs, default=2) >= 2 for s in SIZES)
