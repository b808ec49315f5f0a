"""The launcher's decode driver (``drive_decode``), as ``dsa-bridge decode`` runs it, stopped by
its ``stop`` event (SIGTERM/SIGINT in the command): no further request starts, those in flight
finish and are verified, and the report counts the requests issued."""

from __future__ import annotations

import threading

from dsa_bridge.transfer.launcher.drivers import drive_decode, request_lengths, serve_prefill
from tests.transfer.helpers import wait_for


def test_a_stopped_decode_run_finishes_what_it_started_and_counts_only_that(nodes):
    prefill, decode = nodes()
    serving, stop = threading.Event(), threading.Event()
    server = threading.Thread(target=serve_prefill, args=(prefill, serving), daemon=True)
    server.start()
    lengths = request_lengths(10_000, 64, 64 * 4, seed=3)

    def stop_after_a_few() -> None:
        wait_for(lambda: prefill.counters.snapshot()["requests_ok"] >= 5, 30, "a few requests")
        stop.set()

    stopper = threading.Thread(target=stop_after_a_few, daemon=True)
    stopper.start()
    try:
        report = drive_decode(decode, lengths, concurrency=4, stop=stop, progress=False,
                              deadline_s=60)
    finally:
        serving.set()
        server.join(10)
        stopper.join(10)
    assert stop.is_set()
    assert 5 <= report.requests < len(lengths)  # stopped early, counting what it issued
    assert report.requests_ok == report.requests and report.ok, report.failures
