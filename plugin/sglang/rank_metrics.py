"""dsa-bridge's counters of one sglang rank on sglang's own metrics endpoint.

sglang serves ``/metrics`` (``--enable-metrics``) in Prometheus's multiprocess mode: each
scheduler process writes its values into ``PROMETHEUS_MULTIPROC_DIR`` and the endpoint merges
every process's (sglang's ``add_prometheus_middleware``). ``RankMetrics`` writes dsa-bridge's
counters of its rank there the same way, so the endpoint serves them merged across the server's
ranks: counters summed, the gauges summed over the live ranks. Each series is labelled with the
rank's ``role`` (prefill or decode); every name is prefixed ``dsa_bridge_``:

- ``requests_total{state}``, ``request_failures_total{reason}`` (``counters.CATEGORIES``: checksum
  mismatches are ``reason="checksum"``), ``transfer_bytes_total``, ``transfer_chunks_total``,
  ``engine_failures_total``, ``staged_chunks_total``, ``checksums_total{op}``,
  ``quarantines_total``, ``quarantine_expiries_total``, ``forced_releases_total`` (decode pages
  sglang released while dsa-bridge's fence held them);
- gauges: ``pages_held`` and ``pages_quarantined`` (decode's fence).

``increments(before, now)``, pure: what each counter grew by between two readings (a counter
that went down, a node closed and made anew, starts again from its new value: the closed node's
counts were published already). ``RankMetrics`` reads the rank (``read()``: a ``RankReading``)
every ``PUBLISH_S`` on its own thread and once more at ``close``.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ...transfer.counters import CATEGORIES, Stats

PUBLISH_S = 1.0
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

# counter name -> (help, how it reads a reading)
COUNTERS: dict[str, tuple[str, Callable]] = {
    "transfer_bytes": ("Bytes written (prefill) or reported written (decode).", lambda r: r.stats.bytes),
    "transfer_chunks": ("Chunks written or received.", lambda r: r.stats.chunks),
    "engine_failures": ("Engine writes that failed.", lambda r: r.stats.engine_failures),
    "staged_chunks": ("Chunks that took the staged route.", lambda r: r.stats.staged_chunks),
    "quarantines": ("Requests whose pages were quarantined (silent prefill).",
                    lambda r: r.stats.quarantines),
    "quarantine_expiries": ("Quarantined requests released by the upper bound, without proof.",
                            lambda r: r.stats.quarantine_expiries),
    "forced_releases": ("Decode pages sglang released while dsa-bridge's fence held them.",
                        lambda r: r.forced_releases),
}


@dataclass(frozen=True)
class RankReading:
    """One rank's counts at one moment: its nodes' stats merged, and its own."""

    stats: Stats
    forced_releases: int = 0
    pages_held: int = 0
    pages_quarantined: int = 0


def flat(reading: RankReading) -> dict[tuple, int]:
    """Every counter of a reading, keyed by (name, label values)."""
    stats = reading.stats
    values = {("requests", "success"): stats.requests_ok, ("requests", "failed"): stats.requests_failed,
              ("checksums", "computed"): stats.checksums_computed,
              ("checksums", "verified"): stats.checksums_verified}
    values.update({("request_failures", c): stats.failures.get(c, 0) for c in CATEGORIES})
    values.update({(name,): read(reading) for name, (_, read) in COUNTERS.items()})
    return values


def increments(before: RankReading, now: RankReading) -> dict[tuple, int]:
    """What each counter grew by from ``before`` to ``now`` (module docstring); zeros left out."""
    old, new = flat(before), flat(now)
    grown = {key: value - old[key] if value >= old[key] else value for key, value in new.items()}
    return {key: value for key, value in grown.items() if value}


@functools.cache
def series() -> tuple[dict, dict]:
    """The process's counters and gauges, made once (a process may make several managers: a
    role switch, a test's scenarios), in prometheus_client's default registry."""
    from prometheus_client import Counter, Gauge

    labels = ["role"]
    counters = {
        "requests": Counter("dsa_bridge_requests", "Requests by final state.", [*labels, "state"]),
        "request_failures": Counter("dsa_bridge_request_failures",
                                    "Failed requests by reason category.", [*labels, "reason"]),
        "checksums": Counter("dsa_bridge_checksums", "(buffer, page) checksums.", [*labels, "op"]),
        **{name: Counter(f"dsa_bridge_{name}", doc, labels) for name, (doc, _) in COUNTERS.items()},
    }
    gauges = {
        name: Gauge(f"dsa_bridge_{name}", doc, labels, multiprocess_mode="livesum")
        for name, doc in (("pages_held", "Pages of failed requests that may not be reused yet."),
                          ("pages_quarantined", "Pages held because their prefill went silent."))}
    return counters, gauges


class RankMetrics:
    """Publishes ``read()`` into sglang's multiprocess metrics (module docstring)."""

    def __init__(self, role: str, read: Callable[[], RankReading], period_s: float = PUBLISH_S):
        self.role, self.read, self.period_s = role, read, period_s
        self._counters, self._gauges = series()
        for name, *values in flat(RankReading(Stats())):  # every series served from the start, at 0
            self._counters[name].labels(role, *values)
        self._last = RankReading(Stats())
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"dsa-bridge-{role}-metrics")
        self._thread.start()

    def publish(self) -> None:
        """Read the rank and add what grew since the last reading."""
        with self._lock:
            now = self.read()
            for (name, *values), amount in increments(self._last, now).items():
                self._counters[name].labels(self.role, *values).inc(amount)
            self._gauges["pages_held"].labels(self.role).set(now.pages_held)
            self._gauges["pages_quarantined"].labels(self.role).set(now.pages_quarantined)
            self._last = now

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.publish()

    def close(self) -> None:
        """Stop the thread, then publish the last counts."""
        self._stop.set()
        self._thread.join()
        self.publish()


def exported() -> bool:
    """Whether sglang serves metrics from this process's writes (``--enable-metrics`` set
    ``PROMETHEUS_MULTIPROC_DIR`` before the schedulers started)."""
    return bool(os.environ.get(MULTIPROC_ENV))
