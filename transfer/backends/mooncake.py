"""Mooncake Transfer Engine behind the TransferBackend interface (P2P handshake, TCP or RDMA).

Facts this module is built on (Mooncake 0.3.13, measured on our machines, see docs/engines.md):

- Every engine call returns an int (0 = ok); nothing raises. Each one is checked here.
- The ``protocol`` argument is ignored: the engine installs RDMA when it finds an RDMA device and
  ``MC_FORCE_TCP`` is unset, TCP otherwise. ``transport()`` reports what it really installed;
  asking for "tcp" sets ``MC_FORCE_TCP`` during start-up so that "tcp" means TCP.
- One peer accepts at most 2048 queued entries; a larger batch fails with part of it written and
  the rest still landing afterwards. Writes go in batches of at most ``max_batch`` (1024) entries,
  one batch in flight per peer.
- ``get_batch_transfer_status`` blocks until the batch ends or ``MC_TRANSFER_TIMEOUT`` (default
  30 s) passes, and the first write to a peer blocks up to 60 s in the handshake if the peer does
  not answer. So the engine calls of a write run in a helper thread and the caller waits on it
  with its own deadline; after a timeout the helper finishes in the background, holding that
  peer's lock so no later write piles onto a stuck peer.
- ``initialize`` logs ``E... transfer_metadata.cpp:...] Local segment descriptor not found`` on
  every healthy start in P2P-handshake mode: the TCP transport's ``allocateLocalSegmentID`` looks
  up its own segment (``getSegmentDesc``) before it creates it, logs at ERROR when the lookup
  finds none, and creates it. No order of our calls avoids it, and hiding ERROR for the whole
  process would hide real errors too, so the engine's stderr is captured during ``initialize``
  only and passed on without that one line (``startup_log``).

Thread safety: the engine is thread-safe for submission and status (it has its own locks); this
class guards its own bookkeeping with a lock and serialises writes per peer.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from . import (
    RegionTable,
    check_timeout,
    check_write_args,
    device_index,
    env_defaults,
    rdma_devices,
)
from .base import BackendError, BackendUnavailable, MemoryRegion, TransferTimeout

log = logging.getLogger(__name__)

_SESSION = re.compile(r"^(\d{1,3}(?:\.\d{1,3}){3}):(\d{1,5})$")
_GLOG_LINE = re.compile(r"^[IWEF]\d{4} ")
_BENIGN_STARTUP = re.compile(
    r"^E\d{4} [\d:.]+ +\d+ transfer_metadata\.cpp:\d+\] Local segment descriptor not found$")
_GLOG_PREAMBLE = "WARNING: Logging before InitGoogleLogging() is written to STDERR"


def startup_log(text: str) -> str:
    """What the engine printed while it started, less the benign "Local segment descriptor not
    found" line (and glog's preamble, when no other glog line is left to introduce)."""
    lines = [line for line in text.splitlines(keepends=True)
             if not _BENIGN_STARTUP.match(line.rstrip("\r\n"))]
    if not any(_GLOG_LINE.match(line) for line in lines):
        lines = [line for line in lines if line.rstrip("\r\n") != _GLOG_PREAMBLE]
    return "".join(lines)


@contextlib.contextmanager
def _startup_stderr() -> Iterator[None]:
    """File descriptor 2 into a temporary file for the block, then its text, through
    ``startup_log``, onto the real stderr (nothing written meanwhile is lost, only delayed)."""
    sys.stderr.flush()
    with tempfile.TemporaryFile() as capture:
        saved = os.dup(2)
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = startup_log(capture.read().decode(errors="replace"))
            if kept:
                sys.stderr.write(kept)
                sys.stderr.flush()


