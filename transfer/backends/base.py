"""What every engine backend shares: the interface, its errors, the checks, and the engines' base.

A backend moves bytes from this process's registered memory into a peer's registered memory
(WRITE, push model). It knows nothing of layers, pages or requests: the planner turns those into
flat ``(src_addr, dst_addr, length)`` arrays, and the node checks every address against the
regions both sides announced before calling ``write``.

- ``TransferBackend`` is what the transfer layer needs of an engine; ``BackendError`` (and its
  kinds ``BackendUnavailable``, ``TransferTimeout``) is what every method raises.
- The checks, always made before a single call into an engine: regions are refused when
  zero-length, null, duplicate or overlapping (``RegionTable.check_new``), a write's arrays when
  ragged, empty, zero-length, null or overlapping in the destination (``check_write_args``), its
  timeout unless positive and finite (``check_timeout``); at ``EngineBackend.register``, a
  region whose claimed device ("cpu", "cuda:N") is not the memory its pointer is
  (``memory_kinds.device_problem``: the CUDA driver's answer; without CUDA, any "cuda:N").
- ``EngineBackend`` is the base of both engine backends: registration of all regions or none (a
  failure rolls back the ones registered), deregistration at close, and the template ``write``:
  the checks, then the engine's own ``_write``, whose bookkeeping under the lock (backend open,
  peer known, sources registered) is ``_write_section``.
- ``FairLock`` is a mutex granted in the order it was asked for (NIXL's agent lock).

What the engines read of the machine and the environment is in the sibling ``environment``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

import numpy as np

from ...plugin.descriptors import BufferDescriptor
from ..memory_kinds import device_problem, process_lookup

log = logging.getLogger(__name__)

_DEVICE = re.compile(r"^(?:cpu|cuda:(\d+))$")


class BackendError(Exception):
    """An engine operation failed: carries the operation, the peer (if any) and the engine code."""

    def __init__(self, backend: str, op: str, detail: str, *, peer: str = "", code: int | None = None):
        self.backend, self.op, self.peer, self.code = backend, op, peer, code
        where = f" peer={peer}" if peer else ""
        rc = f" code={code}" if code is not None else ""
        super().__init__(f"{backend} {op} failed{where}{rc}: {detail}")


class BackendUnavailable(BackendError):
    """The engine cannot be used on this machine (package missing, no usable transport)."""


class TransferTimeout(BackendError):
    """A write did not complete before its deadline; its destination may still be written."""


class TransferBackend(Protocol):
    """What the transfer layer needs of an engine. All methods raise BackendError on failure."""

    name: str
    tick_ms: int  # how often a node's control thread ticks over it (``progress``, heartbeats)
    needs_progress: bool  # whether ``progress`` must run every ``tick_ms`` (NIXL's passive side)

    def register(self, regions: list[BufferDescriptor]) -> None:
        """Register each region once. Zero-length, null or duplicate regions are refused."""

    def unregister(self, regions: list[BufferDescriptor]) -> None:
        """Deregister regions registered here, each exactly as registered (all or none: a region
        not registered is refused before any is deregistered)."""

    def metadata(self) -> bytes:
        """What a peer needs to ``connect`` to this engine (session id, agent metadata)."""

    def connect(self, peer_metadata: bytes) -> str:
        """Make a peer known; returns the handle to pass to ``write``."""

    def write(
        self, peer: str, src: np.ndarray, dst: np.ndarray, length: np.ndarray, *, timeout_s: float
    ) -> None:
        """Write ``length[i]`` bytes from local ``src[i]`` to the peer's ``dst[i]``; block until all
        landed or raise. On any failure, the destination ranges may be partly or later written."""

    def disconnect(self, peer: str) -> None:
        """Forget a departed peer and release the engine's connections to it; never blocks on
        the peer. Later writes to it are refused until it is ``connect``-ed again. Unknown peers
        are ignored."""

    def progress(self) -> None:
        """Let a passive engine make progress (NIXL without a progress thread); cheap, non-blocking."""

    def transport(self) -> str:
        """The transport actually in use (e.g. "tcp" even when "rdma" was asked for)."""

    def close(self) -> None:
        """Deregister everything and release the engine. Idempotent."""


def device_index(backend: str, region: BufferDescriptor) -> int | None:
    """``None`` for "cpu", N for "cuda:N"; any other device string is refused."""
    match = _DEVICE.match(region.device)
    if match is None:
        raise BackendError(backend, "register", f"{region}: device must be 'cpu' or 'cuda:N'")
    return None if match.group(1) is None else int(match.group(1))


def check_timeout(backend: str, peer: str, timeout_s: float) -> float:
    """A write's timeout must be a positive, finite number of seconds."""
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise BackendError(backend, "write", f"timeout_s must be > 0, got {timeout_s!r}", peer=peer)
    return float(timeout_s)


