"""The writer on its own, over the in-process memmove engine: jobs queued for one peer go out in
one engine write, a job is planned when it is submitted (so planning overlaps the write in
flight), a failed write fails every job in it as in flight, a job that cannot be planned
fails alone, a job of a failed request is skipped, the checksums and outcomes go to the objects
the writer was given, and a peer whose write hangs delays no other peer. Real engines in real
processes: tests/reliability/test_isolation.py."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from dsa_bridge.plugin.descriptors import BufferDescriptor, raw_region
from dsa_bridge.transfer.plan import BufferPair, PairTable, plan_chunk, plan_writes
from dsa_bridge.transfer.prefill import writer as writer_module
from dsa_bridge.transfer.prefill.prefill_request import PrefillRequest
from dsa_bridge.transfer.prefill.records import Chunk, DecodeDestination, DecodePeer, KVSender
from dsa_bridge.transfer.prefill.writer import Job, Result, Writer, join_plans, shares
from tests.transfer.fake_backend import FakeBackend
from tests.transfer.helpers import wait_for

PAGES, ITEM, LAYERS = 16, 64, (3, 5, 7)


def make_sender(room: int, *, failed: bool = False) -> KVSender:
    """A request's sender as the writer sees it (no node behind it)."""
    sender = KVSender(None, room, 60.0)
    if failed:
        sender.state.fail("failed before its write", time.monotonic())
    return sender


class Outcomes:
    """Records each outcome; ``raise_first``: the first call fails, as a bookkeeping bug."""

    def __init__(self, results: list[Result], *, raise_first: bool = False):
        self.results = results
        self.raise_first = raise_first

    def finish(self, result: Result) -> None:
        self.results.append(result)
        if self.raise_first and len(self.results) == 1:
            raise ValueError("bookkeeping bug")


class NoChecksums:
    def of_chunk(self, pairs, pages, offset):
        return None


class Side:
    """One side's memory: a buffer of PAGES pages per (layer, kind), registered in an engine."""

    def __init__(self, engine: FakeBackend, fill: int):
        self.engine = engine
        self.memory = {(layer, kind): np.full(PAGES * ITEM, fill, dtype=np.uint8)
                       for layer in LAYERS for kind in ("kv", "index")}
        engine.register([raw_region(a.ctypes.data, a.nbytes) for a in self.memory.values()])

    def buffers(self) -> list[BufferDescriptor]:
        return [BufferDescriptor(layer, kind, a.ctypes.data, a.nbytes, ITEM)
                for (layer, kind), a in self.memory.items()]

    def page(self, layer: int, kind: str, page: int) -> np.ndarray:
        return self.memory[layer, kind][page * ITEM:(page + 1) * ITEM]


