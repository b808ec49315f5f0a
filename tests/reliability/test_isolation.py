"""A frozen decode node delays only its own requests: one prefill node, two decode processes, one
of them frozen with SIGSTOP in the middle of its transfers. The healthy decode node's p99 request
latency while the other one is frozen (and the prefill's write into it runs into its timeout)
exceeds its p99 before, measured in the same run, by less than half the write timeout, and so
does its worst request (no healthy request waits out a write into the frozen node), on both
engines, NIXL also with UCX over TCP (over CMA, NIXL writes a stopped process's memory without
its help, so its write does not even stall). Every process is stopped by the test (SIGCONT before
the kill)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import numpy as np
import pytest

from dsa_bridge.plugin import DSALayout
from dsa_bridge.transfer.backends import create_backend
from dsa_bridge.transfer.launcher.drivers import serve_prefill
from dsa_bridge.transfer.prefill import PrefillNode
from tests.faulty import FaultyBackend

from ..transfer.helpers import wait_for
from .helpers import SMALL, make_pool
from .netns import loopback_hosts
from .procs import Hang, decode, gone, summary

CATEGORY = "faults injected"
LO = loopback_hosts(1)[0]
NODE = ("--pool-tokens", str(64 * 48), "--request-timeout", "120", "--max-tokens", "256")
WRITE_TIMEOUT_S = 3.0
BEFORE = 40  # the healthy node's writes before the freeze (its first 5 requests are not counted)
# the healthy node runs until the test stops it (SIGTERM: those in flight finish) after the freeze
# window, however late a loaded machine opens the window: it never runs out of requests before
HEALTHY_REQUESTS = 100_000
WINDOW_S = 2 * WRITE_TIMEOUT_S + 2.0  # after the freeze: writes into the frozen node time out
MIN_SAMPLES = 20  # the window lasts until the healthy node had this many writes in it, too
# A healthy request queued behind a write into the frozen node waits for that write's timeout: the
# ones queued as it starts, nearly all of WRITE_TIMEOUT_S (on main, before the writer's lanes:
# 11.6 s against 0.2 s). The other half of the timeout is the margin for the machine's load, which
# can differ between the two phases (the baseline is measured in the same run, under that load).
STALL_MARGIN_S = WRITE_TIMEOUT_S / 2


class FreezeFirstPeer(FaultyBackend):
    """Once ``armed``, freezes (SIGSTOP) ``pid`` right before the next write into the first
    engine peer written to (the victim, served first); counts the writes into the others."""

    def __init__(self, inner):
        super().__init__(inner)
        self.pid = 0
        self.first_peer = ""
        self.other_writes = 0
        self.armed = threading.Event()
        self.frozen_at = 0.0

    def write(self, peer, src, dst, length, *, timeout_s):
        self.first_peer = self.first_peer or peer
        if peer != self.first_peer:
            self.other_writes += 1
        elif self.armed.is_set() and not self.frozen_at:
            os.kill(self.pid, signal.SIGSTOP)
            self.frozen_at = time.monotonic()
        super().write(peer, src, dst, length, timeout_s=timeout_s)


def p99(latencies: list[float]) -> float:
    return float(np.percentile(latencies, 99))


@pytest.mark.parametrize("backend, tls", [("mooncake", ""), ("nixl", ""), ("nixl", "tcp")],
                         ids=["mooncake", "nixl", "nixl-ucx-tcp"])
def test_a_frozen_decode_delays_only_its_own_requests(backend, tls, procs, ledger, monkeypatch,
                                                      tmp_path):
    if tls:
        monkeypatch.setenv("UCX_TLS", tls)  # read by this process's agent and the children's
    # a 4-layer model: requests cheap enough for the decode processes to verify many per second
    model = tmp_path / "config.json"
    model.write_text(json.dumps(SMALL))
    node_options = ("--model", str(model), *NODE)
    engine = FreezeFirstPeer(create_backend(backend))
    stop = threading.Event()
    with PrefillNode(make_pool(DSALayout.from_hf_config(SMALL)), engine,
                     write_timeout_s=WRITE_TIMEOUT_S, peer_timeout_s=60.0) as node:
        thread = threading.Thread(target=serve_prefill, args=(node, stop), daemon=True)
        thread.start()
        try:
            victim = decode(procs, LO, backend, node.endpoint, *node_options, "--requests", "5000",
                            "--concurrency", "4", name="victim")
            engine.pid = victim.pid
            wait_for(lambda: node.counters.snapshot()["requests_ok"] >= 1, 90,
                     "the victim's first request")
            healthy = decode(procs, LO, backend, node.endpoint, *node_options, "--requests",
                             str(HEALTHY_REQUESTS), "--concurrency", "4", name="healthy")
            wait_for(lambda: engine.other_writes >= BEFORE, 120,
                     "the healthy decode node's requests before the freeze")
            engine.armed.set()
            wait_for(lambda: engine.frozen_at, 30, "the victim frozen under a write")
            writes_at_freeze = engine.other_writes
            time.sleep(max(0.0, engine.frozen_at + WINDOW_S - time.monotonic()))
            wait_for(lambda: engine.other_writes >= writes_at_freeze + MIN_SAMPLES, 120,
                     "the healthy decode node's writes during the freeze")
            window_end = time.monotonic()
            assert healthy.process.poll() is None, "the healthy decode node ended by itself"
            failures_in_window = node.counters.snapshot()["engine_failures"]
            healthy.signal(signal.SIGTERM)  # no further request; those in flight finish
            result = summary(procs, healthy, 120)
            victim.signal(signal.SIGCONT)
            victim.kill()
        finally:
            stop.set()
            thread.join(10)
        counters = node.counters.snapshot()
    times = sorted(result["request_times"].values())  # (init, Success), time.monotonic()
    before = [done - start for start, done in times[5:] if done < engine.frozen_at]
    during = [done - start for start, done in times
              if done > engine.frozen_at and start < window_end]
    ledger.record(tried=1, ok=counters["requests_ok"], failed=counters["requests_failed"],
                  bytes_verified=result["bytes_verified"], bytes_lost=result["bytes_mismatched"])
    assert result["ok"] and result["requests_ok"] == result["requests"] < HEALTHY_REQUESTS, \
        result["failures"]
    assert len(before) >= MIN_SAMPLES and len(during) >= MIN_SAMPLES, (len(before), len(during))
    if backend == "mooncake" or tls:  # the write into the frozen node timed out meanwhile
        assert failures_in_window >= 1, counters
    report = (f"healthy p99 {p99(during):.3f}s while the other decode was frozen, "
              f"{p99(before):.3f}s before (max {max(during):.3f}s / {max(before):.3f}s; "
              f"{len(during)} / {len(before)} requests)")
    print(f"\n{backend}{'-ucx-' + tls if tls else ''}: {report}")
    assert p99(during) < p99(before) + STALL_MARGIN_S, report
    # and not one request of thousands waits out a write timeout (the worst request)
    assert max(during) < max(before) + STALL_MARGIN_S, report
    assert gone(victim.pid)
    if not gone(healthy.pid):
        raise Hang("the healthy decode process is still present")
