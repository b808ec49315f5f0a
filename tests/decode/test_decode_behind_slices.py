"""Decode's messages keep their order behind the staged slices queued before them
(``BehindSlices``, pure), and the node handles them on its control thread."""

from __future__ import annotations

import pytest

from dsa_bridge.transfer.decode.behind_slices import BehindSlices


def test_a_message_with_no_slice_before_it_is_handled_at_once():
    order = BehindSlices()
    assert order.hold("report") is False
    assert order.held == 0 and order.release() == []


def test_a_message_waits_for_every_slice_queued_before_it_and_no_later_one():
    order = BehindSlices()
    order.slice_queued()
    order.slice_queued()
    assert order.hold("a") is True
    order.slice_queued()  # after "a": "a" does not wait for it
    assert order.release() == []
    order.slice_through()
    assert order.release() == [], "one slice before 'a' is still being scattered"
    order.slice_through()
    assert order.release() == ["a"]
    assert order.held == 0


def test_messages_keep_their_arrival_order_even_when_a_later_one_could_go_first():
    order = BehindSlices()
    order.slice_queued()
    assert order.hold("a") is True
    order.slice_through()
    # "a" may go now but has not been released yet: "b", with no slice before it, waits behind it
    assert order.hold("b") is True
    order.slice_queued()
    assert order.hold("c") is True
    assert order.release() == ["a", "b"]
    assert order.hold("d") is True, "'c' is still held: 'd' keeps its place behind it"
    order.slice_through()
    assert order.release() == ["c", "d"]
    assert order.hold("e") is False


def test_a_slice_through_that_was_never_queued_is_a_bug_not_a_count():
    order = BehindSlices()
    with pytest.raises(RuntimeError, match="never queued"):
        order.slice_through()
