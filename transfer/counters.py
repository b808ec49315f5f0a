"""Per-node transfer counters: what really moved, so a skipped transfer cannot pass a test; how
long requests took and why they failed, for the node's metrics (``metrics.py``)."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field, fields

# upper bounds (seconds) of the request-latency histogram's buckets; one more counts the rest
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0)

# Failure reasons reduced to a fixed set (bounded metric labels): the first category whose words
# appear in the reason wins, so a checksum mismatch that prefill reports as an abort is "checksum".
FAILURE_CATEGORIES = (
    ("internal", ("internal error",)),
    ("checksum", ("checksum",)),
    ("engine", ("engine write failed",)),
    ("timeout", ("timed out", "deadline", "no result within")),
    ("peer_lost", ("unreachable", "re-handshaked", "silent")),
    ("aborted", ("aborted by",)),
    ("bad_request", ("bad pages", "page count mismatch", "does not fit", "duplicate room",
                     "is not in 0..", "no prefill request", "the prefill pool has")),
)
OTHER = "other"
CATEGORIES = tuple(name for name, _ in FAILURE_CATEGORIES) + (OTHER,)


def failure_category(reason: str) -> str:
    """The category (one of ``CATEGORIES``) of a request's failure reason."""
    text = reason.lower()
    for name, words in FAILURE_CATEGORIES:
        if any(word in text for word in words):
            return name
    return OTHER


@dataclass
class Counters:
    requests_ok: int = 0
    requests_failed: int = 0
    chunks: int = 0
    bytes: int = 0
    descriptors: int = 0
    engine_failures: int = 0
    handshakes_ok: int = 0
    handshakes_refused: int = 0
    bad_messages: int = 0
    max_tick_gap_s: float = 0.0  # the control loop's longest time between two ticks
    write_seconds: float = 0.0
    checksums_computed: int = 0  # (buffer, page) checksums prefill sent
    checksums_verified: int = 0  # (buffer, page) checksums decode found equal
    checksum_seconds: float = 0.0  # spent computing them (either side)
    # decode's fence: requests (and their pages) quarantined because a prefill that may still
    # write into them went silent; of those, released by the upper bound rather than by proof
    quarantines: int = 0
    pages_quarantined: int = 0
    quarantine_expiries: int = 0
    pages_expired: int = 0
    peer_recoveries: int = 0  # prefill nodes marked dead that came back through a new handshake
    failures: dict[str, int] = field(default_factory=dict)  # failed requests by category
    latency_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    latency_seconds: float = 0.0  # sum of the successful requests' latencies
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def request_ok(self, seconds: float) -> None:
        """A request turned Success after ``seconds`` of transfer."""
        with self._lock:
            self.requests_ok += 1
            self.latency_counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
            self.latency_seconds += seconds

    def request_failed(self, reason: str) -> None:
        with self._lock:
            self.requests_failed += 1
            category = failure_category(reason)
            self.failures[category] = self.failures.get(category, 0) + 1

    def snapshot(self) -> dict:
        with self._lock:
            return {f.name: _copy(getattr(self, f.name)) for f in fields(self) if f.name != "_lock"}


def _copy(value):
    return type(value)(value) if isinstance(value, (dict, list)) else value
