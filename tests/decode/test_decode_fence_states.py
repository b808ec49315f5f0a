"""Decode's bookkeeping of a request on its own: what each prefill reported (RequestParts) and the
fence's decisions (RequestFence), time passed in."""

from __future__ import annotations

import math

from dsa_bridge.transfer.decode.fence import RequestFence, RequestParts

A, B = "10.0.0.1:5000", "10.0.0.2:5000"
BOUND = 600.0


def test_parts_complete_once_each_stage_sent_exactly_its_bytes():
    parts = RequestParts([A, B])
    parts.chunk(A, 100)
    parts.chunk(A, 50)
    assert parts.part_done(A, 150) == "" and not parts.complete
    parts.chunk(B, 10)
    assert parts.part_done(B, 20, "2 buffers x 1 pages") == (
        f"prefill {B} wrote 10 bytes, expected 20 (2 buffers x 1 pages)")
    assert parts.complete  # both finished; the short one was reported as a problem
    assert parts.part_done(A, 150) == f"prefill {A} reported its last chunk twice"
    assert parts.received == {A: 150, B: 10}


def test_verified_counts_per_stage():
    parts = RequestParts([A, B])
    parts.verify(A, 3)
    parts.verify(A, 2)
    assert parts.verified == {A: 5, B: 0}


def test_share_writers_are_counted_by_the_pages_each_named():
    parts = RequestParts(["a", "b"], shares=True)
    parts.start(4)
    assert parts.positions("a", [0, 2]) == ""
    assert parts.positions("b", []) == ""  # an empty last chunk
    assert parts.positions("b", [1]) == ""
    assert (parts.pages_of("a", 4), parts.pages_of("b", 4)) == (2, 1)
    assert parts.unwritten() == ("1 of the request's 4 pages were written by no prefill node "
                                 "(the first: page 3)")
    assert parts.positions("b", [3]) == "" and parts.unwritten() == ""


def test_share_positions_out_of_order_out_of_range_or_twice_are_refused():
    parts = RequestParts(["a", "b"], shares=True)
    assert parts.positions("a", [0]) == "prefill a wrote a share of the pages before decode named them"
    parts.start(4)
    assert "out of order or twice" in parts.positions("a", [2, 1])
    assert "out of order or twice" in parts.positions("a", [1, 1])
    assert parts.positions("a", [1, 4]) == "prefill a wrote page 4 of a request of 4 pages"
    assert parts.positions("a", [-1]) == "prefill a wrote page -1 of a request of 4 pages"
    assert parts.positions("a", [1]) == ""
    assert parts.positions("b", [0, 1]) == "page 1 of the request was written by two prefill nodes"
    assert parts.share_pages == {"a": 1, "b": 0}  # a refused chunk counts nothing
    assert "without naming its pages" in parts.positions("b", None)


def test_a_whole_request_reader_refuses_named_pages():
    parts = RequestParts(["a"])
    parts.start(4)
    assert parts.positions("a", None) == "" and parts.pages_of("a", 4) == 4
    assert "wrote a share of the request's pages" in parts.positions("a", [0])
    assert parts.unwritten() == ""


def test_held_while_any_prefill_may_still_write():
    fence = RequestFence([A, B])
    assert fence.release_time() is None
    fence.confirmed(A, 1.0)
    assert fence.release_time() is None  # B may still write
    fence.confirmed(B, 2.0)
    assert fence.release_time() == -math.inf  # nobody can: at once


def test_nothing_sent_releases_at_once():
    fence = RequestFence([A])
    fence.nothing_sent()
    assert fence.release_time() == -math.inf


def test_a_reported_in_flight_write_holds_for_the_engine_grace():
    fence = RequestFence([A, B])
    fence.confirmed(A, 10.0, in_flight=True, grace_s=35.0)
    fence.confirmed(B, 20.0, in_flight=True, grace_s=5.0)  # the later of the two bounds wins
    assert fence.release_time() == 45.0


def test_a_silent_prefill_quarantines_until_proven_gone():
    fence = RequestFence([A, B])
    assert fence.silent(A)  # A may still write: quarantined
    assert fence.quarantined == {A} and A not in fence.outstanding
    assert not fence.silent(B)  # B's silence adds to the quarantine (counted once, with A)
    assert fence.quarantined == {A, B}
    fence.confirmed(A, 5.0)  # e.g. A re-handshook: its old writes are over
    assert fence.release_time() is None  # B still quarantined
    fence.confirmed(B, 6.0)
    assert fence.release_time() == -math.inf and not fence.quarantined


def test_silence_of_a_prefill_that_had_finished_quarantines_nothing():
    fence = RequestFence([A])
    fence.confirmed(A, 1.0)  # its last chunk arrived
    assert not fence.silent(A)
    assert not fence.quarantined and fence.release_time() == -math.inf


def test_silent_reports_only_the_first_quarantine_of_a_request():
    fence = RequestFence([A, B])
    assert fence.silent(A) is True
    assert fence.silent(B) is False  # already quarantined: counted once


def test_fence_releases_by_proof_without_expiry():
    fence = RequestFence([A])
    fence.silent(A)
    assert fence.decide(failed_at=100.0, now=101.0, bound_s=BOUND) == (None, False)
    fence.confirmed(A, 102.0)
    assert fence.decide(100.0, 102.0, BOUND) == (-math.inf, False)


def test_fence_expires_at_the_bound_once():
    fence = RequestFence([A])
    fence.silent(A)
    assert fence.decide(100.0, 100.0 + BOUND - 0.001, BOUND) == (None, False)
    assert fence.decide(100.0, 100.0 + BOUND, BOUND) == (100.0 + BOUND, True)
    assert fence.expired and not fence.quarantined
    assert fence.decide(100.0, 100.0 + BOUND + 1, BOUND) == (-math.inf, False)  # not counted twice


def test_fence_bounds_an_in_flight_grace_longer_than_the_bound():
    fence = RequestFence([A])
    fence.confirmed(A, 100.0, in_flight=True, grace_s=2 * BOUND)
    assert fence.decide(100.0, 101.0, BOUND) == (None, False)
    assert fence.decide(100.0, 100.0 + BOUND, BOUND) == (100.0 + BOUND, True)


def test_fence_keeps_an_in_flight_grace_inside_the_bound():
    fence = RequestFence([A])
    fence.confirmed(A, 100.0, in_flight=True, grace_s=35.0)
    assert fence.decide(100.0, 101.0, BOUND) == (135.0, False)
