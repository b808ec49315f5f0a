"""The staged route over the real engines (Mooncake and NIXL, both nodes in this process): prefill
gathers a chunk's pages into its staging area, writes it into decode's in one descriptor per slice,
decode scatters it into its pages and frees the slice.

Byte-exact KV, indexer and aux slots on fragmented and one-page-per-descriptor page lists, with
checksums verified after the scatter; a bad page refused before any write; a slice of decode's ring
written again only after decode scattered it (a slow scatter, more slices than the ring holds);
a slice whose write failed kept out of the ring; a failed scatter fails its request and frees its
slice. The same route between processes, chosen by the launcher's ``--route``:
tests/integration/test_two_process.py."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from dsa_bridge.plugin import DSALayout, DSATokenToKVPool
from dsa_bridge.transfer import protocol
from dsa_bridge.transfer.backends import create_backend
from dsa_bridge.transfer.decode import DecodeNode
from dsa_bridge.transfer.decode.scatter import SliceScatter
from dsa_bridge.transfer.launcher.drivers import count_mismatches, fill_request, sentinel_intact
from dsa_bridge.transfer.launcher.page_allocator import PageAllocator
from dsa_bridge.transfer.metrics import stats_metrics
from dsa_bridge.transfer.plan import pair_buffers
from dsa_bridge.transfer.prefill import PrefillNode
from dsa_bridge.transfer.prefill.stager import Stager
from dsa_bridge.transfer.request import KVPoll
from tests.conftest import clear_engine_environment, require_engine
from tests.faulty import FaultyBackend
from tests.transfer.helpers import SMALL_CONFIG, aux_tensors, infos, make_pool, wait_for

LAYOUT_PAGE_BYTES = 4 * (41984 + 8448)  # one page of every buffer of the 4-layer test pool
SLICE = 2 * LAYOUT_PAGE_BYTES  # two pages a slice: a request of 20 pages needs 10 slices


@pytest.fixture(params=["mooncake", "nixl"])
def engine(request, monkeypatch):
    require_engine(request.param)
    clear_engine_environment(monkeypatch)
    return request.param


class Recorder(FaultyBackend):
    """The prefill's engine: records the destination of every write, in order with decode's
    ``SliceFree`` messages (``events``)."""

    def __init__(self, inner, events: list, **kw):
        super().__init__(inner, **kw)
        self.events = events

    def write(self, peer, src, dst, length, *, timeout_s):
        self.events.append(("write", int(dst[0])))
        super().write(peer, src, dst, length, timeout_s=timeout_s)


@pytest.fixture
def nodes(engine):
    made = []

    def build(*, slices=4, decode_slices=2, aux=False, flip_every=0, **prefill_kw):
        events: list = []
        backend = Recorder(create_backend(engine), events, flip_every=flip_every)
        src_aux, dst_aux = (aux_tensors(8), aux_tensors(6, fill=0xA5)) if aux else ([], [])
        prefill = PrefillNode(make_pool(), backend, peer_timeout_s=10.0, heartbeat_s=0.1,
                              route="staged", staging_bytes=slices * SLICE, slice_bytes=SLICE,
                              checksums=True, aux_buffers=infos(src_aux), **prefill_kw)
        made.append(prefill)
        decode = DecodeNode(make_pool(size=64 * 48, sentinel=True), create_backend(engine),
                            prefill.endpoint, peer_timeout_s=10.0, heartbeat_s=0.1, checksums=True,
                            staging_bytes=decode_slices * SLICE, slice_bytes=SLICE,
                            aux_buffers=infos(dst_aux))
        made.append(decode)
        return prefill, decode, backend, (src_aux, dst_aux)

    yield build
    for node in reversed(made):
        node.close()


def run(prefill, decode, room, src, dst, *, chunks=1, aux=None):
    src, dst = np.asarray(src), np.asarray(dst)
    fill_request(prefill.pool, room, src)
    receiver = decode.receiver(room)
    receiver.init(dst, num_tokens=dst.size * 64, aux_index=None if aux is None else aux[1])
    sender = prefill.sender(room)
    sender.init(src.size, aux_index=None if aux is None else aux[0])
    for chunk in np.array_split(src, chunks):
        sender.send(chunk)
    wait_for(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), 60, "request end")
    return sender, receiver


PATTERNS = {
    # both sides from an allocator's shuffled free list, independently
    "fragmented": (PageAllocator(32, seed=3).alloc(20), PageAllocator(48, seed=4).alloc(20)),
    # every page its own descriptor on the direct route
    "per_page": (np.arange(1, 31, 3), np.arange(2, 22, 2)),
}


@pytest.mark.parametrize("pattern", PATTERNS)
def test_staged_requests_land_byte_exact_kv_indexer_and_aux(nodes, pattern):
    prefill, decode, backend, (src_aux, dst_aux) = nodes(aux=True)
    src, dst = PATTERNS[pattern]
    sender, receiver = run(prefill, decode, 1, src, dst, chunks=3, aux=(7, 4))
    assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
    assert count_mismatches(decode.pool, 1, dst) == 0
    assert sentinel_intact(decode.pool, np.setdiff1d(np.arange(1, decode.pool.num_kv_pages), dst))
    for a, b in zip(src_aux, dst_aux, strict=True):
        assert np.array_equal(b[4], a[7])
        assert (np.delete(b, 4, axis=0) == 0xA5).all()
    assert receiver.nbytes == dst.size * LAYOUT_PAGE_BYTES + 64 + 512
    assert receiver.checksums_verified == dst.size * 8
    slices = -(-np.array([c.size for c in np.array_split(src, 3)]) // 2)  # 2 pages a slice
    assert receiver.descriptors == slices.sum() + 2  # one per slice, one per aux slot
    wait_for(lambda: sender.poll() == KVPoll.Success)
    counts = prefill.counters.snapshot()
    assert counts["checksums_computed"] == dst.size * 8  # over the gathered slices
    assert (counts["staged_chunks"], counts["staging_slices"]) == (3, slices.sum())
    assert counts["staging_bytes"] == 4 * SLICE
    decoded = decode.counters.snapshot()
    assert (decoded["staged_chunks"], decoded["staging_slices"]) == (3, slices.sum())
    assert decoded["staging_bytes"] == 2 * SLICE
    families = {f.name: f for f in stats_metrics(prefill.counters.stats(), "prefill")}
    assert {s.labels["route"]: s.value for s in families["dsa_bridge_route_chunks"].samples} == {
        "direct": 0, "staged": 3}
    assert families["dsa_bridge_staging_bytes"].samples[0].value == 4 * SLICE
    assert wait_for(receiver.can_release)


def test_checksums_taken_over_the_slices_catch_a_byte_flipped_on_the_wire(nodes):
    """The page checksums of a staged chunk are taken from its gathered slices; a byte flipped in
    decode's slice after the write still fails the request, naming layer, cache and page."""
    prefill, decode, backend, _ = nodes(flip_every=1)  # the last byte of the slice: its last page
    _, receiver = run(prefill, decode, 6, [3, 4], [5, 6])
    assert receiver.poll() == KVPoll.Failed
    assert "checksum mismatch: layer 3 index cache, page 6 (page 1 of the request)" in str(
        receiver.failure_exception())