def _is_ipv4(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        return False
    return True


def _import_engine() -> type:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        hint = "; install the system library libibverbs1" if "libibverbs" in str(exc) else ""
        raise BackendUnavailable(
            "mooncake",
            "import",
            f"cannot import mooncake.engine ({exc}); install mooncake-transfer-engine-non-cuda "
            f"(no CUDA) or mooncake-transfer-engine (CUDA){hint}",
        ) from exc
    return TransferEngine


@dataclass
class _Outcome:
    """What the helper thread of one write reports back."""

    done: threading.Event = field(default_factory=threading.Event)
    failed_call: str = ""
    code: int | None = None
    detail: str = ""
    first_entry: int = 0
    abandoned: bool = False  # the caller timed out and no longer waits


class MooncakeBackend:
    """TransferBackend over ``mooncake.engine.TransferEngine``."""

    name = "mooncake"

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        max_batch: int = 1024,
    ) -> None:
        if not _is_ipv4(host):
            raise BackendError(self.name, "init", f"host must be a numeric IPv4, got {host!r}")
        if protocol not in ("tcp", "rdma"):
            raise BackendError(self.name, "init", f"protocol must be 'tcp' or 'rdma', got {protocol!r}")
        if not 1 <= max_batch <= 1024:
            raise BackendError(self.name, "init", f"max_batch must be in 1..1024, got {max_batch}")
        self.max_batch = max_batch
        devices = rdma_devices(device_name)
        defaults = {"MC_LOG_LEVEL": "ERROR"}  # read when mooncake.engine is first imported
        if protocol == "tcp" and devices:
            defaults["MC_FORCE_TCP"] = "1"
        with env_defaults(defaults):
            engine_class = _import_engine()
            forced_tcp = "MC_FORCE_TCP" in os.environ  # any value counts, as in the engine
            engine = engine_class()
            with _startup_stderr():
                rc = engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise BackendUnavailable(self.name, "initialize", f"engine did not start on {host}", code=rc)
        self._transport = "rdma" if devices and not forced_tcp else "tcp"
        if protocol == "rdma" and self._transport == "tcp":
            log.warning(
                "mooncake: 'rdma' asked for but %s; the engine uses TCP",
                "MC_FORCE_TCP is set" if devices else "this machine has no RDMA device",
            )
        self._engine = engine
        self._session = f"{host}:{engine.get_rpc_port()}"
        self._lock = threading.Lock()
        self._regions = RegionTable(self.name)
        self._peers: dict[str, threading.Lock] = {}
        self._closed = False
        log.info("mooncake: engine %s up, transport %s", self._session, self._transport)

    def register(self, regions: list[MemoryRegion]) -> None:
        """Register each region (all or none: a failure deregisters this call's regions)."""
        with self._lock:
            self._check_open("register")
            self._regions.check_new(regions)
            done: list[MemoryRegion] = []
            for region in regions:
                cuda = device_index(self.name, region)
                location = "*" if cuda is None else f"cuda:{cuda}"
                rc = self._engine.register_memory(region.ptr, region.nbytes, location)
                if rc != 0:
                    self._roll_back(done)
                    raise BackendError(self.name, "register", f"{region} refused", code=rc)
                self._regions.add(region)
                done.append(region)

    def metadata(self) -> bytes:
        """The session id ``host:rpc_port`` a peer passes to ``connect``."""
        return self._session.encode()

    def connect(self, peer_metadata: bytes) -> str:
        """Validate a peer's session id; the handshake itself happens on the first write."""
        session = peer_metadata.decode("ascii", errors="replace")
        match = _SESSION.match(session)
        with self._lock:
            self._check_open("connect")
            if match is None or not 0 < int(match.group(2)) < 65536 or not _is_ipv4(match[1]):
                raise BackendError(self.name, "connect", f"not a session id 'a.b.c.d:port': {session!r}")
            self._peers.setdefault(session, threading.Lock())
        return session

    def write(
        self, peer: str, src: np.ndarray, dst: np.ndarray, length: np.ndarray, *, timeout_s: float
    ) -> None:
        """Write ``length[i]`` bytes from ``src[i]`` to the peer's ``dst[i]``, in batches.

        Raises BackendError(op, peer, code) when the engine reports a failure, TransferTimeout
        when ``timeout_s`` passes first. In both cases the destination may still be written
        after this returns: Mooncake keeps landing entries of a failed or abandoned batch.
        """
        deadline = time.monotonic() + check_timeout(self.name, peer, timeout_s)
        src, dst, length = check_write_args(self.name, peer, src, dst, length)
        with self._lock:
            self._check_open("write")
            peer_lock = self._peers.get(peer)
            if peer_lock is None:
                raise BackendError(self.name, "write", "unknown peer (connect first)", peer=peer)
            self._regions.locate("src", src, length)
            engine = self._engine
        if not peer_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TransferTimeout(
                self.name, "write", "an earlier write to this peer is still running", peer=peer
            )
        outcome = _Outcome()
        try:
            threading.Thread(
                target=self._run_batches,
                args=(engine, peer, peer_lock, src, dst, length, outcome),
                name=f"mooncake-write-{peer}",
                daemon=True,
            ).start()
        except RuntimeError as exc:  # no thread could be started
            peer_lock.release()
            raise BackendError(self.name, "write", str(exc), peer=peer) from exc
        if not outcome.done.wait(max(0.0, deadline - time.monotonic())):
            outcome.abandoned = True
            raise TransferTimeout(
                self.name, "write", f"{len(src)} entries not done after {timeout_s} s", peer=peer
            )
        if outcome.failed_call:
            raise BackendError(
                self.name,
                outcome.failed_call,
                f"batch starting at entry {outcome.first_entry} of {len(src)} failed"
                f"{': ' + outcome.detail if outcome.detail else ''}; "
                "the destination may still be written",
                peer=peer,
                code=outcome.code,
            )

    def _run_batches(
        self,
        engine: object,
        peer: str,
        peer_lock: threading.Lock,
        src: np.ndarray,
        dst: np.ndarray,
        length: np.ndarray,
        outcome: _Outcome,
    ) -> None:
        """Submit and wait for each batch in turn (runs in the write's helper thread)."""
        try:
            for first in range(0, len(src), self.max_batch):
                part = slice(first, first + self.max_batch)
                outcome.first_entry = first
                batch = engine.batch_transfer_async_write(
                    peer, src[part].tolist(), dst[part].tolist(), length[part].tolist()
                )
                if not 0 < batch < 2**63:  # 0 or (uint64)-1: nothing was submitted
                    outcome.failed_call, outcome.code = "batch_transfer_async_write", -1
                    return
                rc = engine.get_batch_transfer_status([batch])
                if rc != 0:
                    outcome.failed_call, outcome.code = "get_batch_transfer_status", rc
                    return
        except Exception as exc:  # a binding error must not pass for success
            outcome.failed_call, outcome.detail = "write", f"{type(exc).__name__}: {exc}"
        finally:
            peer_lock.release()
            outcome.done.set()
            if outcome.abandoned:
                log.warning(
                    "mooncake: a timed-out write to %s ended only now (%s)",
                    peer,
                    f"{outcome.failed_call} failed" if outcome.failed_call else "completed",
                )

    def progress(self) -> None:
        """Nothing to do: the engine runs its own threads."""

    def transport(self) -> str:
        """'tcp' or 'rdma' — what the engine installed, whatever protocol was asked for."""
        return self._transport

    def close(self) -> None:
        """Deregister every region and drop the engine; idempotent.

        A write abandoned by a timeout may still run in its helper thread; it keeps the engine
        alive until it ends (bounded by MC_TRANSFER_TIMEOUT / the 60 s handshake).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            failures = []
            for region in list(self._regions.regions.values()):
                try:
                    self._unregister(region)
                except BackendError as exc:
                    failures.append(str(exc))
            self._engine = None
            self._peers.clear()
        if failures:
            raise BackendError(self.name, "close", "; ".join(failures))

    def _unregister(self, region: MemoryRegion) -> None:
        rc = self._engine.unregister_memory(region.ptr)
        self._regions.remove(region)
        if rc != 0:
            raise BackendError(self.name, "unregister", f"{region} refused", code=rc)

    def _roll_back(self, regions: list[MemoryRegion]) -> None:
        for region in regions:
            try:
                self._unregister(region)
            except BackendError as exc:
                log.error("mooncake: rolling back a failed register: %s", exc)

    def _check_open(self, op: str) -> None:
        if self._closed:
            raise BackendError(self.name, op, "backend is closed")
