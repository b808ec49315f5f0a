"""Decode's re-handshake state machine on its own (``PeerSession``), time passed in."""

from __future__ import annotations

from dsa_bridge.transfer.decode.sessions import RETRY_FIRST_S, RETRY_MAX_S, PeerSession


def test_a_dead_peer_is_offered_new_epochs_with_a_doubling_backoff():
    session = PeerSession()
    assert not session.retry_due(100.0)  # alive: nothing to offer
    session.dead(100.0)
    assert session.retry_due(100.0)  # at once
    assert session.next_epoch(100.0) == 1
    assert not session.retry_due(100.0 + RETRY_FIRST_S - 0.001)
    assert session.retry_due(100.0 + RETRY_FIRST_S)
    assert session.next_epoch(101.0) == 2 and session.retry_at == 101.0 + 2 * RETRY_FIRST_S
    for _ in range(10):
        session.next_epoch(200.0)
    assert session.backoff_s == RETRY_MAX_S


def test_a_reconnect_offers_at_once_again():
    session = PeerSession()
    session.dead(100.0)
    session.next_epoch(100.0)
    session.next_epoch(100.5)
    session.reconnected(101.0)
    assert session.retry_due(101.0) and session.backoff_s == RETRY_FIRST_S


def test_only_the_answer_to_the_latest_hello_counts():
    session = PeerSession()
    hello = object()
    assert session.awaiting(0) is None  # alive
    session.dead(100.0)
    session.hello = hello
    session.next_epoch(100.0)
    session.next_epoch(101.0)
    assert session.awaiting(1) is None  # an earlier Hello's answer: the latest is on its way
    assert session.awaiting(2) is hello
    session.recovered()
    assert session.alive and session.awaiting(2) is None and session.backoff_s == RETRY_FIRST_S