def test_a_bad_page_is_refused_before_any_byte_moves(nodes):
    prefill, decode, backend, _ = nodes()
    fill_request(prefill.pool, 2, np.array([3, 4]))
    receiver = decode.receiver(2)
    receiver.init(np.array([5, 6, 7]))
    sender = prefill.sender(2)
    sender.init(3)
    sender.send(np.array([3, 4, 9999]))
    wait_for(lambda: receiver.poll() == KVPoll.Failed, 30, "the refusal")
    assert "bad pages" in str(receiver.failure_exception())
    assert backend.events == []  # no engine write at all
    assert sentinel_intact(decode.pool, np.arange(1, decode.pool.num_kv_pages))


def test_a_slice_is_written_again_only_after_decode_scattered_it(nodes, monkeypatch):
    """Ten slices' worth of pages through a ring of two, each scatter slowed to 50 ms: every
    write into a slice after its first follows decode's SliceFree of it."""
    scatter = SliceScatter._scatter

    def slow(self, peer, receiver, written):
        time.sleep(0.05)
        scatter(self, peer, receiver, written)

    monkeypatch.setattr(SliceScatter, "_scatter", slow)
    prefill, decode, backend, _ = nodes(slices=2, decode_slices=2)
    area = decode.peers[0].staging
    sent = decode._loop.send
    lock = threading.Lock()

    def record(sock, message):
        if type(message).__name__ == "SliceFree":
            with lock:
                backend.events.extend(("free", area.ptr + s * area.slice_bytes)
                                       for s in message.slices)
        sent(sock, message)

    monkeypatch.setattr(decode._loop, "send", record)
    src, dst = PageAllocator(32, seed=5).alloc(20), PageAllocator(48, seed=6).alloc(20)
    _, receiver = run(prefill, decode, 3, src, dst)
    assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
    assert count_mismatches(decode.pool, 3, dst) == 0
    writes, frees = {}, {}
    for kind, address in list(backend.events):
        if kind == "write":
            assert writes.get(address, 0) == frees.get(address, 0), \
                f"slice at {address:#x} written again before decode freed it"
            writes[address] = writes.get(address, 0) + 1
        else:
            frees[address] = frees.get(address, 0) + 1
    assert sum(writes.values()) == 10 and len(writes) == 2


