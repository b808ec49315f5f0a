"""``auto``'s route chooser, pure: each route's cost per byte per size class from the writes timed
(the lower quartile of a window), the first chunks of a class on each route, then the cheaper one, the
dearer one refreshed rarely, and a sweep of simulated costs where ``auto`` stays within 10 % of
the faster route."""

from __future__ import annotations

import math
import random

import pytest

from dsa_bridge.transfer.route_costs import (
    FEWEST_BETWEEN,
    MOST_BETWEEN,
    RouteCosts,
    explore_every,
    size_class,
)
from dsa_bridge.transfer.staging import DIRECT, STAGED, StagingError

PAGE_KV, PAGE_INDEX = 656 * 64, 132 * 64  # DeepSeek-V3.2 fp8: one page of each cache


def test_size_class_is_the_bit_length_of_the_average_descriptor():
    assert size_class(1, 1024) == size_class(2, 2 * 1500) == 11
    assert size_class(1, 2048) == 12
    assert size_class(122, 61 * (PAGE_KV + PAGE_INDEX)) == size_class(1, 25216)  # a page each


@pytest.mark.parametrize("descriptors, nbytes", [(0, 10), (10, 0), (-1, 10), (3, -4)])
def test_a_chunk_without_descriptors_or_bytes_has_no_class(descriptors, nbytes):
    with pytest.raises(StagingError, match="has no size class: both must be > 0"):
        size_class(descriptors, nbytes)


def test_refreshes_are_rarer_the_dearer_the_route():
    assert explore_every(1.0) == FEWEST_BETWEEN
    assert explore_every(1.5) == 25  # 0.5 / 25 = 2 % of the time
    assert explore_every(3.0) == 100
    assert explore_every(1e9) == explore_every(math.inf) == MOST_BETWEEN
    with pytest.raises(StagingError, match="cost ratio must be >= 1"):
        explore_every(0.5)
    with pytest.raises(StagingError, match="cost ratio must be >= 1"):
        explore_every(math.nan)