class Gate(FakeBackend):
    """A fake engine whose writes to the peers in ``held`` wait for ``release``; records every
    write's peer and descriptor count."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.release = threading.Event()
        self.held: set[str] = set()
        self.entered = threading.Event()
        self.calls: list[tuple[str, int]] = []

    def write(self, peer, src, dst, length, *, timeout_s):
        self.calls.append((peer, len(src)))
        if peer in self.held:
            self.entered.set()
            self.release.wait(10)
        super().write(peer, src, dst, length, timeout_s=timeout_s)


@pytest.fixture
def rig():
    made = []

    def build(**kw):
        engine = Gate(**kw)
        src = Side(engine, 1)
        peers = [Side(FakeBackend(), 0), Side(FakeBackend(), 0)]
        pairs = [[BufferPair(s, d) for s, d in zip(src.buffers(), p.buffers(), strict=True)]
                 for p in peers]
        results: list[Result] = []
        writer = Writer(engine, name="t", timeout_s=5.0, checksums=NoChecksums(),
                        outcomes=Outcomes(results))
        made.append((writer, engine))
        return writer, engine, src, peers, pairs, results

    yield build
    for writer, engine in made:
        engine.release.set()
        writer.close(10)
        engine.close()


def job(sender, peer: Side, pairs, pages, dst, *, last=True) -> Job:
    decode = DecodePeer(b"decode", "decode", peer.engine.id, PairTable(pairs), 0.0)
    destination = DecodeDestination(decode, np.asarray(dst), 0, 0.0)
    return Job(PrefillRequest(sender.room, sender), destination, Chunk(0, np.asarray(pages), last))


def test_jobs_queued_for_one_peer_go_out_in_one_engine_write(rig):
    writer, engine, src, peers, pairs, results = rig()
    engine.held.add(peers[0].engine.id)
    senders = [make_sender(room) for room in range(4)]
    writer.submit(job(senders[0], peers[0], pairs[0], [1], [2]))
    wait_for(engine.entered.is_set, what="the first write held")
    for i, sender in enumerate(senders[1:], start=1):  # queued while the first write runs
        writer.submit(job(sender, peers[0], pairs[0], [2 * i, 2 * i + 1], [3 * i, 3 * i + 1]))
    engine.release.set()
    wait_for(lambda: len(results) == 4, what="every job finished")
    assert [r.job.sender.room for r in results] == [0, 1, 2, 3]
    assert all(r.ok for r in results)
    # one write of the first job (6 buffers x 1 run), one of the other three (6 x 1 run each)
    assert engine.calls == [(peers[0].engine.id, 6), (peers[0].engine.id, 18)]
    assert writer.batches == 2
    assert [(r.batch_index, r.batch_jobs) for r in results] == [(0, 1), (0, 3), (1, 3), (2, 3)]
    for i in range(1, 4):
        for layer in LAYERS:
            for kind in ("kv", "index"):
                assert (peers[0].page(layer, kind, 3 * i) == 1).all()
                assert (peers[0].page(layer, kind, 3 * i + 1) == 1).all()
    assert (peers[0].page(LAYERS[0], "kv", 1) == 0).all()  # never a target: untouched


class OddRoomsStaged:
    """Routes that stage the chunks of odd rooms (recording them) and write nothing for them,
    and record what each direct chunk cost."""

    def __init__(self):
        self.staged: list[int] = []
        self.costs: list[tuple[int, float]] = []

    def route_for(self, peer, plan):
        return "staged" if self.current % 2 else "direct"

    def timed(self, peer, plan, seconds):
        self.costs.append((plan.nbytes, seconds))

    def write(self, peer, room, offset, pages, plan, *, timeout_s, checksums):
        self.staged.append(room)
        return plan, 1, None


def test_a_lane_keeps_the_queue_order_across_routes(rig):
    """Direct jobs queued together go out in one write; a staged job between them splits the
    batch, so each request's chunks, and the outcomes, keep their order."""
    writer, engine, src, peers, pairs, results = rig()
    routes = writer._routes = OddRoomsStaged()
    engine.held.add(peers[0].engine.id)
    routes.current = 0
    writer.submit(job(make_sender(0), peers[0], pairs[0], [1], [1]))
    wait_for(engine.entered.is_set, what="the first write held")
    for room in (2, 4, 5, 6):  # 5 is staged: 2 and 4 in one write, then 5, then 6
        routes.current = room
        writer.submit(job(make_sender(room), peers[0], pairs[0], [room], [room]))
    engine.release.set()
    wait_for(lambda: len(results) == 5, what="every job finished")
    assert [r.job.sender.room for r in results] == [0, 2, 4, 5, 6]
    assert [r.route for r in results] == ["direct"] * 3 + ["staged", "direct"]
    assert [r.slices for r in results] == [0, 0, 0, 1, 0]
    assert routes.staged == [5]
    assert [n for _, n in engine.calls] == [6, 12, 6]
    # each direct chunk's cost told to the routes: its bytes, its share of its batch's write
    direct = [r for r in results if r.route == "direct"]
    assert [n for n, _ in routes.costs] == [r.plan.nbytes for r in direct]
    assert all(s >= r.seconds for (_, s), r in zip(routes.costs, direct, strict=True))
    assert routes.costs[1][1] == pytest.approx(routes.costs[2][1], rel=0.5)  # one batch, halves


def test_a_job_is_planned_when_submitted_while_the_lane_still_writes(rig, monkeypatch):
    writer, engine, src, peers, pairs, results = rig()
    planned_in: list[threading.Thread] = []

    def plan_chunk_recorded(*args, **kw):
        planned_in.append(threading.current_thread())
        return plan_chunk(*args, **kw)

    monkeypatch.setattr(writer_module, "plan_chunk", plan_chunk_recorded)
    engine.held.add(peers[0].engine.id)
    writer.submit(job(make_sender(0), peers[0], pairs[0], [1], [1]))
    wait_for(engine.entered.is_set, what="the first write held")
    for room in (1, 2, 3):
        writer.submit(job(make_sender(room), peers[0], pairs[0], [room + 1], [room + 1]))
    assert planned_in == [threading.current_thread()] * 4  # all of them, before the write ends
    assert not results
    engine.release.set()
    wait_for(lambda: len(results) == 4, what="every job finished")
    assert all(r.ok for r in results) and len(planned_in) == 4


def test_a_failed_batch_fails_every_job_in_it_as_in_flight(rig):
    writer, engine, src, peers, pairs, results = rig(fail_every=2)
    engine.held.add(peers[0].engine.id)
    writer.submit(job(make_sender(0), peers[0], pairs[0], [1], [1]))
    wait_for(engine.entered.is_set, what="the first write held")
    for room in (1, 2, 3):
        writer.submit(job(make_sender(room), peers[0], pairs[0], [room + 1], [room + 1]))
    engine.release.set()
    wait_for(lambda: len(results) == 4, what="every job finished")
    assert results[0].ok and not results[0].in_flight
    failed = results[1:]
    assert [r.job.sender.room for r in failed] == [1, 2, 3]
    assert all(not r.ok and r.in_flight and r.engine_failure for r in failed)
    assert all(r.reason.startswith("engine write failed: mooncake write failed") for r in failed)
    assert [r.batch_index for r in failed] == [0, 1, 2]


