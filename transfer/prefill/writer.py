"""The prefill node's writer: one lane per decode engine peer, each writing its queued chunks in
one engine write.

The node's request book (``requests.RequestBook``) hands the writer a ``Job`` per chunk a
request is ready to send: the request (its ``PrefillRequest``, with its ``KVSender``), where
decode wants it (``DecodeDestination``: the decode node's engine peer and buffer pairs, decode's
page ids and aux slot) and the chunk (its offset among the request's pages, the prefill page ids,
whether it is the last). Jobs queue per engine peer: each peer has its own lane and thread, so a
frozen, silent or slow decode node delays only the chunks queued for it, never another node's.

``submit`` plans a job in the caller's thread (``plan.plan_chunk``), so that planning the next
chunks overlaps the engine write in flight instead of holding up the next one. A lane takes every
job queued for its peer, skips those whose request has failed meanwhile and those that could not
be planned (each fails alone, before any write), takes their page checksums from ``checksums``
(None when they are off), concatenates the plans and submits them as one engine write; the
backend splits it only where the engine's batch limits require. When that write fails, every
request in the batch fails as in flight: any of its bytes may still land. Each job's outcome (a
``Result``, which carries the job and so its request) goes forward to ``outcomes.finish``, in the
lane's thread, in queue order, exactly once; until then the request counts the job in
``KVSender.busy``. The writer calls nothing else of the node:
``checksums`` is a ``checksums.ChunkChecksums`` and ``outcomes`` a
``outcomes.ChunkReporter``.

Each job also gets its route when it is planned (``stager.Stager.route_for``: direct, or staged
through both sides' staging areas where that has cost less). A lane keeps the queue's order:
consecutive direct jobs go out in one engine write as above, a staged job in its own slices
(``Stager.write``); its ``Result`` carries the descriptors actually written and the slices. Each
direct job written tells the routes what it cost (``Routes.timed``: its share of the batch's
write and its own checksums), which ``auto`` weighs against the staged route's.

A lane with nothing queued for ``idle_s`` ends its thread; the next job for that peer starts a
new one.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .. import checksum, protocol
from ..backends.base import BackendError, TransferBackend
from ..plan import PairTable, PlanError, WritePlan, join_plans, plan_chunk
from ..request import KVPoll
from ..staging import DIRECT, STAGED
from .prefill_request import PrefillRequest
from .records import Chunk, DecodeDestination, KVSender

log = logging.getLogger(__name__)

IDLE_S = 10.0


@dataclass(frozen=True, eq=False)
class Job:
    """One chunk of one request, and where decode wants it."""

    request: PrefillRequest  # handed on to the reporter with the job's outcome
    destination: DecodeDestination
    chunk: Chunk

    @property
    def sender(self) -> KVSender:
        """The request's sender: the writer reads its state, room and aux slot."""
        return self.request.sender

    @property
    def engine_peer(self) -> str:
        return self.destination.peer.engine_peer

    @property
    def dst_pages(self) -> np.ndarray:
        """Decode's page ids for the chunk's pages."""
        return self._of_chunk(self.destination.dst_pages)

    @property
    def index_pages(self) -> np.ndarray | None:
        """Decode's own indexer page ids for the chunk's pages (None: ``dst_pages``)."""
        pages = self.destination.index_pages
        return None if pages is None else self._of_chunk(pages)

    def _of_chunk(self, request_pages: np.ndarray) -> np.ndarray:
        if self.chunk.positions is not None:
            return request_pages[self.chunk.positions]
        offset = self.chunk.offset
        return request_pages[offset:offset + self.chunk.pages.size]


@dataclass(frozen=True)
class Result:
    """What became of a job. ``ok``: written (``plan``, its share of the batch's ``seconds``,
    ``sums``); else ``reason`` ("" when skipped: its request had already failed), and
    ``in_flight`` when an engine write that held it failed (its bytes may still land).
    ``batch_index`` / ``batch_jobs``: its place in the engine write it went out in; ``route``
    and ``slices``: how it went (the staging slices it filled)."""

    job: Job
    ok: bool
    plan: WritePlan | None = None
    seconds: float = 0.0
    sums: protocol.PageChecksums | None = None
    reason: str = ""
    in_flight: bool = False
    engine_failure: bool = False
    batch_index: int = 0
    batch_jobs: int = 1
    route: str = DIRECT
    slices: int = 0


class PageSums(Protocol):
    """The page checksums of a chunk before its write (None: checksums are off)."""

    def of_chunk(self, pairs: PairTable, pages: np.ndarray,
                 offset: int) -> protocol.PageChecksums | None: ...


class Routes(Protocol):
    """The route of each chunk, and the staged write (``stager.Stager``)."""

    def route_for(self, peer, plan: WritePlan) -> str: ...

    def timed(self, peer, plan: WritePlan, seconds: float) -> None: ...

    def write(self, peer, room: int, offset: int, pages: np.ndarray, plan: WritePlan, *,
              timeout_s: float, checksums: PageSums
              ) -> tuple[WritePlan, int, protocol.PageChecksums | None]: ...


