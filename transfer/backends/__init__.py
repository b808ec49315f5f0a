"""Transfer engine backends: the factory, and the checks every backend runs before its engine.

``create_backend("mooncake" | "nixl", host=..., **options)`` builds one backend. The engine
packages are imported only inside the backend constructors, so importing this package (or the
backend modules) never loads Mooncake or NIXL.

The checks live here because both engines share them: regions are refused when zero-length, null,
duplicate or overlapping, and write arrays when ragged, empty, zero-length, null or overlapping in
the destination — always before a single call into an engine. So does ``EngineBackend``, the
base of both backends: registration of all regions or none (a failure rolls back the ones
registered), deregistration at close, and the checks of a write's arguments.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import math
import os
import re
import socket
import struct
import threading
import time
from array import array as byte_array
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ...plugin.descriptors import BufferDescriptor
from .base import BackendError, BackendUnavailable, TransferBackend

log = logging.getLogger(__name__)

BACKENDS = ("mooncake", "nixl")

_DEVICE = re.compile(r"^(?:cpu|cuda:(\d+))$")
_RDMA_SYSFS = Path("/sys/class/infiniband")
_ENV_LOCK = threading.Lock()


def create_backend(name: str, *, host: str = "127.0.0.1", **options: object) -> TransferBackend:
    """Build the backend ``name`` (one of ``BACKENDS``); ``options`` go to its constructor."""
    if name == "mooncake":
        from .mooncake import MooncakeBackend

        return MooncakeBackend(host=host, **options)
    if name == "nixl":
        from .nixl import NixlBackend

        return NixlBackend(host=host, **options)
    raise BackendUnavailable(name, "create", f"unknown backend; choose one of {', '.join(BACKENDS)}")


def device_index(backend: str, region: BufferDescriptor) -> int | None:
    """``None`` for "cpu", N for "cuda:N"; any other device string is refused."""
    match = _DEVICE.match(region.device)
    if match is None:
        raise BackendError(backend, "register", f"{region}: device must be 'cpu' or 'cuda:N'")
    return None if match.group(1) is None else int(match.group(1))


def rdma_devices(device_filter: str = "") -> list[str]:
    """The RDMA devices of this machine (all, or those named in a comma-separated filter)."""
    try:
        found = sorted(entry.name for entry in _RDMA_SYSFS.iterdir())
    except OSError:
        return []
    wanted = {name for name in device_filter.split(",") if name}
    return [name for name in found if not wanted or name in wanted]


def rdma_ports() -> list[str]:
    """Every port of every RDMA device, named as UCX names them: ``mlx5_0:1``."""
    ports = []
    for device in rdma_devices():
        try:
            ports += [f"{device}:{port}" for port in sorted((_RDMA_SYSFS / device / "ports").iterdir())]
        except OSError:
            continue
    return ports


_SIOCGIFCONF = 0x8912
_IFREQ_BYTES = 40  # struct ifreq on 64-bit Linux: a 16-byte name, then a 24-byte union


def interface_of(address: str) -> str | None:
    """The network interface that holds the IPv4 ``address`` (primary or secondary), or None."""
    buf = byte_array("B", bytes(_IFREQ_BYTES * 256))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("iL", len(buf), buf.buffer_info()[0])
        filled = struct.unpack("iL", fcntl.ioctl(sock.fileno(), _SIOCGIFCONF, request))[0]
    table = buf.tobytes()[:filled]
    for offset in range(0, len(table), _IFREQ_BYTES):
        entry = table[offset : offset + _IFREQ_BYTES]
        if socket.inet_ntoa(entry[20:24]) == address:  # sockaddr_in: family, port, then the address
            return entry[:16].split(b"\0", 1)[0].decode().split(":", 1)[0]  # "eth0:1" is an alias
    return None


@contextlib.contextmanager
def env_defaults(defaults: dict[str, str]) -> Iterator[dict[str, str]]:
    """Set the variables the user has not set, for the duration of an engine's start-up only.

    Engines read their environment when they start; restoring it afterwards keeps one backend's
    defaults (e.g. ``UCX_NET_DEVICES=lo`` for a loopback host) from leaking into the next one.
    Yields the effective value of every variable in ``defaults``.
    """
    with _ENV_LOCK:
        added = [key for key in defaults if key not in os.environ]
        for key in added:
            os.environ[key] = defaults[key]
        try:
            yield {key: os.environ[key] for key in defaults}
        finally:
            for key in added:
                os.environ.pop(key, None)


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


class EngineBackend:
    """What both engine backends share; each one provides ``name``, ``_lock`` and the two
    engine calls ``_register_region`` and ``_unregister_region`` (raising BackendError)."""

    name: str
    _lock: contextlib.AbstractContextManager

    def _init_regions(self) -> None:
        self._regions = RegionTable(self.name)
        self._closed = False

    def register(self, regions: list[BufferDescriptor]) -> None:
        """Register each region (all or none: a failure deregisters this call's regions)."""
        with self._lock:
            self._check_open("register")
            self._regions.check_new(regions)
            done: list[BufferDescriptor] = []
            for region in regions:
                try:
                    self._register_region(region)
                except BackendError:
                    self._roll_back(done)
                    raise
                self._regions.add([region])
                done.append(region)

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

    def _write_args(self, peer: str, src: np.ndarray, dst: np.ndarray, length: np.ndarray,
                    timeout_s: float) -> tuple[float, np.ndarray, np.ndarray, np.ndarray]:
        """A write's deadline and its checked uint64 arrays (``check_timeout``,
        ``check_write_args``)."""
        deadline = time.monotonic() + check_timeout(self.name, peer, timeout_s)
        return (deadline, *check_write_args(self.name, peer, src, dst, length))
