"""Transfer statistics: what really moved, so a skipped transfer cannot pass a test; how long
requests and engine writes took and why requests failed, for the metrics (``metrics.py``).

Two objects. ``Stats`` is a plain, immutable value: it encodes to bytes (``encode``/``decode``,
a versioned, size-bounded msgpack format) to travel between processes, and merges (``merge``,
``a + b``) across ranks, so one endpoint can export a whole deployment. ``Counters`` is one
node's live tally: thread-safe updates, each building the next ``Stats``.

Every histogram has fixed bucket bounds (``LATENCY_BUCKETS`` and the three ``WRITE_*_BUCKETS``),
one count per bound (values <= it and above the previous one) plus one for the rest, so the
histograms of two ranks merge exactly, bucket by bucket.
"""

from __future__ import annotations

import bisect
import functools
import threading
from typing import Annotated, Literal

import msgspec

# upper bounds (seconds) of the request-latency histogram's buckets; one more counts the rest
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0)
# upper bounds of the per-write histograms (one engine write = one chunk): its seconds, its bytes
# (powers of 4, 4 KiB to 4 GiB) and its descriptors (powers of 4, 1 to 64 Ki)
WRITE_SECONDS_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                         0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
WRITE_BYTES_BUCKETS = tuple(4**n for n in range(6, 17))
WRITE_DESCRIPTORS_BUCKETS = tuple(4**n for n in range(9))

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


# The encoded form: ("dsa-bridge.stats", STATS_VERSION, the Stats as a msgpack map).
STATS_FORMAT = "dsa-bridge.stats"
STATS_VERSION = 1  # 1: counts, seconds, failures by category, latency and per-write histograms
MAX_STATS_BYTES = 16 * 1024  # an encoded Stats takes under 1 KiB
MAX_SECONDS = 1e12  # a bound on any seconds field, so decode refuses inf and nan

Count = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(ge=0, le=MAX_SECONDS)]
Category = Literal[CATEGORIES]


def _bucket_counts(bounds: tuple) -> object:
    """The type of a histogram's counts: exactly one per bound, plus the rest."""
    return Annotated[tuple[Count, ...], msgspec.Meta(min_length=len(bounds) + 1,
                                                      max_length=len(bounds) + 1)]


LatencyCounts = _bucket_counts(LATENCY_BUCKETS)
WriteSecondsCounts = _bucket_counts(WRITE_SECONDS_BUCKETS)
WriteBytesCounts = _bucket_counts(WRITE_BYTES_BUCKETS)
WriteDescriptorsCounts = _bucket_counts(WRITE_DESCRIPTORS_BUCKETS)

# fields that merge as the largest of the ranks', not their sum
MAXIMA = frozenset({"max_tick_gap_s"})