class DirectOnly:
    """Every chunk on the direct route (a writer without a stager)."""

    def route_for(self, peer, plan: WritePlan) -> str:
        return DIRECT

    def timed(self, peer, plan: WritePlan, seconds: float) -> None:
        """Nothing to weigh: every chunk goes direct."""

    def write(self, *args, **kwargs) -> tuple[WritePlan, int, None]:
        raise AssertionError("no staged route without a stager")


class Outcomes(Protocol):
    """Where each job's ``Result`` goes, from the lane's thread."""

    def finish(self, result: Result) -> None: ...


def shares(seconds: float, plans: Sequence[WritePlan]) -> list[float]:
    """The batch's write seconds split among its plans by bytes (they sum to ``seconds``)."""
    total = sum(p.nbytes for p in plans)
    return [seconds * p.nbytes / total if total else seconds / len(plans) for p in plans]


@dataclass(frozen=True)
class _Planned:
    """A queued job with its plan, or why it has none (``in_flight``: a bug, not bad pages)."""

    job: Job
    plan: WritePlan | None
    failure: str = ""
    in_flight: bool = False
    route: str = DIRECT


def _planned(job: Job, routes: Routes) -> _Planned:
    """``job`` with its plan (``plan.plan_chunk``) and route, or with the reason it cannot be
    planned."""
    peer, chunk = job.destination.peer, job.chunk
    try:
        plan = plan_chunk(peer.pairs, chunk.pages, job.dst_pages, last=chunk.last,
                          aux_pairs=peer.aux_pairs, aux_src=job.sender.aux_index,
                          aux_dst=job.destination.aux_index, index_pages=job.index_pages,
                          kv_page_zero=peer.kv_page_zero)
        # direct: a share's pages are named by its chunk; decode's staging scatters every
        # buffer into one page list
        direct = chunk.positions is not None or job.destination.index_pages is not None
        return _Planned(job, plan, route=DIRECT if direct else routes.route_for(peer, plan))
    except PlanError as exc:
        return _Planned(job, None, f"bad pages: {exc}")
    except Exception as exc:  # a bug must fail the request, not the caller
        log.exception("room %d: planning a chunk failed", job.sender.room)
        return _Planned(job, None, f"internal error: {type(exc).__name__}: {exc}", in_flight=True)


class _Lane:
    def __init__(self, peer: str):
        self.peer = peer
        self.jobs: queue.SimpleQueue[_Planned | None] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None


