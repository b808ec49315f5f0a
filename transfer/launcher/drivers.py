"""The two long-lived node roles the launcher runs, with a stand-in for the model.

``serve_prefill`` answers every room a decode node announces as if it had just computed it: it
allocates fragmented pages, fills every layer of both caches with the deterministic pattern of
``launcher/page_pattern.py`` (the stand-in for the model's forward pass, timed in a ``PrefillReport``) and
sends them in chunks. ``drive_decode`` issues requests of varied lengths (or the rooms and
lengths of a prefill's answers: ``dsa-bridge decode --rooms``), keeps several in flight, and
checks every received byte of every layer against the same pattern, and that pages no request
owns still hold the sentinel.
"""

from __future__ import annotations

import collections
import logging
import math
import queue
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..decode import DecodeNode, KVReceiver
from ..prefill import IncomingRequest, PrefillNode
from ..request import KVPoll
from .page_allocator import PageAllocator
from .page_pattern import SENTINEL, expected_pages
from .summary import busy_seconds, gbps

log = logging.getLogger(__name__)

def page_views(pool, keys=None) -> list[tuple[int, str, torch.Tensor]]:
    """(layer id, kind, (pages, item_len) uint8 view) for every buffer the pool holds, or for
    the (layer, kind) ``keys`` only."""
    return [(layer, kind, pool.page_view(layer, kind))
            for layer, kind in (pool.buffer_keys() if keys is None else keys)]


def fill_request(pool, room: int, pages: np.ndarray, positions: np.ndarray | None = None) -> None:
    """Write the request's pattern into ``pages``: the request's pages in order, or (a share
    of them) its pages ``positions``."""
    index = torch.from_numpy(np.asarray(pages, dtype=np.int64))
    order = np.arange(index.numel()) if positions is None else np.asarray(positions, dtype=np.int64)
    for layer, kind, view in page_views(pool):
        view.index_copy_(0, index, expected_pages(room, layer, kind, order, view.shape[1]))


def count_mismatches(pool, room: int, pages: np.ndarray, keys=None) -> int:
    """Bytes of the request's pages that differ from what the request should have left there:
    the pattern in the buffers it filled (``keys``; default every buffer), the sentinel in the
    buffers it did not (a decode that holds an indexer it does not read gets none)."""
    index = torch.from_numpy(pages)
    order = np.arange(pages.size)
    filled = set(pool.buffer_keys() if keys is None else keys)
    bad = 0
    for layer, kind, view in page_views(pool):
        got = view.index_select(0, index)
        if (layer, kind) in filled:
            want = expected_pages(room, layer, kind, order, view.shape[1])
        else:
            want = torch.full_like(got, SENTINEL)
        if not torch.equal(got, want):
            bad += int((got != want).sum())
    return bad


def reset_pages(pool, pages: np.ndarray) -> None:
    index = torch.from_numpy(pages)
    for _, _, view in page_views(pool):
        view.index_fill_(0, index, SENTINEL)


def sentinel_intact(pool, pages: np.ndarray) -> bool:
    """True when every byte of ``pages`` (all layers, both caches) still holds the sentinel."""
    if pages.size == 0:
        return True
    index = torch.from_numpy(pages)
    return all(bool((view.index_select(0, index) == SENTINEL).all())
               for _, _, view in page_views(pool))


def request_bytes(pool, num_pages: int, keys=None) -> int:
    """Bytes a request of ``num_pages`` fills in the (layer, kind) ``keys`` (default: all)."""
    return num_pages * sum(view.shape[1] for _, _, view in page_views(pool, keys))


def chunks_of(pages: np.ndarray, chunk_pages: int) -> list[np.ndarray]:
    return [pages[i:i + chunk_pages] for i in range(0, pages.size, chunk_pages)]