class Stats(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One node's statistics (or several ranks' merged), as an immutable value.

    Counts and histogram buckets merge by exact integer sums, ``failures`` category by category,
    ``max_tick_gap_s`` as the largest; the seconds sums are float additions (exact up to float
    rounding). ``Stats()`` is the empty value, the identity of ``merge``.
    """

    requests_ok: Count = 0
    requests_failed: Count = 0
    chunks: Count = 0  # engine writes done (prefill) or reported done (decode)
    bytes: Count = 0  # their bytes
    descriptors: Count = 0  # their (src, dst, length) descriptors
    engine_failures: Count = 0
    handshakes_ok: Count = 0
    handshakes_refused: Count = 0
    bad_messages: Count = 0
    max_tick_gap_s: Seconds = 0.0  # the control loop's longest time between two ticks
    write_seconds: Seconds = 0.0  # inside those engine writes
    checksums_computed: Count = 0  # (buffer, page) checksums prefill sent
    checksums_verified: Count = 0  # (buffer, page) checksums decode found equal
    checksum_seconds: Seconds = 0.0  # spent computing them (either side)
    # decode's fence: requests (and their pages) quarantined because a prefill that may still
    # write into them went silent; of those, released by the upper bound rather than by proof
    quarantines: Count = 0
    pages_quarantined: Count = 0
    quarantine_expiries: Count = 0
    pages_expired: Count = 0
    peer_recoveries: Count = 0  # prefill nodes marked dead that came back through a new handshake
    # the staged route: chunks that took it (the others took the direct route), the staging
    # slices that carried them, and the node's registered staging area (its configured bound)
    staged_chunks: Count = 0
    staging_slices: Count = 0
    staging_bytes: Count = 0
    failures: dict[Category, Count] = {}  # failed requests by category
    latency_counts: LatencyCounts = (0,) * (len(LATENCY_BUCKETS) + 1)
    latency_seconds: Seconds = 0.0  # sum of the successful requests' latencies
    # per engine write (chunk): its seconds, bytes and descriptors; their sums are the
    # write_seconds, bytes and descriptors above
    write_seconds_counts: WriteSecondsCounts = (0,) * (len(WRITE_SECONDS_BUCKETS) + 1)
    write_bytes_counts: WriteBytesCounts = (0,) * (len(WRITE_BYTES_BUCKETS) + 1)
    write_descriptors_counts: WriteDescriptorsCounts = (0,) * (len(WRITE_DESCRIPTORS_BUCKETS) + 1)

    def __add__(self, other: Stats) -> Stats:
        if not isinstance(other, Stats):
            return NotImplemented
        return _merge_two(self, other)

    def as_dict(self) -> dict:
        """A plain dict of every field (histograms as lists): JSON- and ``repr``-friendly."""
        return {name: _plain(getattr(self, name)) for name in self.__struct_fields__}

    def encode(self) -> bytes:
        """These stats as bytes for another process; ``Stats.decode`` reads them back equal."""
        return msgspec.msgpack.encode((STATS_FORMAT, STATS_VERSION, self))

    @classmethod
    def decode(cls, data: bytes) -> Stats:
        """Stats from ``encode``'s bytes. Anything else - not bytes, over ``MAX_STATS_BYTES``,
        malformed, another format or version, a histogram of the wrong length, a negative count,
        a non-finite time, an unknown failure category or field - raises ValueError."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ValueError(f"stats must be bytes, got {type(data).__name__}")
        size = memoryview(data).nbytes
        if size > MAX_STATS_BYTES:
            raise ValueError(f"stats of {size} bytes refused: the limit is {MAX_STATS_BYTES}")
        try:
            name, version, body = _ENVELOPE.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ValueError(f"not encoded stats: {exc}") from exc
        if name != STATS_FORMAT:
            raise ValueError(f"not encoded stats: format {name!r}, expected {STATS_FORMAT!r}")
        if version != STATS_VERSION:
            raise ValueError(f"stats version {version} unsupported: this build reads {STATS_VERSION}")
        try:
            return _BODY.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ValueError(f"bad stats: {exc}") from exc


_ENVELOPE = msgspec.msgpack.Decoder(tuple[str, int, msgspec.Raw])
_BODY = msgspec.msgpack.Decoder(Stats)


def merge(*parts: Stats) -> Stats:
    """The stats of several ranks as one; ``merge()`` is ``Stats()``, ``merge(a)`` is ``a``."""
    return functools.reduce(_merge_two, parts, Stats())


def _merge_two(a: Stats, b: Stats) -> Stats:
    merged = {}
    for name in Stats.__struct_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if name in MAXIMA:
            merged[name] = max(x, y)
        elif isinstance(x, tuple):
            merged[name] = tuple(i + j for i, j in zip(x, y, strict=True))
        elif isinstance(x, dict):
            merged[name] = {c: x.get(c, 0) + y.get(c, 0) for c in CATEGORIES if c in x or c in y}
        else:
            merged[name] = x + y
    return Stats(**merged)


