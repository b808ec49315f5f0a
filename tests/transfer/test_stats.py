"""Stats that merge: the per-write histograms, the live ``Counters`` under threads, the bytes a
``Stats`` travels as between processes (and the bytes it refuses), and merging across ranks -
exact, with the empty stats as identity, associative and commutative."""

from __future__ import annotations

import threading

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsa_bridge.transfer.counters import (
    CATEGORIES,
    LATENCY_BUCKETS,
    MAX_STATS_BYTES,
    STATS_FORMAT,
    STATS_VERSION,
    WRITE_BYTES_BUCKETS,
    WRITE_DESCRIPTORS_BUCKETS,
    WRITE_SECONDS_BUCKETS,
    Counters,
    Stats,
    merge,
)

COUNTS = st.integers(0, 2**40)
# seconds as multiples of 1/1024 below 2**20: sums of a few of them are exact floats, so the
# properties below hold to the bit
SECONDS = st.integers(0, 2**30).map(lambda n: n / 1024)


def _field_values(default):
    if isinstance(default, tuple):
        return st.lists(COUNTS, min_size=len(default), max_size=len(default)).map(tuple)
    if isinstance(default, dict):
        return st.dictionaries(st.sampled_from(CATEGORIES), COUNTS)
    return SECONDS if isinstance(default, float) else COUNTS


EMPTY = Stats()
STATS = st.fixed_dictionaries({name: _field_values(getattr(EMPTY, name)) for name in Stats.__struct_fields__}
                              ).map(lambda values: Stats(**values))


def only(length: int, index: int, count: int = 1) -> list[int]:
    """Bucket counts of ``length`` with ``count`` at ``index`` and zero elsewhere."""
    counts = [0] * length
    counts[index] = count
    return counts


def test_each_write_lands_in_its_buckets_bounds_inclusive():
    counters = Counters()
    counters.record_write(0.001, 4096, 1)  # on a bound: that bound's bucket
    counters.record_write(0.0010001, 4097, 2)  # just above: the next one
    counters.record_write(11.0, 5 * 2**30, 70_000)  # beyond the last bound: the rest
    s = counters.snapshot()
    assert (s["chunks"], s["bytes"], s["descriptors"]) == (3, 4096 + 4097 + 5 * 2**30, 70_003)
    assert s["write_seconds"] == pytest.approx(11.0020001)
    at, rest = WRITE_SECONDS_BUCKETS.index(0.001), len(WRITE_SECONDS_BUCKETS)
    assert s["write_seconds_counts"] == [int(i in (at, at + 1, rest)) for i in range(rest + 1)]
    assert s["write_bytes_counts"] == [1, 1] + [0] * (len(WRITE_BYTES_BUCKETS) - 2) + [1]
    assert s["write_descriptors_counts"] == [1, 1] + [0] * (len(WRITE_DESCRIPTORS_BUCKETS) - 2) + [1]


def test_counters_read_and_assign_fields_and_hand_out_values_that_stay():
    counters = Counters()
    counters.bad_messages = 3  # as the node runtime copies its loop's count
    counters.max_tick_gap_s = 0.25
    before = counters.stats()
    counters.add(bad_messages=1, checksum_seconds=0.5)
    assert counters.bad_messages == 4 and counters.checksum_seconds == 0.5
    assert before.bad_messages == 3 and before.checksum_seconds == 0.0  # a value, not a view
    counters.latency_counts[0] = 99  # a copy too
    assert counters.latency_counts[0] == 0
    with pytest.raises(AttributeError, match="no field 'speed'"):
        counters.speed = 1
    with pytest.raises(AttributeError, match="no field 'speed'"):
        counters.speed  # noqa: B018
    assert list(counters.snapshot()) == list(Stats.__struct_fields__)


def test_updates_from_many_threads_are_all_counted():
    counters = Counters()
    threads, rounds = 4, 2000

    def work(thread):
        for _ in range(rounds):
            counters.record_write(0.002, 4096, thread + 1)
            counters.request_ok(0.003)
            counters.request_failed("timed out after 1s")
            counters.add(engine_failures=1)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    s = counters.stats()
    total = threads * rounds
    assert (s.chunks, s.requests_ok, s.requests_failed, s.engine_failures) == (total,) * 4
    assert s.bytes == total * 4096 and s.descriptors == rounds * (1 + 2 + 3 + 4)
    assert s.failures == {"timeout": total}
    assert sum(s.write_seconds_counts) == sum(s.latency_counts) == sum(s.write_descriptors_counts) == total
    assert s.write_descriptors_counts[:3] == (rounds, 3 * rounds, 0)  # 1 | 2, 3, 4 | 5..16


def rank(writes, oks, failures, tick_gap) -> Stats:
    counters = Counters()
    for write in writes:
        counters.record_write(*write)
    for seconds in oks:
        counters.request_ok(seconds)
    for reason in failures:
        counters.request_failed(reason)
    counters.max_tick_gap_s = tick_gap
    return counters.stats()


