"""The prefill side of the staged route: this node's staging area, the rings of decode's staging
slices, the route of each chunk, and the staged write of a chunk.

``Stager`` owns one registered staging area on the pool's device (``staging.staging_size``:
a ring of slices, registered with the node's other regions at start) and, for each staging area a
decode node offered (``protocol.StagingArea``, keyed by its engine peer and address), the ring of
that area's slices as prefill allocates them. ``route_for`` decides a chunk's route when the
writer plans it: the node's forced route, or on ``auto`` the route that has cost less into that
decode node for chunks of its size class (``route_costs.RouteCosts``, one per decode engine peer,
from the direct writes' times the writer reports, ``timed``, and each staged chunk's time from
the start of its write to decode freeing its last slice); direct whenever either side has no
staging, or one page of every buffer does not fit a slice (a forced staged route not taken is
logged once per decode node).

``write`` sends one chunk on the staged route, in the writer lane's thread. For each group of its
pages that fills a slice (``staging.slice_groups``): take a slice of this node's area, gather the
group's pages of every buffer into it (``slices.gather``, on the pool's device, in the gather
thread: the next group's gather runs while this group is written, when a local slice is free),
take one of decode's (waiting, within the write's timeout, for decode to free one), write the
local slice into it in one engine descriptor (the last group carries the chunk's aux slots as
their own descriptors, straight into decode's aux slots), and send ``SliceWritten`` so that
decode scatters it. With checksums on, each slice's page checksums are taken over it as it is
gathered (``ChunkChecksums.of_slice``), off the lane's thread. Decode's ``SliceFree``
(``slices_freed``, control thread) returns a slice to its ring. A slice whose write failed stays
out of its ring for ``fence_s`` (its bytes may still land; a later write into it could otherwise
be overwritten before decode scatters it).

Every page was bounds-checked on both sides when the chunk was planned (``plan.plan_chunk``),
before any byte moves; the staged write uses only the page ids of that plan.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np
import torch

from ...plugin.descriptors import BufferDescriptor, raw_region
from .. import protocol
from ..backends.base import BackendError, TransferBackend
from ..plan import PairTable, WritePlan
from ..route_costs import RouteCosts
from ..slices import gather, page_index, staging_for
from ..staging import (
    DIRECT,
    STAGED,
    SliceRing,
    StagingError,
    check_route,
    slice_groups,
    slice_offsets,
    staging_size,
)
from .checksums import ChunkChecksums
from .records import DecodePeer

log = logging.getLogger(__name__)

Send = Callable[[protocol.Message, bytes], None]


class StagingTimeout(BackendError):
    """No staging slice became free within the write's timeout."""


class _StagedTiming:
    """One staged chunk's clock: from the start of its write to decode freeing its last slice
    (``left``: slices written and not freed yet; ``written``: the write returned)."""

    def __init__(self, started: float, plan: WritePlan):
        self.started, self.plan = started, plan
        self.left = 0
        self.written = False