def test_a_job_that_cannot_be_planned_fails_alone_before_any_write(rig):
    writer, engine, src, peers, pairs, results = rig()
    engine.held.add(peers[0].engine.id)
    writer.submit(job(make_sender(0), peers[0], pairs[0], [1], [1]))
    wait_for(engine.entered.is_set, what="the first write held")
    writer.submit(job(make_sender(1), peers[0], pairs[0], [2], [PAGES]))  # beyond decode's buffers
    writer.submit(job(make_sender(2), peers[0], pairs[0], [3], [3]))
    engine.release.set()
    wait_for(lambda: len(results) == 3, what="every job finished")
    bad = results[1]
    assert (bad.job.sender.room, bad.ok, bad.in_flight) == (1, False, False)
    assert bad.reason == f"bad pages: dst_pages contains page {PAGES}, beyond the registered {PAGES} pages"
    assert results[2].ok and engine.calls[-1] == (peers[0].engine.id, 6)


def test_a_job_of_a_failed_request_is_skipped(rig):
    writer, engine, src, peers, pairs, results = rig()
    sender = make_sender(0, failed=True)
    writer.submit(job(sender, peers[0], pairs[0], [1], [1]))
    wait_for(lambda: results, what="the job finished")
    assert (results[0].ok, results[0].reason, results[0].in_flight) == (False, "", False)
    assert engine.calls == [] and (peers[0].page(LAYERS[0], "kv", 1) == 0).all()


def test_checksums_come_from_the_checksum_object_before_the_write(rig):
    writer, engine, src, peers, pairs, results = rig()
    asked = []

    class Sums:
        def of_chunk(self, pairs, pages, offset):
            asked.append((len(pairs), pages.tolist(), offset, len(engine.calls)))
            return "sums"

    writer._checksums = Sums()
    writer.submit(job(make_sender(0), peers[0], pairs[0], [4, 5], [6, 7]))
    wait_for(lambda: results, what="the job finished")
    assert asked == [(6, [4, 5], 0, 0)]  # every pair, the chunk's pages, before the write
    assert results[0].ok and results[0].sums == "sums"


def test_a_peer_whose_write_hangs_delays_no_other_peer(rig):
    writer, engine, src, peers, pairs, results = rig()
    engine.held.add(peers[0].engine.id)
    writer.submit(job(make_sender(0), peers[0], pairs[0], [1], [1]))
    wait_for(engine.entered.is_set, what="peer 0's write held")
    for room in range(1, 6):
        writer.submit(job(make_sender(room), peers[1], pairs[1], [room], [room]))
    wait_for(lambda: len(results) == 5, what="peer 1's jobs finished while peer 0 hangs")
    assert all(r.ok and r.job.engine_peer == peers[1].engine.id for r in results)
    assert sorted(writer.lanes()) == sorted(p.engine.id for p in peers)
    engine.release.set()
    wait_for(lambda: len(results) == 6, what="peer 0's job finished")
    assert results[-1].ok and results[-1].job.sender.room == 0


def test_an_idle_lane_ends_its_thread_and_a_new_job_starts_one(rig):
    writer, engine, src, peers, pairs, results = rig()
    writer._idle_s = 0.05
    writer.submit(job(make_sender(0), peers[0], pairs[0], [1], [1]))
    wait_for(lambda: results and not writer.lanes(), what="the lane retired")
    writer.submit(job(make_sender(1), peers[0], pairs[0], [2], [2]))
    wait_for(lambda: len(results) == 2, what="a new lane wrote the job")
    assert results[1].ok


def test_a_closed_writer_refuses_jobs(rig):
    writer, engine, src, peers, pairs, results = rig()
    writer.close(5)
    with pytest.raises(RuntimeError, match="t: the writer is closed"):
        writer.submit(job(make_sender(0), peers[0], pairs[0], [1], [1]))


def test_a_failing_outcome_does_not_stop_the_lane(rig):
    writer, engine, src, peers, pairs, results = rig()
    calls: list[Result] = []
    writer._outcomes = Outcomes(calls, raise_first=True)
    writer.submit(job(make_sender(0), peers[0], pairs[0], [1], [1]))
    writer.submit(job(make_sender(1), peers[0], pairs[0], [2], [2]))
    wait_for(lambda: len(calls) == 2, what="both jobs finished")
    assert all(r.ok for r in calls)


def test_join_plans_and_shares():
    a = Side(FakeBackend(), 0)
    pairs = [BufferPair(b, b) for b in a.buffers()]
    one, two = plan_writes(pairs, [1], [2]), plan_writes(pairs, [3, 4, 9], [5, 6, 10])
    src, dst, length = join_plans([one, two])
    assert np.array_equal(src, np.concatenate([one.src, two.src]))
    assert np.array_equal(length, np.concatenate([one.length, two.length]))
    assert dst.size == one.descriptors + two.descriptors
    assert shares(0.9, [one, two]) == pytest.approx([0.225, 0.675])  # 1 page : 3 pages