def test_a_failed_write_keeps_its_slice_fenced(nodes):
    prefill, decode, backend, _ = nodes(slices=2, decode_slices=2, write_timeout_s=5.0)
    backend.fail_every = 1
    _, failed = run(prefill, decode, 4, [3, 4], [5, 6])
    assert failed.poll() == KVPoll.Failed
    assert "injected failure" in str(failed.failure_exception())
    ring = next(iter(prefill._stager._rings.values()))
    (fenced, until), = ring.fenced.items()
    assert until > time.monotonic() + 5.0  # the write timeout and a margin
    backend.fail_every = 0
    area = decode.peers[0].staging
    backend.events.clear()
    src, dst = PageAllocator(32, seed=7).alloc(8), PageAllocator(48, seed=8).alloc(8)
    _, receiver = run(prefill, decode, 5, src, dst)
    assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
    assert count_mismatches(decode.pool, 5, dst) == 0
    targets = {address for _, address in backend.events}
    assert targets == {area.ptr + (1 - fenced) * area.slice_bytes}  # never the fenced slice
    assert ring.fenced == {fenced: until}


def test_a_failed_scatter_fails_its_request_and_still_frees_its_slice(nodes, monkeypatch):
    """The scatter thread hands a failed copy forward to the request, which fails naming it and
    holds no scatter; the slice is freed all the same: the next request, ten slices through a
    ring of two, succeeds."""
    from dsa_bridge.transfer.decode import scatter as scatter_module

    copy, calls = scatter_module.scatter, []

    def failing_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("scatter bug")
        copy(*args)

    monkeypatch.setattr(scatter_module, "scatter", failing_once)
    prefill, decode, _, _ = nodes(slices=2, decode_slices=2)
    _, failed = run(prefill, decode, 6, [3, 4], [5, 6])
    assert failed.poll() == KVPoll.Failed
    assert "internal error scattering a staged slice: RuntimeError: scatter bug" in \
        failed.state.reason
    wait_for(failed.can_release, 30, "the failed request's pages released",
             detail=lambda: f"scatters {failed.scatters}, fence {failed.fence.outstanding}")
    assert failed.scatters == 0
    src, dst = PageAllocator(32, seed=9).alloc(20), PageAllocator(48, seed=10).alloc(20)
    _, receiver = run(prefill, decode, 7, src, dst)
    assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
    assert count_mismatches(decode.pool, 7, dst) == 0