def _plain(value):
    if isinstance(value, tuple):
        return list(value)
    return dict(value) if isinstance(value, dict) else value


def _counted(counts: tuple[int, ...], bounds: tuple, value: float) -> tuple[int, ...]:
    """``counts`` with one more in ``value``'s bucket: the first whose bound is >= ``value``."""
    index = bisect.bisect_left(bounds, value)
    return counts[:index] + (counts[index] + 1,) + counts[index + 1:]


class Counters:
    """One node's live statistics, updated from any thread.

    Each update (``add``, ``request_ok``, ``request_failed``, ``record_write``, or assigning a
    field, as the node runtime does with ``bad_messages`` and ``max_tick_gap_s``) builds the next
    ``Stats`` under a lock; ``stats()`` returns the current one, ``snapshot()`` it as a plain dict.
    Fields read as attributes: ``counters.bad_messages``.
    """

    __slots__ = ("_lock", "_stats")

    def __init__(self) -> None:
        object.__setattr__(self, "_lock", threading.Lock())
        object.__setattr__(self, "_stats", Stats())

    def __getattr__(self, name: str):
        if name in Stats.__struct_fields__:
            return _plain(getattr(self._stats, name))
        raise AttributeError(f"Counters has no field {name!r}")

    def __setattr__(self, name: str, value) -> None:
        if name not in Stats.__struct_fields__:
            raise AttributeError(f"Counters has no field {name!r}")
        self._update(lambda stats: {name: value})

    def __repr__(self) -> str:
        return f"Counters({self._stats!r})"

    def _update(self, change) -> None:
        """Replace the stats by ``change(stats)``'s fields (a dict), under the lock."""
        with self._lock:
            object.__setattr__(self, "_stats", msgspec.structs.replace(self._stats, **change(self._stats)))

    def add(self, **deltas: float) -> None:
        """Add to counts and seconds sums: ``add(engine_failures=1)``."""
        self._update(lambda stats: {name: getattr(stats, name) + delta for name, delta in deltas.items()})

    def request_ok(self, seconds: float) -> None:
        """A request turned Success after ``seconds`` of transfer."""
        self._update(lambda stats: {
            "requests_ok": stats.requests_ok + 1,
            "latency_counts": _counted(stats.latency_counts, LATENCY_BUCKETS, seconds),
            "latency_seconds": stats.latency_seconds + seconds})

    def request_failed(self, reason: str) -> None:
        """A request failed for ``reason``; it counts under its ``failure_category``."""
        category = failure_category(reason)
        self._update(lambda stats: {
            "requests_failed": stats.requests_failed + 1,
            "failures": {**stats.failures, category: stats.failures.get(category, 0) + 1}})

    def record_write(self, seconds: float, nbytes: int, descriptors: int) -> None:
        """One engine write (a chunk) of ``nbytes`` over ``descriptors`` took ``seconds``: counted
        in ``chunks``, ``bytes``, ``descriptors`` and ``write_seconds`` and in the three per-write
        histograms (so it replaces an ``add`` of those four, never goes beside one)."""
        self._update(lambda stats: {
            "chunks": stats.chunks + 1, "bytes": stats.bytes + nbytes,
            "descriptors": stats.descriptors + descriptors,
            "write_seconds": stats.write_seconds + seconds,
            "write_seconds_counts": _counted(stats.write_seconds_counts, WRITE_SECONDS_BUCKETS, seconds),
            "write_bytes_counts": _counted(stats.write_bytes_counts, WRITE_BYTES_BUCKETS, nbytes),
            "write_descriptors_counts": _counted(stats.write_descriptors_counts,
                                                 WRITE_DESCRIPTORS_BUCKETS, descriptors)})

    def stats(self) -> Stats:
        """The current stats (an immutable value: later updates do not change it)."""
        return self._stats

    def snapshot(self) -> dict:
        """The current stats as a plain dict (a copy), keyed by ``Stats``' field names."""
        return self._stats.as_dict()