def check_write_args(
    backend: str, peer: str, src: np.ndarray, dst: np.ndarray, length: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Validate the three descriptor arrays of a write and return them as uint64.

    Refused: non-1-D or non-(u)int64 arrays, unequal lengths, an empty write, a negative value,
    a zero length, a null address, a range that wraps around, or two destination ranges that
    overlap (the result would depend on the order the engine happens to write them in).
    """

    def fail(detail: str) -> BackendError:
        return BackendError(backend, "write", detail, peer=peer)

    arrays = []
    for label, array in (("src", src), ("dst", dst), ("length", length)):
        if not isinstance(array, np.ndarray) or array.ndim != 1:
            raise fail(f"{label} must be a 1-D numpy array")
        if array.dtype not in (np.uint64, np.int64):
            raise fail(f"{label} must be uint64 or int64, got {array.dtype}")
        if array.dtype == np.int64 and array.size and int(array.min()) < 0:
            raise fail(f"{label}[{int(np.argmax(array < 0))}] is negative")
        arrays.append(array.astype(np.uint64, copy=False))
    src, dst, length = arrays
    if not len(src) == len(dst) == len(length):
        raise fail(f"src, dst and length differ in size ({len(src)}, {len(dst)}, {len(length)})")
    if len(src) == 0:
        raise fail("no descriptors")
    for label, array in (("length", length), ("src", src), ("dst", dst)):
        if not array.all():
            raise fail(f"{label}[{int(np.argmin(array != 0))}] is 0")
    for label, array in (("src", src), ("dst", dst)):
        wrapped = array + length < array
        if wrapped.any():
            raise fail(f"{label}[{int(np.argmax(wrapped))}] + length wraps around")
    order = np.argsort(dst, kind="stable")
    clash = (dst[order] + length[order])[:-1] > dst[order][1:]
    if clash.any():
        i, j = order[int(np.argmax(clash))], order[int(np.argmax(clash)) + 1]
        raise fail(f"destination ranges {int(i)} and {int(j)} overlap")
    return src, dst, length


class FairLock:
    """A mutex granted in the order it was asked for (a ticket lock).

    ``threading.Lock`` is not fair: a thread that releases it and asks again at once (a write
    posting slice after slice) wins it again and again over a thread already waiting (the
    control thread's handshake or disconnect), which can then wait for the whole write.
    ``acquire_if_free`` takes it only when nobody holds it or waits for it, without joining
    the queue: for calls that may as well be skipped while the lock is busy.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._next = 0
        self._serving = 0

    def acquire(self) -> None:
        with self._cond:
            ticket = self._next
            self._next += 1
            while self._serving != ticket:
                self._cond.wait()

    def acquire_if_free(self) -> bool:
        with self._cond:
            if self._serving != self._next:
                return False
            self._next += 1
            return True

    def release(self) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()

    def __enter__(self) -> FairLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class RegionTable:
    """Registered regions that may not overlap, kept sorted by address for vectorised lookup."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.regions: dict[int, BufferDescriptor] = {}
        self._starts = np.zeros(0, dtype=np.uint64)
        self._ends = np.zeros(0, dtype=np.uint64)
        self.on_cuda = np.zeros(0, dtype=bool)
        self.device_ids = np.zeros(0, dtype=np.uint64)

    def check_new(self, regions: list[BufferDescriptor]) -> None:
        """Refuse zero-length, null, duplicate or overlapping regions, naming the first offender
        (sort and sweep: a peer's metadata may list thousands)."""
        if not regions:
            raise BackendError(self.backend, "register", "no regions given")
        for region in regions:
            device_index(self.backend, region)
            if region.ptr <= 0:
                raise BackendError(self.backend, "register", f"{region}: null pointer")
            if region.nbytes <= 0:
                raise BackendError(self.backend, "register", f"{region}: zero length")
            if region.ptr + region.nbytes > 2**64:
                raise BackendError(self.backend, "register", f"{region}: wraps around")
        tagged = [(r.ptr, 0, r) for r in self.regions.values()] + [(r.ptr, 1, r) for r in regions]
        widest: tuple[int, BufferDescriptor] | None = None  # the region reaching furthest so far
        for _, given, region in sorted(tagged, key=lambda item: item[:2]):
            if widest is not None and region.ptr < widest[1].ptr + widest[1].nbytes:
                other_given, other = widest
                new, old = (region, other) if given else (other, region)
                same = (region.ptr, region.nbytes) == (other.ptr, other.nbytes)
                where = "given" if (given and other_given) else "registered"
                what = "duplicates" if same else "overlaps"
                raise BackendError(self.backend, "register", f"{new}: {what} {where} {old}")
            if widest is None or region.ptr + region.nbytes > widest[1].ptr + widest[1].nbytes:
                widest = (given, region)

    def add(self, regions: list[BufferDescriptor]) -> None:
        for region in regions:
            self.regions[region.ptr] = region
        self._rebuild()

    def remove(self, region: BufferDescriptor) -> None:
        del self.regions[region.ptr]
        self._rebuild()

    def _rebuild(self) -> None:
        ordered = sorted(self.regions.values(), key=lambda region: region.ptr)
        devices = [device_index(self.backend, region) for region in ordered]
        self._starts = np.array([r.ptr for r in ordered], dtype=np.uint64)
        self._ends = np.array([r.ptr + r.nbytes for r in ordered], dtype=np.uint64)
        self.on_cuda = np.array([d is not None for d in devices], dtype=bool)
        self.device_ids = np.array([d or 0 for d in devices], dtype=np.uint64)

    def locate(self, label: str, addr: np.ndarray, length: np.ndarray, *, peer: str = "") -> np.ndarray:
        """The sorted slot of the region holding each range; a range outside all is an error."""
        slot = np.searchsorted(self._starts, addr, side="right").astype(np.int64) - 1
        inside = slot >= 0
        inside[inside] = addr[inside] + length[inside] <= self._ends[slot[inside]]
        if not inside.all():
            i = int(np.argmin(inside))
            owner = "the peer announced" if label == "dst" else "registered here"
            raise BackendError(
                self.backend,
                "write",
                f"{label}[{i}] = {int(addr[i]):#x} + {int(length[i])} lies outside every region {owner}",
                peer=peer,
            )
        return slot


PeerT = TypeVar("PeerT")


class EngineBackend(ABC, Generic[PeerT]):
    """What both engine backends share. Each one provides ``name``, ``_lock`` (held for its
    bookkeeping and engine calls), calls ``_init_bookkeeping`` when its engine is up, keeps what
    it knows of each peer (a ``PeerT``) in ``_peers`` from ``connect`` on, and implements the
    engine calls ``_register_region``, ``_unregister_region`` and ``_write``."""

    name: str
    _lock: contextlib.AbstractContextManager

    def _init_bookkeeping(self) -> None:
        self._regions = RegionTable(self.name)
        self._peers: dict[str, PeerT] = {}
        self._closed = False

    @abstractmethod
    def _register_region(self, region: BufferDescriptor) -> None:
        """Register one checked region with the engine (under the lock); raise BackendError."""

    @abstractmethod
    def _unregister_region(self, region: BufferDescriptor) -> None:
        """Deregister one region from the engine (under the lock); raise BackendError."""

    @abstractmethod
    def _write(self, peer: str, src: np.ndarray, dst: np.ndarray, length: np.ndarray, *,
               deadline: float, timeout_s: float) -> None:
        """The engine's part of ``write``, called once the arrays are checked (and uint64):
        ``deadline`` is the ``time.monotonic()`` it must end by, ``timeout_s`` the timeout as given
        (for messages). It takes the lock through ``_write_section``, which makes the checks both
        engines make under it, and does its own bookkeeping in that same hold."""

    def register(self, regions: list[BufferDescriptor]) -> None:
        """Register each region (all or none: a failure deregisters this call's regions)."""
        with self._lock:
            self._check_open("register")
            self._regions.check_new(regions)
            lookup = process_lookup()
            for region in regions:
                problem = device_problem(region, lookup)
                if problem:
                    raise BackendError(self.name, "register", problem)
            done: list[BufferDescriptor] = []
            for region in regions:
                try:
                    self._register_region(region)
                except BackendError:
                    self._roll_back(done)
                    raise
                self._regions.add([region])
                done.append(region)

    def unregister(self, regions: list[BufferDescriptor]) -> None:
        """Deregister regions registered here, each exactly as registered (all or none: a region
        not registered is refused before any is deregistered)."""
        with self._lock:
            self._check_open("unregister")
            for region in regions:
                if self._regions.regions.get(region.ptr) != region:
                    raise BackendError(self.name, "unregister", f"{region}: not registered")
            for region in regions:
                self._unregister(region)

    def write(
        self, peer: str, src: np.ndarray, dst: np.ndarray, length: np.ndarray, *, timeout_s: float
    ) -> None:
        """Check the timeout and the arrays (``check_timeout``, ``check_write_args``) before any
        engine call, then run the engine's ``_write`` (``TransferBackend.write`` says the rest)."""
        deadline = time.monotonic() + check_timeout(self.name, peer, timeout_s)
        src, dst, length = check_write_args(self.name, peer, src, dst, length)
        self._write(peer, src, dst, length, deadline=deadline, timeout_s=timeout_s)

    @contextlib.contextmanager
    def _write_section(
        self, peer: str, src: np.ndarray, length: np.ndarray
    ) -> Iterator[tuple[PeerT, np.ndarray]]:
        """Hold the lock for a write's bookkeeping, once the backend is found open, the peer
        known and every source range inside a region registered here; yields what is kept of
        the peer and the slot of the region holding each source range (``RegionTable.locate``)."""
        with self._lock:
            self._check_open("write")
            state = self._peers.get(peer)
            if state is None:
                raise BackendError(self.name, "write", "unknown peer (connect first)", peer=peer)
            yield state, self._regions.locate("src", src, length)

    def _unregister(self, region: BufferDescriptor) -> None:
        self._regions.remove(region)
        self._unregister_region(region)

    def _roll_back(self, regions: list[BufferDescriptor]) -> None:
        for region in regions:
            try:
                self._unregister(region)
            except BackendError as exc:
                log.error("%s: rolling back a failed register: %s", self.name, exc)

    def _unregister_all(self) -> list[str]:
        """Deregister every region (at close); what failed, as messages."""
        failures = []
        for region in list(self._regions.regions.values()):
            try:
                self._unregister(region)
            except BackendError as exc:
                failures.append(str(exc))
        return failures

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise BackendError(self.name, op, "backend is closed")
