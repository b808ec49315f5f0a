"""Mooncake's batches in flight, against a scripted engine: never more queued than allowed, the
next queued before the earlier one is waited for, and after a failure nothing more submitted
while every queued batch is still waited for (so none lands after the write ended)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dsa_bridge.transfer.backends.mooncake import MooncakeBackend, _Outcome


class ScriptedEngine:
    """Records submissions and waits; ``failing`` batch ids answer -1 to their status."""

    def __init__(self, failing: tuple[int, ...] = (), refuse_submit_at: int | None = None):
        self.events: list[tuple[str, int]] = []
        self.queued: set[int] = set()
        self.most_queued = 0
        self.failing, self.refuse_submit_at = failing, refuse_submit_at

    def batch_transfer_async_write(self, peer, src, dst, length) -> int:
        batch = len([e for e in self.events if e[0] == "submit"]) + 1
        if batch == self.refuse_submit_at:
            return 2**64 - 1
        self.events.append(("submit", batch))
        self.queued.add(batch)
        self.most_queued = max(self.most_queued, len(self.queued))
        return batch

    def get_batch_transfer_status(self, batches: list[int]) -> int:
        (batch,) = batches
        self.events.append(("wait", batch))
        self.queued.remove(batch)
        return -1 if batch in self.failing else 0


def run(engine: ScriptedEngine, entries: int, max_batch: int, in_flight: int) -> _Outcome:
    backend = MooncakeBackend.__new__(MooncakeBackend)  # no engine: only the batching runs
    backend.max_batch, backend.batches_in_flight = max_batch, in_flight
    lock, outcome = threading.Lock(), _Outcome()
    lock.acquire()
    column = np.arange(entries, dtype=np.uint64)
    backend._run_batches(engine, "127.0.0.1:1", lock, column, column, column + 1, outcome)
    assert outcome.done.is_set() and not lock.locked(), "the write must end and free its peer"
    return outcome


@pytest.mark.parametrize("in_flight", [1, 2, 3])
def test_the_next_batch_is_queued_before_the_earlier_is_waited_for(in_flight: int) -> None:
    engine = ScriptedEngine()
    outcome = run(engine, 10 * 4, max_batch=4, in_flight=in_flight)
    assert not outcome.failed_call
    assert engine.most_queued == in_flight and not engine.queued
    submits = [b for kind, b in engine.events if kind == "submit"]
    waits = [b for kind, b in engine.events if kind == "wait"]
    assert submits == waits == list(range(1, 11))  # every batch once, waited in order
    first_wait = engine.events.index(("wait", 1))
    assert engine.events[:first_wait] == [("submit", b) for b in range(1, in_flight + 1)]


def test_a_failed_batch_stops_submission_but_every_queued_batch_is_waited_for() -> None:
    engine = ScriptedEngine(failing=(2,))
    outcome = run(engine, 10 * 4, max_batch=4, in_flight=3)
    assert (outcome.failed_call, outcome.code, outcome.first_entry) == (
        "get_batch_transfer_status", -1, 4)
    assert not engine.queued, "a queued batch was left landing after the write ended"
    assert max(b for kind, b in engine.events if kind == "submit") == 4  # 3 queued + 1 after #1


def test_a_refused_submission_names_its_first_entry_and_waits_for_the_queued() -> None:
    engine = ScriptedEngine(refuse_submit_at=3)
    outcome = run(engine, 10 * 4, max_batch=4, in_flight=3)
    assert (outcome.failed_call, outcome.first_entry) == ("batch_transfer_async_write", 8)
    assert not engine.queued and [b for kind, b in engine.events if kind == "wait"] == [1, 2]


def test_the_first_failure_is_the_one_reported() -> None:
    engine = ScriptedEngine(failing=(1, 2))
    outcome = run(engine, 3 * 4, max_batch=4, in_flight=2)
    assert outcome.first_entry == 0 and not engine.queued
