"""Mooncake's entries in flight, against a scripted engine: each entry a batch of its own, polled
with ``transfer_check_status`` (Mooncake's ``get_batch_transfer_status`` spins a core until the
batch ends), the waiting thread sleeping between polls that found nothing done; never more than
the peer's window in flight, the next submitted as the earliest ends; after a failure nothing
more submitted while every submitted entry is still waited for (so none lands after the write
ended), the first failure the one reported. ``disconnect``'s reads back are polled the same way."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from dsa_bridge.transfer.backends.mooncake import _LANES, MooncakeBackend, _Outcome, _Peer


class ScriptedEngine:
    """Records submissions and status checks; a batch ends after ``checks_to_end`` checks of its
    own, or once ``end_after_s`` passed since it was submitted; ``failing`` batch ids end with
    -1, ``timing_out`` with -2 (the engine's transfer timeout)."""

    def __init__(self, failing: tuple[int, ...] = (), timing_out: tuple[int, ...] = (),
                 refuse_submit_at: int | None = None, checks_to_end: int = 1,
                 end_after_s: float | None = None):
        self.events: list[tuple[str, int]] = []
        self.queued: dict[int, list] = {}  # batch -> [checks so far, submitted at]
        self.entries: dict[int, tuple[int, int, int]] = {}  # batch -> its one (src, dst, length)
        self.most_queued = 0
        self.failing, self.timing_out = failing, timing_out
        self.refuse_submit_at = refuse_submit_at
        self.checks_to_end, self.end_after_s = checks_to_end, end_after_s
        self.checks = 0

    def batch_transfer_async_write(self, peer, src, dst, length) -> int:
        assert len(src) == len(dst) == len(length) == 1, "one entry a batch"
        batch = len([e for e in self.events if e[0] == "submit"]) + 1
        if batch == self.refuse_submit_at:
            return 2**64 - 1
        self.events.append(("submit", batch))
        self.entries[batch] = (src[0], dst[0], length[0])
        self.queued[batch] = [0, time.monotonic()]
        self.most_queued = max(self.most_queued, len(self.queued))
        return batch

    def batch_transfer_async_read(self, peer, dst, src, length) -> int:
        return self.batch_transfer_async_write(peer, dst, src, length)

    def transfer_check_status(self, batch: int) -> int:
        self.checks += 1
        state = self.queued[batch]  # a batch that ended is freed: never checked again
        state[0] += 1
        ended = (time.monotonic() - state[1] >= self.end_after_s if self.end_after_s is not None
                 else state[0] >= self.checks_to_end)
        if not ended:
            return 0
        self.events.append(("end", batch))
        del self.queued[batch]
        return -1 if batch in self.failing else -2 if batch in self.timing_out else 1

    def get_batch_transfer_status(self, batches: list[int]) -> int:
        raise AssertionError("get_batch_transfer_status spins a core until the batch ends")


def run(engine: ScriptedEngine, entries: int, max_batch: int, in_flight: int) -> _Outcome:
    backend = MooncakeBackend.__new__(MooncakeBackend)  # no engine: only the batching runs
    backend.max_batch, backend.batches_in_flight = max_batch, in_flight
    lock, outcome = threading.Lock(), _Outcome()
    lock.acquire()
    column = np.arange(entries, dtype=np.uint64)
    backend._run_batches(engine, "127.0.0.1:1", lock, column, column + 100, column + 1, outcome)
    assert outcome.done.is_set() and not lock.locked(), "the write must end and free its peer"
    return outcome


@pytest.mark.parametrize(("max_batch", "in_flight"), [(4, 1), (4, 2), (3, 3)])
def test_every_entry_is_its_own_batch_and_the_window_is_never_exceeded(max_batch, in_flight):
    engine = ScriptedEngine(checks_to_end=3)
    outcome = run(engine, 40, max_batch=max_batch, in_flight=in_flight)
    assert not outcome.failed_call and not engine.queued
    assert engine.most_queued == max_batch * in_flight  # the window filled, never exceeded
    submits = [b for kind, b in engine.events if kind == "submit"]
    assert submits == list(range(1, 41))  # each entry once, in order
    assert [engine.entries[b] for b in submits] == [(i, i + 100, i + 1) for i in range(40)]
    first_end = engine.events.index(("end", 1))
    window = max_batch * in_flight
    assert engine.events[:first_end] == [("submit", b) for b in range(1, window + 1)]
    assert engine.events[first_end + 1] == ("submit", window + 1)  # the next as the first ended


def test_the_wait_sleeps_between_polls_instead_of_spinning():
    """A write whose entries end 60 ms after their submission: a spinning wait checks them
    tens of thousands of times in that time, a sleeping one a few hundred at most."""
    engine = ScriptedEngine(end_after_s=0.06)
    started = time.monotonic()
    outcome = run(engine, 8, max_batch=512, in_flight=2)
    assert not outcome.failed_call and time.monotonic() - started >= 0.06
    assert engine.checks <= 8 + 60e-3 / MooncakeBackend.POLL_FIRST_S, engine.checks


def test_a_failed_entry_stops_submission_but_every_submitted_entry_is_waited_for():
    engine = ScriptedEngine(failing=(2,), checks_to_end=2)
    outcome = run(engine, 40, max_batch=4, in_flight=3)
    assert (outcome.failed_call, outcome.code, outcome.first_entry) == (
        "transfer_check_status", -1, 1)
    assert not engine.queued, "a submitted entry was left landing after the write ended"
    assert max(b for kind, b in engine.events if kind == "submit") <= 13  # the window + 1


def test_an_entry_past_the_engines_timeout_fails_the_write_with_its_code():
    engine = ScriptedEngine(timing_out=(5,))
    outcome = run(engine, 8, max_batch=2, in_flight=2)
    assert (outcome.failed_call, outcome.code, outcome.first_entry) == (
        "transfer_check_status", -2, 4)
    assert not engine.queued


def test_a_refused_submission_names_its_entry_and_waits_for_the_submitted():
    engine = ScriptedEngine(refuse_submit_at=3, checks_to_end=5)
    outcome = run(engine, 40, max_batch=4, in_flight=3)
    assert (outcome.failed_call, outcome.first_entry) == ("batch_transfer_async_write", 2)
    assert not engine.queued and [b for kind, b in engine.events if kind == "end"] == [1, 2]


def test_the_first_failure_is_the_one_reported():
    engine = ScriptedEngine(failing=(1, 2))
    outcome = run(engine, 12, max_batch=4, in_flight=2)
    assert outcome.first_entry == 0 and not engine.queued


@pytest.mark.parametrize("failing", [(), (3,)])
def test_disconnect_reads_each_lane_back_in_a_batch_of_its_own_polled_not_spun(failing):
    """A frozen peer holds the reads until the engine's transfer timeout: waited for by polls
    with sleeps in between, every read ended before the peer's lock is let go."""
    engine = ScriptedEngine(failing=failing, end_after_s=0.06)
    backend = MooncakeBackend.__new__(MooncakeBackend)  # no engine: only the reads run
    state, scratch = _Peer(last_dst=4096), np.zeros(_LANES, dtype=np.uint8)
    backend._close_lanes(engine, "127.0.0.1:1", state, scratch)
    assert [engine.entries[b] for _, b in engine.events if _ == "submit"] == [
        (scratch.ctypes.data + lane, 4096, 1) for lane in range(_LANES)]
    assert not engine.queued, "a read was left in flight"
    assert not state.lock.locked()
    assert engine.checks <= _LANES + 60e-3 / MooncakeBackend.POLL_FIRST_S, engine.checks