@dataclass
class PrefillReport:
    """What the stand-in model did: requests filled, their bytes, the seconds filling took, and,
    when ``ready_at`` is a dict, the ``time.monotonic()`` at which each room's pages were ready
    (filled; the chunks are handed to the node right after)."""

    requests: int = 0
    fill_bytes: int = 0
    fill_seconds: float = 0.0
    ready_at: dict[int, float] | None = None

    @property
    def fill_gbps(self) -> float:
        return self.fill_bytes / self.fill_seconds / 1e9 if self.fill_seconds > 0 else 0.0


def serve_prefill(node: PrefillNode, stop: threading.Event, *, chunk_pages: int = 64,
                  seed: int = 1, report: PrefillReport | None = None) -> PrefillReport:
    """Answer announced rooms until ``stop`` is set; ``report`` (or a new one, returned) gets
    the stand-in's fill times as they happen."""
    if chunk_pages < 1:
        raise ValueError(f"chunk_pages must be >= 1, got {chunk_pages}")
    report = PrefillReport() if report is None else report
    allocator = PageAllocator(node.pool.num_kv_pages, seed=seed)
    waiting: collections.deque[IncomingRequest] = collections.deque()
    active = []
    while not stop.is_set():
        try:
            waiting.append(node.incoming.get(timeout=0.005))
        except queue.Empty:
            pass
        while waiting:
            room = waiting[0]
            sender = None
            if room.num_pages > allocator.capacity:
                waiting.popleft()
                sender = node.sender(room.room)
                sender.abort(f"request needs {room.num_pages} pages; the prefill pool has "
                             f"{allocator.capacity}")
                continue
            pages = allocator.alloc(room.num_pages)
            if pages is None:
                break
            waiting.popleft()
            started = time.monotonic()
            fill_request(node.pool, room.room, pages)
            ready = time.monotonic()
            report.requests += 1
            report.fill_bytes += request_bytes(node.pool, pages.size)
            report.fill_seconds += ready - started
            if report.ready_at is not None:
                report.ready_at[room.room] = ready
            sender = node.sender(room.room)
            sender.init(pages.size)
            for chunk in chunks_of(pages, chunk_pages):
                sender.send(chunk)
            active.append((sender, pages))
        still = []
        for sender, pages in active:
            if sender.can_release():
                allocator.free(pages)
            else:
                still.append((sender, pages))
        active = still
    return report


@dataclass
class DecodeReport:
    requests: int
    requests_ok: int = 0
    requests_failed: int = 0
    bytes_verified: int = 0
    bytes_mismatched: int = 0
    failures: list[str] = field(default_factory=list)
    sentinel_intact: bool = True
    seconds: float = 0.0
    times: dict[int, tuple[float, float]] = field(default_factory=dict)  # room: (init, Success)
    engine_seconds: float = 0.0
    verify_seconds: float = 0.0  # checking received bytes, refilling released pages' sentinel

    @property
    def request_seconds(self) -> float:
        """Wall time during which at least one verified request was between ``init`` (decode
        sent its pages) and Success (the last chunk's report arrived): prefill's time to
        produce the pages included."""
        return busy_seconds(self.times.values())

    @property
    def request_gbps(self) -> float:
        return gbps(self.bytes_verified, self.request_seconds)

    @property
    def engine_gbps(self) -> float:
        return gbps(self.bytes_verified, self.engine_seconds)

    @property
    def verify_gbps(self) -> float:
        return gbps(self.bytes_verified, self.verify_seconds)

    @property
    def ok(self) -> bool:
        return (self.requests_ok == self.requests and self.bytes_mismatched == 0
                and self.sentinel_intact)


def request_lengths(count: int, page_size: int, max_tokens: int, seed: int) -> list[int]:
    """Varied prompt lengths: a few one-page prompts, mostly hundreds to thousands of tokens, a
    few long ones; capped at ``max_tokens``."""
    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(np.log(16), np.log(max(max_tokens, 32)), size=count))
    lengths = np.clip(lengths.astype(np.int64), 1, max_tokens)
    lengths[: min(count, 2)] = [1, page_size][: min(count, 2)]
    return [int(x) for x in rng.permutation(lengths)]


