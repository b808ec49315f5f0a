"""RoomBook on its own: what each prefill reported, and the fence's decisions, time passed in."""

from __future__ import annotations

import math

from dsa_bridge.transfer.request_fence import RoomBook

A, B = "10.0.0.1:5000", "10.0.0.2:5000"
BOUND = 600.0


def test_parts_complete_once_each_stage_sent_exactly_its_bytes():
    book = RoomBook([A, B])
    book.chunk(A, 100)
    book.chunk(A, 50)
    assert book.part_done(A, 150) == "" and not book.complete
    book.chunk(B, 10)
    assert book.part_done(B, 20, "2 buffers x 1 pages") == (
        f"prefill {B} wrote 10 bytes, expected 20 (2 buffers x 1 pages)")
    assert book.complete  # both finished; the short one was reported as a problem
    assert book.part_done(A, 150) == f"prefill {A} reported its last chunk twice"
    assert book.received == {A: 150, B: 10}


def test_verified_counts_per_stage():
    book = RoomBook([A, B])
    book.verify(A, 3)
    book.verify(A, 2)
    assert book.verified == {A: 5, B: 0}


def test_held_while_any_prefill_may_still_write():
    book = RoomBook([A, B])
    assert book.release_time() is None
    book.confirmed(A, 1.0)
    assert book.release_time() is None  # B may still write
    book.confirmed(B, 2.0)
    assert book.release_time() == -math.inf  # nobody can: at once


def test_nothing_sent_releases_at_once():
    book = RoomBook([A])
    book.nothing_sent()
    assert book.release_time() == -math.inf


def test_a_reported_in_flight_write_holds_for_the_engine_grace():
    book = RoomBook([A, B])
    book.confirmed(A, 10.0, in_flight=True, grace_s=35.0)
    book.confirmed(B, 20.0, in_flight=True, grace_s=5.0)  # the later of the two bounds wins
    assert book.release_time() == 45.0


def test_a_silent_prefill_quarantines_until_proven_gone():
    book = RoomBook([A, B])
    assert book.silent(A)  # A may still write: quarantined
    assert book.quarantined == {A} and A not in book.outstanding
    assert not book.silent(B)  # B's silence adds to the quarantine (counted once, with A)
    assert book.quarantined == {A, B}
    book.confirmed(A, 5.0)  # e.g. A re-handshook: its old writes are over
    assert book.release_time() is None  # B still quarantined
    book.confirmed(B, 6.0)
    assert book.release_time() == -math.inf and not book.quarantined


def test_silence_of_a_prefill_that_had_finished_quarantines_nothing():
    book = RoomBook([A])
    book.confirmed(A, 1.0)  # its last chunk arrived
    assert not book.silent(A)
    assert not book.quarantined and book.release_time() == -math.inf


def test_silent_reports_only_the_first_quarantine_of_a_request():
    book = RoomBook([A, B])
    assert book.silent(A) is True
    assert book.silent(B) is False  # already quarantined: counted once


def test_fence_releases_by_proof_without_expiry():
    book = RoomBook([A])
    book.silent(A)
    assert book.fence(failed_at=100.0, now=101.0, bound_s=BOUND) == (None, False)
    book.confirmed(A, 102.0)
    assert book.fence(100.0, 102.0, BOUND) == (-math.inf, False)


def test_fence_expires_at_the_bound_once():
    book = RoomBook([A])
    book.silent(A)
    assert book.fence(100.0, 100.0 + BOUND - 0.001, BOUND) == (None, False)
    assert book.fence(100.0, 100.0 + BOUND, BOUND) == (100.0 + BOUND, True)
    assert book.expired and not book.quarantined
    assert book.fence(100.0, 100.0 + BOUND + 1, BOUND) == (-math.inf, False)  # not counted twice


def test_fence_bounds_an_in_flight_grace_longer_than_the_bound():
    book = RoomBook([A])
    book.confirmed(A, 100.0, in_flight=True, grace_s=2 * BOUND)
    assert book.fence(100.0, 101.0, BOUND) == (None, False)
    assert book.fence(100.0, 100.0 + BOUND, BOUND) == (100.0 + BOUND, True)


def test_fence_keeps_an_in_flight_grace_inside_the_bound():
    book = RoomBook([A])
    book.confirmed(A, 100.0, in_flight=True, grace_s=35.0)
    assert book.fence(100.0, 101.0, BOUND) == (135.0, False)