@pytest.mark.gpu
def test_gather_runs_on_the_pool_device():
    """A CUDA pool's pages are gathered into a CUDA staging area, buffer-major."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pool = DSATokenToKVPool.from_layout(DSALayout.from_hf_config(SMALL_CONFIG), 64 * 32,
                                        device="cuda")
    fill_request(pool, 1, np.array([7, 2]))
    stager = Stager(pool, None, None, route="staged", staging_bytes=4 * SLICE, slice_bytes=SLICE)
    pairs = pair_buffers(pool.buffer_descriptors(), pool.buffer_descriptors())
    nbytes = stager._gather(1, pairs, np.array([7, 2]))
    area = stager._area[SLICE:SLICE + nbytes]
    assert area.is_cuda and nbytes == 2 * LAYOUT_PAGE_BYTES
    index = torch.tensor([7, 2], device="cuda")
    expected = torch.cat([pool.page_view(p.src.layer_id, p.src.kind).index_select(0, index).flatten()
                          for p in pairs])
    assert torch.equal(area, expected)


def test_a_pool_without_page_views_stages_nothing_unless_asked():
    """SGLang's buffer infos alone (a ``BufferSet``) show no pages to gather: no staging area by
    default, a clear error naming the option when one is asked for."""
    from dsa_bridge.plugin.descriptors import BufferSet
    from dsa_bridge.transfer.slices import staging_for
    from dsa_bridge.transfer.staging import StagingError

    pool = make_pool()
    buffers = BufferSet.from_buf_infos(pool.layout, pool.get_contiguous_buf_infos(),
                                       pool.kv_layer_ids, pool.get_state_buf_infos(),
                                       pool.state_layer_ids)
    assert staging_for(buffers, None) == 0 and staging_for(pool, None) is None
    with pytest.raises(StagingError, match="set staging_bytes=0"):
        staging_for(buffers, 1 << 20)


def test_decode_refuses_a_slice_report_outside_its_share_or_the_request():
    """A SliceWritten naming a slice beyond the prefill's share, or pages beyond the request or
    more than a slice holds, is a protocol error: nothing is scattered."""
    from dsa_bridge.transfer import protocol
    from tests.transfer.fake_backend import FakeBackend

    with PrefillNode(make_pool(), FakeBackend(), heartbeat_s=0.1) as prefill, \
            DecodeNode(make_pool(size=64 * 24, sentinel=True), FakeBackend(), prefill.endpoint,
                       heartbeat_s=0.1, staging_bytes=2 * SLICE, slice_bytes=SLICE) as decode:
        peer = decode.peers[0]
        receiver = decode.receiver(1)
        receiver.init([2, 3, 4])
        for bad, match in [((1, 2, 0, 1), "not one of prefill"), ((1, 0, 2, 2), "does not fit"),
                           ((1, 0, 0, 3), "does not fit"), ((1, -1, 0, 1), "not one of")]:
            with decode._lock, pytest.raises(protocol.ProtocolError, match=match):
                decode._scatter.slice_written_locked(peer, receiver, protocol.SliceWritten(*bad))
        assert receiver.scatters == 0
        assert sentinel_intact(decode.pool, np.arange(1, decode.pool.num_kv_pages))


def test_auto_times_each_route_then_weighs_them(nodes):
    """On ``auto`` a new node's first chunks of a size class go direct twice, then staged twice
    (``route_costs.MIN_SAMPLES``); each is timed into the decode node's route costs (direct: its
    engine write; staged: until decode freed its last slice), byte-exact either way."""
    prefill, decode, backend, _ = nodes(slices=4, decode_slices=4)
    prefill.route = "auto"
    src, dst = PATTERNS["per_page"]  # 10 pages, each its own descriptor: 5 chunks of 2
    sender, receiver = run(prefill, decode, 1, src, dst, chunks=5)
    assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
    assert count_mismatches(decode.pool, 1, dst) == 0
    (costs,) = prefill._stager._costs.values()  # one decode engine peer
    (chunks,) = costs.classes.values()  # one size class: one page per descriptor
    staged = chunks.chosen["staged"]
    assert chunks.chosen["direct"] + staged == 5 and chunks.chosen["direct"] >= 2
    assert staged in (2, 3)  # the fifth: the cheaper if both were timed when it was planned
    assert receiver.descriptors == (5 - staged) * 2 * 8 + staged  # staged: 1 slice of 2 pages
    assert decode.counters.snapshot()["staged_chunks"] == staged
    wait_for(lambda: None not in costs.per_byte(16, 2 * LAYOUT_PAGE_BYTES).values(), 10,
             "both routes timed")
    assert all(v > 0 for v in costs.per_byte(16, 2 * LAYOUT_PAGE_BYTES).values())


def test_messages_behind_a_slice_wait_for_it_and_run_on_the_control_thread(nodes, monkeypatch):
    """A chunk report that arrives while a slice before it is being scattered waits for that
    scatter, then is handled on decode's control thread, never on the scatter thread; one refused
    there (a room decode does not know) is counted as the control loop counts its own."""
    prefill, decode, _, _ = nodes()
    entered, gate, threads = threading.Event(), threading.Event(), []
    real_scatter, real_chunk = SliceScatter._scatter, decode._on_chunk_locked

    def gated(self, peer, receiver, written):
        entered.set()
        gate.wait(20)
        return real_scatter(self, peer, receiver, written)

    def chunk(peer, done, now):
        threads.append(threading.current_thread().name)
        real_chunk(peer, done, now)

    monkeypatch.setattr(SliceScatter, "_scatter", gated)
    monkeypatch.setattr(decode, "_on_chunk_locked", chunk)
    src, dst = np.arange(1, 5), np.arange(3, 7)
    fill_request(prefill.pool, 1, src)
    receiver = decode.receiver(1)
    receiver.init(dst, num_tokens=dst.size * 64)
    sender = prefill.sender(1)
    sender.init(src.size)
    try:
        sender.send(src)
        assert entered.wait(20), "no slice reached the scatter"
        peer = next(iter(prefill._sessions.peers.values()))
        prefill._loop.send(prefill._socket, protocol.ChunkDone(12345, 0, ok=True, last=True),
                           peer.identity)
        wait_for(lambda: decode._scatter.holding, 10, "the unknown room's report held")
        assert decode._loop.bad_messages == 0 and receiver.poll() != KVPoll.Success
    finally:
        gate.set()
    wait_for(lambda: decode._loop.bad_messages == 1, 20, "the held report refused and counted",
             detail=lambda: f"bad={decode._loop.bad_messages} error={decode._loop.last_error!r}")
    assert "unknown room 12345" in decode._loop.last_error
    wait_for(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), 20, "request end")
    assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
    assert count_mismatches(decode.pool, 1, dst) == 0
    assert threads and all(name.endswith("-control") for name in threads), threads