class Stager:
    """This node's staging area, decode's slice rings, and staged writes (module docstring)."""

    def __init__(self, pool, backend: TransferBackend, send: Send, *, route: str = "auto",
                 staging_bytes: int | None = None, slice_bytes: int | None = None,
                 fence_s: float = 35.0):
        pool_bytes = sum(b.nbytes for b in pool.buffer_descriptors())
        self.nbytes, self.slice_bytes = staging_size(staging_for(pool, staging_bytes), pool_bytes,
                                                     slice_bytes)
        self.route = check_route(route)
        self.fence_s = fence_s
        self._pool = pool
        self._backend = backend
        self._send = send
        self._area = torch.empty(self.nbytes, dtype=torch.uint8, device=pool.device) \
            if self.nbytes else None
        self._local = SliceRing(self.nbytes // self.slice_bytes) if self.nbytes else None
        self._rings: dict[tuple[str, int], SliceRing] = {}
        self._changed = threading.Condition()
        self._views: dict | None = None
        self._gathers = ThreadPoolExecutor(1, thread_name_prefix="stager-gather")
        self._fell_back: set[str] = set()  # engine peers told of a forced route not taken
        self._costs: dict[str, RouteCosts] = {}  # per decode engine peer
        self._timings: dict[tuple[tuple[str, int], int], _StagedTiming] = {}  # by decode slice

    def regions(self) -> list[BufferDescriptor]:
        """The staging area to register with the engine (none when staging is off)."""
        if self._area is None:
            return []
        return [raw_region(self._area.data_ptr(), self.nbytes, str(self._area.device))]

    def route_for(self, peer: DecodePeer, plan: WritePlan) -> str:
        """The route of a chunk planned as ``plan`` into ``peer``; a forced staged route that
        cannot be taken is logged once per decode node (``_fall_back``)."""
        area = peer.staging
        if self.route == DIRECT:
            return DIRECT
        if self._area is None:
            return self._fall_back(peer, "this node has no staging area (--staging-mib 0)")
        if area is None:
            return self._fall_back(peer, "it offered no staging area (its --staging-mib is 0)")
        if int(peer.pairs.item_len.sum()) > min(self.slice_bytes, area.slice_bytes):
            return self._fall_back(peer, f"one page of every buffer "
                                   f"({int(peer.pairs.item_len.sum())} bytes) does not fit a "
                                   f"staging slice ({min(self.slice_bytes, area.slice_bytes)} "
                                   f"bytes; raise --staging-mib)")
        if self.route == STAGED:
            return STAGED
        with self._changed:
            return self.costs(peer.engine_peer).choose(plan.descriptors, plan.nbytes)

    def costs(self, engine_peer: str) -> RouteCosts:
        """The routes' costs into one decode engine peer (the caller holds ``_changed``)."""
        costs = self._costs.get(engine_peer)
        if costs is None:
            costs = self._costs[engine_peer] = RouteCosts()
        return costs

    def timed(self, peer: DecodePeer, plan: WritePlan, seconds: float) -> None:
        """A chunk planned as ``plan`` was written direct into ``peer`` in ``seconds`` (the
        writer's lane)."""
        with self._changed:
            self.costs(peer.engine_peer).observe(DIRECT, plan.descriptors, plan.nbytes, seconds)

    def _staged_done(self, peer: DecodePeer, timing: _StagedTiming, now: float) -> None:
        """A staged chunk's last slice is free and its write returned (holding ``_changed``)."""
        self.costs(peer.engine_peer).observe(STAGED, timing.plan.descriptors, timing.plan.nbytes,
                                             max(0.0, now - timing.started))

    def _fall_back(self, peer: DecodePeer, why: str) -> str:
        """The direct route, where the staged one cannot be taken: logged once per decode node
        (its engine peer) when the staged route is forced."""
        if self.route == STAGED:
            with self._changed:
                first = peer.engine_peer not in self._fell_back
                self._fell_back.add(peer.engine_peer)
            if first:
                log.warning("route staged forced, but chunks to decode node %s go direct: %s",
                            peer.node, why)
        return DIRECT

    # ---- the writer lane's thread -----------------------------------------------------------

    def write(self, peer: DecodePeer, room: int, offset: int, pages: np.ndarray, plan: WritePlan,
              *, timeout_s: float, checksums: ChunkChecksums | None = None
              ) -> tuple[WritePlan, int, protocol.PageChecksums | None]:
        """Stage a chunk (``pages``, the first at ``offset`` of its request, planned as ``plan``)
        into ``peer``: the descriptors written, the slices filled, and the pages' checksums taken
        over the gathered slices when ``checksums`` are on. Raises BackendError, or ChecksumError
        before any write."""
        sums = checksums if checksums is not None and checksums.enabled else None
        if sums is not None:
            sums.check_size(pages.size, len(peer.pairs))
        area = peer.staging
        pairs = peer.pairs
        page_bytes = int(pairs.item_len.sum())
        size = min(self.slice_bytes, area.slice_bytes)
        try:
            groups = slice_groups(pages.size, page_bytes, size)
        except StagingError as exc:
            raise BackendError(self._backend.name, "write", str(exc), peer=peer.engine_peer) from exc
        ring = self._ring(peer)
        started = time.monotonic()
        deadline = started + timeout_s
        timing = _StagedTiming(started, plan)
        written: list[tuple[np.ndarray, ...]] = []
        parts: list[np.ndarray] = []
        gathering: tuple[int, Future] | None = None
        try:
            for number, (start, count) in enumerate(groups):
                if gathering is None:
                    local = self._take(self._local, deadline, "this node's", peer.engine_peer)
                    gathering = local, self._gathers.submit(self._gather, local, pairs,
                                                            pages[start:start + count], sums)
                local, gathered = gathering
                gathering = None
                try:
                    nbytes, values = gathered.result()
                    parts.append(values)
                    if number + 1 < len(groups):  # the next gather overlaps this write
                        gathering = self._prefetch(pairs, pages, groups[number + 1], sums)
                    remote = self._take(ring, deadline, "decode's", peer.engine_peer)
                    arrays = self._slice_write(peer, local, remote, nbytes, deadline,
                                               plan if number == len(groups) - 1 else None)
                finally:
                    self._release(local)
                written.append(arrays)
                with self._changed:  # before decode can free it
                    self._timings[self._ring_key(peer), remote] = timing
                    timing.left += 1
                self._send(protocol.SliceWritten(room, remote, offset + start, count),
                           peer.identity)
        except BaseException:
            with self._changed:  # a failed chunk's time says nothing of the route's cost
                for key in [k for k, t in self._timings.items() if t is timing]:
                    del self._timings[key]
            raise
        finally:
            if gathering is not None:  # a write failed: let its next gather end first
                wait([gathering[1]])
                self._release(gathering[0])
        with self._changed:
            timing.written = True
            if timing.left == 0:  # decode freed every slice already
                self._staged_done(peer, timing, time.monotonic())
        joined = [np.concatenate([w[i] for w in written]) for i in range(3)]
        packed = sums.packed(pairs, parts, offset) if sums is not None else None
        return WritePlan(*joined, runs=plan.runs), len(groups), packed

    def _slice_write(self, peer: DecodePeer, local: int, remote: int, nbytes: int,
                     deadline: float, last: WritePlan | None) -> tuple[np.ndarray, ...]:
        """Write local slice ``local`` into decode's slice ``remote`` (with ``last``, the plan of
        a chunk's last group, its aux slots' descriptors too); a failure fences ``remote``."""
        area = peer.staging
        src = [self._area.data_ptr() + local * self.slice_bytes]
        arrays = tuple(np.array(v, dtype=np.uint64)
                       for v in (src, [area.ptr + remote * area.slice_bytes], [nbytes]))
        if last is not None:
            aux = slice(last.runs * len(peer.pairs), None)  # after the pages' descriptors
            arrays = tuple(np.concatenate((a, getattr(last, key)[aux]))
                           for a, key in zip(arrays, ("src", "dst", "length"), strict=True))
        try:
            self._backend.write(peer.engine_peer, *arrays,
                                timeout_s=max(1e-3, deadline - time.monotonic()))
        except BaseException:
            with self._changed:
                self._ring(peer).fence(remote, time.monotonic() + self.fence_s)
            raise
        return arrays

    def _prefetch(self, pairs: PairTable, pages: np.ndarray, group: tuple[int, int],
                  sums: ChunkChecksums | None) -> tuple[int, Future] | None:
        """The gather of ``group`` started into a free local slice; None if none is free now."""
        with self._changed:
            local = self._local.take(time.monotonic())
        if local is None:
            return None
        start, count = group
        return local, self._gathers.submit(self._gather, local, pairs, pages[start:start + count],
                                           sums)

    def _release(self, local: int) -> None:
        with self._changed:
            self._local.release(local)
            self._changed.notify_all()

    def _take(self, ring: SliceRing, deadline: float, whose: str, engine_peer: str) -> int:
        with self._changed:
            while True:
                index = ring.take(time.monotonic())
                if index is not None:
                    return index
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StagingTimeout(self._backend.name, "write", f"no staging slice of "
                                         f"{whose} became free in time", peer=engine_peer)
                self._changed.wait(min(left, 0.1))  # also for a fence that lifts meanwhile

    def _gather(self, local: int, pairs: PairTable, pages: np.ndarray,
                sums: ChunkChecksums | None) -> tuple[int, np.ndarray | None]:
        """Copy ``pages`` of every source buffer into local slice ``local``: its bytes, and with
        ``sums`` the checksums of the gathered pages (``ChunkChecksums.of_slice``)."""
        if self._views is None:
            self._views = {(d.layer_id, d.kind): self._pool.page_view(d.layer_id, d.kind)
                           for d in self._pool.buffer_descriptors()}
        index = page_index(pages, self._area.device)
        offsets = slice_offsets(pairs.item_len, pages.size) + local * self.slice_bytes
        for i, pair in enumerate(pairs):
            gather(self._views[pair.src.layer_id, pair.src.kind], index, self._area, int(offsets[i]))
        if self._area.is_cuda:  # the engine reads the slice once the gather has run
            torch.cuda.current_stream(self._area.device).synchronize()
        values = sums.of_slice(self._area, offsets, pages.size) if sums is not None else None
        return int(offsets[-1] - offsets[0]), values

    def close(self) -> None:
        """End the gather thread (after the writer's lanes)."""
        self._gathers.shutdown(wait=True)

    # ---- decode's answers (control thread) --------------------------------------------------

    def slices_freed(self, peer: DecodePeer, slices: list[int]) -> None:
        """Decode scattered ``slices`` of the area it offered ``peer``'s epoch."""
        if peer.staging is None:
            raise protocol.ProtocolError("SliceFree from a decode node that offered no staging")
        ring, key = self._ring(peer), self._ring_key(peer)
        now = time.monotonic()
        with self._changed:
            for index in slices:
                if index in ring.in_use:  # (a fenced slice stays fenced)
                    ring.release(index)
                timing = self._timings.pop((key, index), None)
                if timing is not None:
                    timing.left -= 1
                    if timing.left == 0 and timing.written:
                        self._staged_done(peer, timing, now)
            self._changed.notify_all()

    @staticmethod
    def _ring_key(peer: DecodePeer) -> tuple[str, int]:
        return peer.engine_peer, peer.staging.ptr

    def _ring(self, peer: DecodePeer) -> SliceRing:
        key = self._ring_key(peer)
        with self._changed:
            ring = self._rings.get(key)
            if ring is None or ring.count != peer.staging.slices:
                ring = self._rings[key] = SliceRing(peer.staging.slices)
            return ring