def test_ranks_shipped_as_bytes_merge_exactly():
    one = rank([(0.002, 4096, 8), (0.002, 4096, 8)], [0.3], ["timed out after 2s"], 0.5)
    two = rank([(2.0, 4**10, 100)], [0.3, 20.0], ["checksum mismatch: page 3", "decode run deadline passed"],
               0.25)
    merged = merge(*(Stats.decode(part.encode()) for part in (one, two)))
    assert merged == one + two == sum((one, two), Stats())
    assert (merged.chunks, merged.bytes, merged.descriptors) == (3, 2 * 4096 + 4**10, 116)
    assert merged.write_seconds == 2.004
    assert (merged.requests_ok, merged.requests_failed) == (3, 3)
    assert merged.failures == {"checksum": 1, "timeout": 2}
    assert merged.max_tick_gap_s == 0.5  # the longest of any rank, not a sum
    assert list(merged.latency_counts) == [
        2 if i == LATENCY_BUCKETS.index(0.5) else 1 if i == LATENCY_BUCKETS.index(30.0) else 0
        for i in range(len(LATENCY_BUCKETS) + 1)]
    assert merged.latency_seconds == pytest.approx(20.6)
    bytes_counts = only(len(WRITE_BYTES_BUCKETS) + 1, 0, 2)  # 4096 twice...
    bytes_counts[WRITE_BYTES_BUCKETS.index(4**10)] = 1  # ...and 1 MiB once
    assert list(merged.write_bytes_counts) == bytes_counts
    descriptor_counts = only(len(WRITE_DESCRIPTORS_BUCKETS) + 1, WRITE_DESCRIPTORS_BUCKETS.index(16), 2)
    descriptor_counts[WRITE_DESCRIPTORS_BUCKETS.index(256)] = 1  # 8, 8 and 100
    assert list(merged.write_descriptors_counts) == descriptor_counts
    seconds_counts = only(len(WRITE_SECONDS_BUCKETS) + 1, WRITE_SECONDS_BUCKETS.index(0.0025), 2)
    seconds_counts[WRITE_SECONDS_BUCKETS.index(2.5)] = 1  # 0.002, 0.002 and 2.0
    assert list(merged.write_seconds_counts) == seconds_counts
    assert merge() == Stats() and merge(one) == one


@settings(max_examples=200, deadline=None)
@given(STATS)
def test_encoding_round_trips_within_the_bound(stats):
    data = stats.encode()
    assert len(data) <= MAX_STATS_BYTES
    assert Stats.decode(data) == stats
    assert Stats.decode(bytearray(data)) == Stats.decode(memoryview(data)) == stats


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(STATS, STATS, STATS)
def test_merging_is_commutative_and_associative_with_the_empty_stats_as_identity(a, b, c):
    assert a + Stats() == Stats() + a == a
    assert a + b == b + a
    assert (a + b) + c == a + (b + c) == merge(a, b, c)


@settings(max_examples=100, deadline=None)
@given(STATS, STATS)
def test_merged_fields_are_the_sums_of_the_ranks(a, b):
    merged = a + b
    assert merged.requests_ok == a.requests_ok + b.requests_ok and merged.bytes == a.bytes + b.bytes
    assert merged.write_bytes_counts == tuple(
        x + y for x, y in zip(a.write_bytes_counts, b.write_bytes_counts, strict=True))
    assert merged.max_tick_gap_s == max(a.max_tick_gap_s, b.max_tick_gap_s)
    for category in CATEGORIES:
        assert merged.failures.get(category, 0) == a.failures.get(category, 0) + b.failures.get(category, 0)


def blob(version=STATS_VERSION, name=STATS_FORMAT, **changes) -> bytes:
    """An encoded Stats() with ``changes`` made to its fields (which the encoder would not send)."""
    return msgspec.msgpack.encode((name, version, {**Stats().as_dict(), **changes}))


def test_a_hand_built_blob_of_the_empty_stats_decodes():
    assert Stats.decode(blob()) == Stats()


@pytest.mark.parametrize(("data", "match"), [
    (b"", "not encoded stats"),
    (b"\xc1", "not encoded stats"),  # a byte msgpack never uses
    (b"hello, world", "not encoded stats"),
    (msgspec.msgpack.encode(Stats()), "not encoded stats"),  # no envelope
    (Stats().encode() + b"\x00", "not encoded stats"),  # trailing bytes
    (Stats().encode()[:-3], "not encoded stats"),  # truncated
    (b"\x00" * (MAX_STATS_BYTES + 1), f"limit is {MAX_STATS_BYTES}"),
    (blob(name="other.stats"), "format 'other.stats'"),
    (blob(version=2), "version 2 unsupported"),
    (blob(latency_counts=[0] * len(LATENCY_BUCKETS)), r"latency_counts"),
    (blob(write_bytes_counts=[0] * (len(WRITE_BYTES_BUCKETS) + 2)), r"write_bytes_counts"),
    (blob(requests_ok=-1), r"requests_ok"),
    (blob(requests_ok=True), r"requests_ok"),
    (blob(requests_ok="3"), r"requests_ok"),
    (blob(latency_counts=[-1] * (len(LATENCY_BUCKETS) + 1)), r"latency_counts"),
    (blob(write_seconds=float("nan")), r"write_seconds"),
    (blob(latency_seconds=float("inf")), r"latency_seconds"),
    (blob(failures={"cosmic rays": 1}), r"failures"),
    (blob(surprise=1), r"surprise"),
    ("a string", "must be bytes, got str"),
    (None, "must be bytes, got NoneType"),
])
def test_bad_input_is_refused_with_a_value_error(data, match):
    with pytest.raises(ValueError, match=match):
        Stats.decode(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048))
def test_any_bytes_decode_or_raise_value_error(data):
    try:
        decoded = Stats.decode(data)
    except ValueError:
        return
    assert isinstance(decoded, Stats)


@settings(max_examples=100, deadline=None)
@given(STATS, st.data())
def test_a_corrupted_blob_decodes_or_raises_value_error(stats, data):
    encoded = bytearray(stats.encode())
    at = data.draw(st.integers(0, len(encoded) - 1))
    encoded[at] = data.draw(st.integers(0, 255))
    try:
        Stats.decode(bytes(encoded))
    except ValueError:
        pass
