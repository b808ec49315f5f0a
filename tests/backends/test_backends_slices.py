"""Pure pieces of the backends: NIXL's slicing of a write's descriptors, and the fair lock that
lets a waiting thread in between a write's slices."""

from __future__ import annotations

import threading
import time

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from dsa_bridge.transfer.backends.base import FairLock
from dsa_bridge.transfer.backends.nixl import slices, split_descriptors

U64 = np.uint64


def descs(lengths, base: int) -> np.ndarray:
    lengths = np.asarray(lengths, dtype=U64)
    addr = base + np.concatenate(([0], np.cumsum(lengths + U64(100))[:-1])).astype(U64)
    return np.column_stack((addr, lengths, np.zeros(len(lengths), dtype=U64)))


def test_long_descriptors_are_cut_into_pieces_on_both_sides():
    local, remote = descs([25, 5, 10], 1000), descs([25, 5, 10], 9000)
    cut_local, cut_remote = split_descriptors(local, remote, 10)
    assert cut_local[:, 1].tolist() == [10, 10, 5, 5, 10]
    assert cut_local[:, 0].tolist() == [1000, 1010, 1020, 1125, 1230]
    assert cut_remote[:, 0].tolist() == [9000, 9010, 9020, 9125, 9230]
    assert split_descriptors(local, remote, 25)[0] is local  # nothing longer: unchanged


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=40), st.integers(1, 3000))
def test_pieces_cover_exactly_the_same_bytes(lengths, limit):
    local, remote = descs(lengths, 1 << 20), descs(lengths, 1 << 30)
    cut_local, cut_remote = split_descriptors(local, remote, limit)
    assert (cut_local[:, 1] <= limit).all() and (cut_local[:, 1] > 0).all()
    assert np.array_equal(cut_local[:, 1], cut_remote[:, 1])
    assert np.array_equal(cut_remote[:, 0] - cut_local[:, 0],
                          np.full(len(cut_local), (1 << 30) - (1 << 20), dtype=U64))
    covered = {(int(a) + i) for a, n in cut_local[:, :2].tolist() for i in range(0, n, 97)}
    wanted = {(int(a) + i) for a, n in local[:, :2].tolist() for i in range(0, n)}
    assert covered <= wanted and int(cut_local[:, 1].sum()) == sum(lengths)


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=60), st.integers(1, 8000))
def test_slices_are_consecutive_and_bounded(lengths, limit):
    ranges = slices(np.asarray(lengths, dtype=U64), limit)
    assert ranges[0][0] == 0 and ranges[-1][1] == len(lengths)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    for first, end in ranges:
        assert end > first
        assert end - first == 1 or sum(lengths[first:end]) <= limit


def test_the_fair_lock_lets_a_waiting_thread_in_between_two_holds():
    lock, order, started = FairLock(), [], threading.Event()

    def greedy():
        for i in range(50):
            with lock:
                order.append(("greedy", i))
                started.set()
                time.sleep(0.002)

    thread = threading.Thread(target=greedy)
    thread.start()
    started.wait(5)
    with lock:
        order.append(("waiter", 0))
    thread.join(10)
    # the waiter asked during greedy's first hold: it got the lock right after it, or at most
    # one hold later (greedy may have asked for its next hold before the waiter asked)
    assert order.index(("waiter", 0)) <= 3, order[:6]


def test_the_fair_lock_is_taken_if_free_only_when_nobody_holds_or_waits_for_it():
    lock, waiter_in = FairLock(), threading.Event()
    assert lock.acquire_if_free()  # free: taken
    assert not lock.acquire_if_free()  # held: not taken, and not queued either

    def waiter():
        with lock:
            waiter_in.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.05)  # the waiter has asked (it queues behind the holder)
    lock.release()
    thread.join(5)
    assert waiter_in.is_set() and not thread.is_alive()  # the skipped try left no ticket behind
    assert lock.acquire_if_free()
    lock.release()


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=60), st.integers(1, 8000))
def test_slices_are_as_long_as_the_limit_allows(lengths, limit):
    """Greedy: a range ends only where the next descriptor would take it over the limit."""
    ranges = slices(np.asarray(lengths, dtype=U64), limit)
    for first, end in ranges[:-1]:
        assert sum(lengths[first:end + 1]) > limit