class Writer:
    """Lanes of jobs per engine peer; ``outcomes.finish(result)`` is called once per submitted
    job."""

    def __init__(self, backend: TransferBackend, *, name: str, timeout_s: float,
                 checksums: PageSums, outcomes: Outcomes, idle_s: float = IDLE_S,
                 routes: Routes | None = None):
        self.backend = backend
        self.name = name
        self.timeout_s = timeout_s
        self._checksums = checksums
        self._outcomes = outcomes
        self._idle_s = idle_s
        self._routes = routes or DirectOnly()
        self._lock = threading.Lock()
        self._lanes: dict[str, _Lane] = {}
        self._closed = False
        self.batches = 0  # engine writes submitted (each of one or more jobs)

    def submit(self, job: Job) -> None:
        """Plan ``job`` and queue it on its peer's lane (starting the lane's thread if it has
        none); its outcome, a planning failure too, reaches ``outcomes`` from the lane."""
        planned = _planned(job, self._routes)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: the writer is closed")
            lane = self._lanes.get(job.engine_peer)
            if lane is None:
                lane = self._lanes[job.engine_peer] = _Lane(job.engine_peer)
                lane.thread = threading.Thread(target=self._run, args=(lane,), daemon=True,
                                               name=f"{self.name}-writer-{job.engine_peer}")
                lane.thread.start()
            lane.jobs.put(planned)

    def lanes(self) -> list[str]:
        with self._lock:
            return list(self._lanes)

    def close(self, timeout_s: float) -> None:
        """Stop every lane after the jobs queued on it; wait at most ``timeout_s`` in all."""
        with self._lock:
            self._closed = True
            lanes = list(self._lanes.values())
        for lane in lanes:
            lane.jobs.put(None)
        deadline = time.monotonic() + timeout_s
        for lane in lanes:
            lane.thread.join(max(0.0, deadline - time.monotonic()))

    # ---- a lane's thread ----------------------------------------------------------------------

    def _run(self, lane: _Lane) -> None:
        while True:
            try:
                first = lane.jobs.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    if lane.jobs.empty():  # nothing was queued meanwhile: retire the lane
                        del self._lanes[lane.peer]
                        return
                continue
            jobs, stop = [], first is None
            if first is not None:
                jobs.append(first)
            while True:
                try:
                    job = lane.jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    stop = True
                else:
                    jobs.append(job)
            if jobs:
                self._write(lane.peer, jobs)
            if stop:
                return

    def _write(self, peer: str, jobs: list[_Planned]) -> None:
        """Checksum every live planned job and write them in queue order: consecutive direct
        ones in one engine write, each staged one on its own; report each outcome."""
        direct: list[tuple[Job, WritePlan, protocol.PageChecksums | None, float]] = []
        for entry in jobs:
            job = entry.job
            if job.sender.state.status == KVPoll.Failed:
                self._report(Result(job, ok=False))
                continue
            if entry.plan is None:
                self._report(Result(job, ok=False, reason=entry.failure, in_flight=entry.in_flight))
                continue
            if entry.route == STAGED:  # checksummed as its slices are gathered
                self._write_batch(peer, direct)
                direct = []
                if job.sender.state.status == KVPoll.Failed:  # in the batch just written
                    self._report(Result(job, ok=False))
                    continue
                self._write_staged(job, entry.plan)
                continue
            try:
                started = time.perf_counter()
                sums = None if job.chunk.pages.size == 0 else self._checksums.of_chunk(
                    job.destination.peer.pairs, job.chunk.pages, job.chunk.offset)
                summing = time.perf_counter() - started
            except checksum.ChecksumError as exc:
                self._report(Result(job, ok=False, reason=str(exc)))
                continue
            except Exception as exc:  # a bug must fail the request, not stop the lane
                log.exception("%s: room %d: checksumming a chunk failed", self.name, job.sender.room)
                self._report(Result(job, ok=False, in_flight=True,
                                    reason=f"internal error: {type(exc).__name__}: {exc}"))
                continue
            direct.append((job, entry.plan, sums, summing))
        self._write_batch(peer, direct)

    def _write_batch(self, peer: str, planned: list[tuple[Job, WritePlan,
                                                          protocol.PageChecksums | None, float]]
                     ) -> None:
        """Write direct jobs in one engine write; report each outcome, and what each cost
        (``Routes.timed``)."""
        if not planned:
            return
        plans = [plan for _, plan, _, _ in planned]
        src, dst, length = join_plans(plans)
        try:
            started = time.perf_counter()
            if src.size:  # (a share writer's empty last chunk writes nothing)
                with self._lock:
                    self.batches += 1
                self.backend.write(peer, src, dst, length, timeout_s=self.timeout_s)
            seconds = time.perf_counter() - started
        except BackendError as exc:
            failed = (f"engine write failed: {exc}", True)
        except Exception as exc:  # a bug must fail the requests, not stop the lane
            log.exception("%s: writing a batch of %d chunks failed", self.name, len(planned))
            failed = (f"internal error: {type(exc).__name__}: {exc}", False)
        else:
            for i, ((job, plan, sums, summing), share) in enumerate(
                    zip(planned, shares(seconds, plans), strict=True)):
                if plan.nbytes:
                    self._routes.timed(job.destination.peer, plan, share + summing)
                self._report(Result(job, ok=True, plan=plan, seconds=share, sums=sums,
                                    batch_index=i, batch_jobs=len(planned)))
            return
        reason, engine = failed
        for i, (job, _, _, _) in enumerate(planned):
            self._report(Result(job, ok=False, reason=reason, in_flight=True, engine_failure=engine,
                                batch_index=i, batch_jobs=len(planned)))

    def _write_staged(self, job: Job, plan: WritePlan) -> None:
        """Write one job through the staging slices (``Routes.write``, which takes its page
        checksums from them); report its outcome."""
        with self._lock:
            self.batches += 1
        try:
            started = time.perf_counter()
            written, slices, sums = self._routes.write(
                job.destination.peer, job.sender.room, job.chunk.offset, job.chunk.pages, plan,
                timeout_s=self.timeout_s, checksums=self._checksums)
            seconds = time.perf_counter() - started
        except checksum.ChecksumError as exc:  # before any write
            self._report(Result(job, ok=False, reason=str(exc), route=STAGED))
        except BackendError as exc:
            self._report(Result(job, ok=False, reason=f"engine write failed: {exc}",
                                in_flight=True, engine_failure=True, route=STAGED))
        except Exception as exc:  # a bug must fail the request, not stop the lane
            log.exception("%s: room %d: a staged write failed", self.name, job.sender.room)
            self._report(Result(job, ok=False, reason=f"internal error: {type(exc).__name__}: "
                                f"{exc}", in_flight=True, route=STAGED))
        else:
            self._report(Result(job, ok=True, plan=written, seconds=seconds, sums=sums,
                                route=STAGED, slices=slices))

    def _report(self, result: Result) -> None:
        try:
            self._outcomes.finish(result)
        except Exception:  # the reporter's bookkeeping failing must not stop the lane
            log.exception("%s: room %d: recording a chunk's outcome failed", self.name,
                          result.job.sender.room)