@pytest.mark.parametrize("kwargs", [{"min_samples": 0}, {"window": 0}, {"budget": 0.0},
                                    {"budget": 1.0}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(StagingError, match="route costs need"):
        RouteCosts(**kwargs)


@pytest.mark.parametrize("route, seconds, match", [
    ("auto", 1.0, "direct or staged"), (DIRECT, -1.0, "finite and >= 0"),
    (STAGED, math.inf, "finite and >= 0"), (STAGED, math.nan, "finite and >= 0")])
def test_bad_observations_are_refused_and_change_nothing(route, seconds, match):
    costs = RouteCosts()
    with pytest.raises(StagingError, match=match):
        costs.observe(route, 10, 1000, seconds)
    assert costs.per_byte(10, 1000) == {DIRECT: None, STAGED: None}


def test_each_route_is_tried_twice_then_the_cheaper_one_taken():
    costs = RouteCosts()
    order = [costs.choose(100, 100_000) for _ in range(4)]
    assert order == [DIRECT, DIRECT, STAGED, STAGED]
    for route, seconds in ((DIRECT, 2.0), (DIRECT, 2.0), (STAGED, 1.0), (STAGED, 1.0)):
        costs.observe(route, 100, 100_000, seconds)
    assert costs.per_byte(100, 100_000) == {DIRECT: 2e-5, STAGED: 1e-5}
    assert {costs.choose(100, 100_000) for _ in range(10)} == {STAGED}
    assert costs.choose(1, 100_000) == DIRECT  # another class starts over


def test_writes_timed_on_a_forced_route_count_as_tried():
    costs = RouteCosts()
    for route in (DIRECT, STAGED, DIRECT, STAGED):  # a node on a forced route timed both
        costs.observe(route, 100, 100_000, 1.0 if route == DIRECT else 3.0)
    assert costs.choose(100, 100_000) == DIRECT  # no trial: the cheaper at once
    assert costs.classes[size_class(100, 100_000)].timed == {DIRECT: 2, STAGED: 2}


def test_an_empty_chunk_goes_direct_and_counts_nowhere():
    costs = RouteCosts()
    assert costs.choose(0, 0) == DIRECT
    assert costs.classes == {}


def test_while_the_first_writes_are_in_flight_the_timed_route_is_taken():
    costs = RouteCosts(min_samples=1)
    assert [costs.choose(10, 10_000), costs.choose(10, 10_000)] == [DIRECT, STAGED]
    assert costs.choose(10, 10_000) == DIRECT  # neither timed yet
    costs.observe(STAGED, 10, 10_000, 0.5)
    assert costs.choose(10, 10_000) == STAGED


def test_the_dearer_route_is_refreshed_once_per_explore_every_chunks():
    costs = RouteCosts(min_samples=1)
    for route, seconds in ((DIRECT, 3.0), (STAGED, 1.0)):
        costs.choose(10, 10_000)
        costs.observe(route, 10, 10_000, seconds)
    picks = [costs.choose(10, 10_000) for _ in range(300)]
    assert picks.count(DIRECT) == 3  # every 100th: 2 / 100 of the time at 3x the cost
    assert picks[99] == picks[199] == picks[299] == DIRECT


def test_slow_writes_in_a_window_move_the_cost_only_once_they_are_most_of_it():
    costs = RouteCosts(min_samples=1, window=5)
    for seconds in (1.0, 10.0, 1.0, 10.0, 10.0):  # writes slowed by the rest of the machine
        costs.observe(DIRECT, 10, 10_000, seconds)
    assert costs.per_byte(10, 10_000)[DIRECT] == 1e-4  # the lower quartile: the second lowest
    costs.observe(DIRECT, 10, 10_000, 10.0)  # the latest 5: 10, 1, 10, 10, 10
    assert costs.per_byte(10, 10_000)[DIRECT] == 1e-3  # four of five: the route's cost now


def test_the_cost_follows_a_change():
    costs = RouteCosts(min_samples=1)
    for route, seconds in ((DIRECT, 1.0), (STAGED, 2.0)):
        costs.choose(10, 10_000)
        costs.observe(route, 10, 10_000, seconds)
    picks = []
    for _ in range(400):  # the direct route slows to 4x: its own writes show it
        picks.append(costs.choose(10, 10_000))
        costs.observe(picks[-1], 10, 10_000, 4.0 if picks[-1] == DIRECT else 2.0)
    assert picks[:4] == [DIRECT] * 3 + [STAGED]  # 1, 4, 4, 4: the lower quartile turns
    assert picks[-100:].count(STAGED) == 98  # direct refreshed every 50th (2x the cost)


def simulate(costs: RouteCosts, direct_s: float, staged_s: float, chunks: int,
             rng: random.Random, slowed: float = 0.0) -> float:
    """Seconds ``chunks`` chunks of one class take on the routes ``costs`` picks, each write's
    time the route's own with 10 % noise, and a share ``slowed`` of them 3x slower."""
    total = 0.0
    for _ in range(chunks):
        route = costs.choose(122, 122 * 25_000)
        seconds = (direct_s if route == DIRECT else staged_s) * rng.uniform(0.9, 1.1)
        seconds *= 3.0 if rng.random() < slowed else 1.0
        costs.observe(route, 122, 122 * 25_000, seconds)
        total += seconds
    return total


CASES = [  # (direct, staged seconds a chunk, share of writes 3x slower: a loaded machine)
    (1.0, 0.52 / 0.30, 0.0), (0.30, 0.52, 0.0), (1.0, 1.05, 0.0), (1.0, 0.95, 0.0),
    (1.0, 10.0, 0.0), (10.0, 1.0, 0.0),
    (1.0, 0.52 / 0.30, 0.1), (0.30, 0.52, 0.1), (1.0, 1.05, 0.1), (1.0, 0.95, 0.1),
    (1.0, 4.0, 0.1), (4.0, 1.0, 0.1)]


@pytest.mark.parametrize("direct_s, staged_s, slowed", CASES)
def test_auto_stays_within_ten_percent_of_the_faster_route(direct_s, staged_s, slowed):
    chunks = 400
    faster = min(direct_s, staged_s) * chunks * (1 + 2 * slowed)
    for seed in range(10):
        assert simulate(RouteCosts(), direct_s, staged_s, chunks, random.Random(seed),
                        slowed) <= 1.1 * faster
