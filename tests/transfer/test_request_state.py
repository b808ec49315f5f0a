"""RequestState on its own: forward-only transitions and the release time, with time passed in."""

from __future__ import annotations

import pytest

from dsa_bridge.transfer.request import KVPoll, RequestState, TransferFailed


def test_created_and_deadline_come_from_now():
    state = RequestState(7, 2.5, now=100.0)
    assert (state.created, state.deadline, state.status) == (100.0, 102.5, KVPoll.Bootstrapping)
    assert state.release_at is None and not state.can_release(1e9)


def test_moves_only_forward():
    state = RequestState(1, 10.0, now=0.0)
    assert state.advance(KVPoll.Transferring, 1.0)
    assert not state.advance(KVPoll.WaitingForInput, 2.0)  # backwards
    assert not state.advance(KVPoll.Transferring, 3.0)  # same
    assert not state.advance(KVPoll.Failed, 3.0)  # failing is fail()'s job
    assert state.status == KVPoll.Transferring and state.transferring_at == 1.0


def test_success_is_terminal_and_releasable_at_once():
    state = RequestState(1, 10.0, now=0.0)
    assert state.advance(KVPoll.Success, 4.0)
    assert state.finished_at == state.release_at == 4.0
    assert not state.can_release(3.9) and state.can_release(4.0)
    assert not state.fail("late", 5.0) and state.status == KVPoll.Success
    assert state.failure_exception() is None


def test_fail_records_reason_time_and_release():
    state = RequestState(3, 10.0, now=0.0)
    assert state.fail("prefill OOM", 2.0, release_after_s=1.5)
    assert state.status == KVPoll.Failed and state.finished_at == 2.0
    assert not state.can_release(3.4) and state.can_release(3.5)
    assert not state.fail("again", 4.0) and state.reason == "prefill OOM"
    exc = state.failure_exception()
    assert isinstance(exc, TransferFailed) and str(exc) == "room 3: prefill OOM"
    assert not state.advance(KVPoll.Success, 5.0)


def test_held_until_allowed_and_never_later_than_allowed_first():
    state = RequestState(1, 10.0, now=0.0)
    state.allow_release(0.0)  # not terminal: ignored
    assert state.release_at is None
    state.fail("aborted", 1.0, release_after_s=None)
    assert not state.can_release(1e9)
    state.allow_release(5.0)
    state.allow_release(8.0)  # later than already allowed: the earlier stands
    assert state.release_at == 5.0
    state.allow_release(2.0)
    assert state.release_at == 2.0


@pytest.mark.parametrize("status", [KVPoll.WaitingForInput, KVPoll.Transferring])
def test_fail_from_any_running_state(status):
    state = RequestState(1, 10.0, now=0.0)
    state.advance(status, 0.5)
    assert state.fail("timed out", 11.0)
    assert state.status == KVPoll.Failed