def release_settled(node: DecodeNode, allocator: PageAllocator,
                    held: list[tuple[KVReceiver, np.ndarray]]) -> None:
    """Hand back the pages of every finished request that no write can still land in (invariant
    8): refilled with the sentinel, returned to the allocator, the receiver forgotten."""
    for receiver, pages in [h for h in held if h[0].can_release()]:
        reset_pages(node.pool, pages)
        allocator.free(pages)
        node.forget(receiver)
        held.remove((receiver, pages))


def drive_decode(node: DecodeNode, lengths: list[int], *, concurrency: int = 4, seed: int = 2,
                 room_base: int = 0, rooms: list[int] | None = None, deadline_s: float = 600.0,
                 progress: bool = True, stop: threading.Event | None = None) -> DecodeReport:
    """Run every request through the node, verify every byte, and report. Request i is room
    ``rooms[i]`` (a prefill's answers) or, without ``rooms``, ``room_base + i``. Once ``stop``
    is set, no further request starts: those in flight finish, and the report counts the ones
    issued."""
    if rooms is not None and len(rooms) != len(lengths):
        raise ValueError(f"{len(rooms)} rooms for {len(lengths)} requests")
    pool = node.pool
    allocator = PageAllocator(pool.num_kv_pages, seed=seed)
    report = DecodeReport(requests=len(lengths))
    pending = collections.deque(enumerate(lengths))
    active: dict[int, tuple[KVReceiver, np.ndarray]] = {}
    held: list[tuple[KVReceiver, np.ndarray]] = []
    start = time.monotonic()
    next_progress = start + 1.0
    while (pending or active or held) and time.monotonic() - start < deadline_s:
        if stop is not None and stop.is_set() and pending:
            report.requests -= len(pending)  # never issued
            pending.clear()
        while pending and len(active) < concurrency:
            index, tokens = pending[0]
            pages = allocator.alloc(math.ceil(tokens / pool.page_size))
            if pages is None:
                break
            pending.popleft()
            receiver = node.receiver(room_base + index if rooms is None else rooms[index])
            receiver.init(pages, tokens)
            active[receiver.room] = (receiver, pages)
        for room, (receiver, pages) in list(active.items()):
            status = receiver.poll()
            if status == KVPoll.Success:
                checking = time.monotonic()
                bad = count_mismatches(pool, room, pages, receiver.components)
                report.verify_seconds += time.monotonic() - checking
                report.bytes_mismatched += bad
                report.bytes_verified += request_bytes(pool, pages.size, receiver.components)
                report.requests_ok += bad == 0
                report.requests_failed += bad != 0
                report.times[room] = (receiver.started_at, receiver.state.finished_at)
                report.engine_seconds += receiver.write_seconds
                if bad:
                    report.failures.append(f"room {room}: {bad} bytes differ")
            elif status == KVPoll.Failed:
                report.requests_failed += 1
                report.failures.append(str(receiver.failure_exception()))
            else:
                continue
            del active[room]
            held.append((receiver, pages))
        releasing = time.monotonic()
        release_settled(node, allocator, held)
        now = time.monotonic()
        report.verify_seconds += now - releasing
        if progress and now >= next_progress:
            next_progress = now + 1.0
            print(f"[decode] {report.requests_ok}/{report.requests} ok, {report.requests_failed} "
                  f"failed, {report.bytes_verified / 1e9:.2f} GB verified", file=sys.stderr,
                  flush=True)
        time.sleep(0.001)
    report.seconds = time.monotonic() - start
    for room, (receiver, _) in active.items():
        receiver.abort("decode run deadline passed")
        report.requests_failed += 1
        report.failures.append(f"room {room}: no result within {deadline_s:.0f}s")
    if pending:
        report.requests_failed += len(pending)
        report.failures.append(f"{len(pending)} requests never started within {deadline_s:.0f}s")
    report.sentinel_intact = sentinel_intact(pool, allocator.free_list())
    return report
