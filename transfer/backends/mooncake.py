"""Mooncake Transfer Engine behind the TransferBackend interface (P2P handshake, TCP or RDMA).

Facts this module is built on (Mooncake 0.3.13, measured on our machines, see docs/engines.md):

- Every engine call returns an int (0 = ok); nothing raises. Each one is checked here.
- The ``protocol`` argument is ignored: the engine installs RDMA when it finds an RDMA device and
  ``MC_FORCE_TCP`` is unset, TCP otherwise. ``transport()`` reports what it really installed;
  asking for "tcp" sets ``MC_FORCE_TCP`` during start-up so that "tcp" means TCP.
- One peer accepts at most 2048 entries in flight (``PEER_ENTRY_BOUND``), over all its batches; more
  fail with part of them written and the rest still landing afterwards, or stall until the
  engine's transfer timeout. A write keeps at most ``max_batch`` x ``batches_in_flight`` (512 x 2)
  entries in flight per peer, the next submitted as soon as the earliest ended, so the engine
  never idles between them, and a write never holds more than half the bound in flight.
- ``get_batch_transfer_status`` (and ``batch_transfer_sync_write``) wait for a batch by spinning on
  its status, a core busy until the batch ends or ``MC_TRANSFER_TIMEOUT`` (default 30 s) passes: on
  a small host, a core taken from the engine's own TCP threads and the peer's (a 64 MiB write in
  122 entries at load 8: 209 ms spinning, 135 ms polled, half the CPU). ``transfer_check_status``
  answers at once, for a batch's first entry only, and frees the batch once it ended. So each entry
  is a batch of its own (submitting one costs ~30 us more than in a shared batch; ``disconnect``'s
  reads as well), polled, the thread sleeping 0.1 ms (doubled up to 0.5 ms) whenever a poll found
  nothing ended. The engine calls of a write run in a helper thread and the caller waits on it with
  its own deadline; after a timeout the helper finishes in the background, holding that peer's lock
  so no later write piles onto a stuck peer.
- The first write to a peer runs Mooncake's handshake, which waits up to 60 s (hard-coded) for an
  endpoint that accepts and never answers, holding a lock that stalls every write of this engine,
  to every peer. ``send_probe`` waits as long but holds nothing, so a peer's endpoint is probed in
  a helper thread, with the write's own deadline, before Mooncake first contacts it.
- Mooncake keeps its pooled TCP connections to a peer (4 "lanes", at most 16) after the peer has
  gone, in CLOSE-WAIT, and has no call to drop them: a lane is closed only when the engine next
  tries to use it. ``disconnect`` therefore reads one byte per lane back from the departed peer
  into a private scratch buffer, which closes every dead lane and writes nothing but that buffer.
- A process that ends while one of the helper threads below (a write's, a probe's, a
  ``disconnect``'s) is inside the engine dies of ``terminate called without an active
  exception`` (SIGABRT; measured: ending right after a ``disconnect`` did, 19 of 20 times).
  ``close()`` therefore waits for its helpers, and an exit hook for those of every backend not
  closed, each up to ``HELPERS_JOIN_S`` (a helper stuck on a frozen peer runs until the
  engine's transfer timeout: past the bound the process ends anyway).
- Its two listeners (handshake ``0.0.0.0``, data ``[::]``) bind every interface, and no setting
  changes that; only their port range can be set (``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT``).
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

import atexit
import collections
import contextlib
import ipaddress
import logging
import os
import re
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np

from ...plugin.descriptors import BufferDescriptor
from .base import BackendError, BackendUnavailable, EngineBackend, TransferTimeout, device_index
from .environment import env_defaults, rdma_devices

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
            "on a host without CUDA, or on a CUDA host mooncake-transfer-engine-cuda13 (CUDA 13) "
            f"or mooncake-transfer-engine (CUDA 12){hint}",
        ) from exc
    return TransferEngine


PEER_ENTRY_BOUND = 2048  # the entries one peer takes in flight, over all its batches (measured)
_LANES = 16  # Mooncake's most pooled TCP connections per peer (MC_TCP_LANES_PER_PEER, default 4)
HELPERS_JOIN_S = 5.0  # how long close() and the exit hook wait for helper threads in the engine
_LIVE: weakref.WeakSet[MooncakeBackend] = weakref.WeakSet()  # backends whose helpers exit waits for


def join_helpers(helpers: list[threading.Thread], deadline: float) -> list[threading.Thread]:
    """Wait for ``helpers`` until ``deadline`` (monotonic); those still running."""
    for helper in helpers:
        helper.join(max(0.0, deadline - time.monotonic()))
    return [helper for helper in helpers if helper.is_alive()]


@atexit.register
def _join_at_exit() -> None:
    """The process is ending: wait for the helper threads of every backend (see the notes)."""
    deadline = time.monotonic() + HELPERS_JOIN_S
    for backend in list(_LIVE):
        join_helpers(backend.helpers(), deadline)


@dataclass
class _Probe:
    """One ``send_probe`` of a peer's engine endpoint, run in a helper thread."""

    done: threading.Event = field(default_factory=threading.Event)
    code: int | None = None
    detail: str = ""


@dataclass
class _Peer:
    """What the backend keeps per peer session."""

    lock: threading.Lock = field(default_factory=threading.Lock)  # one write in flight
    answered: bool = False  # its engine endpoint answered a probe: Mooncake may contact it
    probe: _Probe | None = None  # the probe in flight
    last_dst: int = 0  # a destination address written to it: what ``disconnect`` reads back


@dataclass
class _Outcome:
    """What the helper thread of one write reports back."""

    done: threading.Event = field(default_factory=threading.Event)
    failed_call: str = ""
    code: int | None = None
    detail: str = ""
    first_entry: int = 0
    abandoned: bool = False  # the caller timed out and no longer waits


class MooncakeBackend(EngineBackend[_Peer]):
    """TransferBackend over ``mooncake.engine.TransferEngine``."""

    name = "mooncake"
    tick_ms = 10  # the engine runs its own threads: a tick is only heartbeats and deadlines
    needs_progress = False
    POLL_FIRST_S, POLL_MAX_S = 0.0001, 0.0005  # a write's pause between polls: doubled to the max

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        max_batch: int = 512,
        batches_in_flight: int = 2,
    ) -> None:
        if not _is_ipv4(host):
            raise BackendError(self.name, "init", f"host must be a numeric IPv4, got {host!r}")
        if protocol not in ("tcp", "rdma"):
            raise BackendError(self.name, "init", f"protocol must be 'tcp' or 'rdma', got {protocol!r}")
        if max_batch < 1 or batches_in_flight < 1 or max_batch * batches_in_flight > PEER_ENTRY_BOUND:
            raise BackendError(
                self.name, "init",
                f"max_batch ({max_batch}) x batches_in_flight ({batches_in_flight}) must be "
                f"between 1 and {PEER_ENTRY_BOUND}, the entries one Mooncake peer takes in flight")
        self.max_batch, self.batches_in_flight = max_batch, batches_in_flight
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
        # What ``disconnect`` reads into: registered, as every local buffer must be for RDMA.
        self._scratch = np.zeros(_LANES, dtype=np.uint8)
        rc = engine.register_memory(self._scratch.ctypes.data, self._scratch.nbytes, "*")
        if rc != 0:
            raise BackendUnavailable(self.name, "register_memory", "scratch buffer refused", code=rc)
        self._engine = engine
        self._session = f"{host}:{engine.get_rpc_port()}"
        self._lock = threading.Lock()
        self._helpers: set[threading.Thread] = set()
        self._helpers_lock = threading.Lock()  # its own: a probe starts under ``_lock``
        self._init_bookkeeping()
        _LIVE.add(self)
        log.info("mooncake: engine %s up, transport %s", self._session, self._transport)

    def _start_helper(self, target: Callable[..., None], args: tuple, name: str) -> None:
        """Run ``target(*args)`` in a daemon thread that ``close()`` and the exit hook wait for
        (``helpers``). RuntimeError where no thread could be started."""
        def run() -> None:
            try:
                target(*args)
            finally:
                with self._helpers_lock:
                    self._helpers.discard(threading.current_thread())

        thread = threading.Thread(target=run, name=name, daemon=True)
        with self._helpers_lock:
            self._helpers.add(thread)
        try:
            thread.start()
        except RuntimeError:
            with self._helpers_lock:
                self._helpers.discard(thread)
            raise

    def helpers(self) -> list[threading.Thread]:
        """The helper threads still running (a write's, a probe's, a ``disconnect``'s)."""
        with self._helpers_lock:
            return list(self._helpers)

    def _register_region(self, region: BufferDescriptor) -> None:
        cuda = device_index(self.name, region)
        location = "*" if cuda is None else f"cuda:{cuda}"
        rc = self._engine.register_memory(region.ptr, region.nbytes, location)
        if rc != 0:
            raise BackendError(self.name, "register", f"{region} refused", code=rc)

    def _unregister_region(self, region: BufferDescriptor) -> None:
        rc = self._engine.unregister_memory(region.ptr)
        if rc != 0:
            raise BackendError(self.name, "unregister", f"{region} refused", code=rc)

    def metadata(self) -> bytes:
        """The session id ``host:rpc_port`` a peer passes to ``connect``."""
        return self._session.encode()

    def connect(self, peer_metadata: bytes) -> str:
        """Validate a peer's session id; the probe and the handshake happen on the first write."""
        session = peer_metadata.decode("ascii", errors="replace")
        match = _SESSION.match(session)
        with self._lock:
            self._check_open("connect")
            if match is None or not 0 < int(match.group(2)) < 65536 or not _is_ipv4(match[1]):
                raise BackendError(self.name, "connect", f"not a session id 'a.b.c.d:port': {session!r}")
            self._peers.setdefault(session, _Peer())
        return session

    def disconnect(self, peer: str) -> None:
        """Forget ``peer`` and close the engine's TCP connections to it, in the background.

        The connections are closed by a read of one byte per lane from the address last written
        to the peer into the scratch buffer (see the module notes): once any write still running
        to it has ended, and bounded like a write by ``MC_TRANSFER_TIMEOUT``. A peer never
        written to has no connections. Unknown peers are ignored.
        """
        with self._lock:
            state = self._peers.pop(peer, None)
            if self._closed or state is None or not state.last_dst:
                return
            engine = self._engine
        try:
            self._start_helper(self._close_lanes, (engine, peer, state, self._scratch),
                               f"mooncake-disconnect-{peer}")
        except RuntimeError as exc:  # no thread could be started
            raise BackendError(self.name, "disconnect", str(exc), peer=peer) from exc

    def _close_lanes(self, engine: object, peer: str, state: _Peer, scratch: np.ndarray) -> None:
        """Runs in the helper thread of ``disconnect``: one byte read back per lane, each read a
        batch of its own, polled as a write's entries are (a frozen peer holds them until the
        engine's transfer timeout, which a spinning wait would spend on a core)."""
        outcome = _Outcome()
        with state.lock:
            try:
                in_flight = collections.deque()
                for lane in range(_LANES):
                    batch = engine.batch_transfer_async_read(
                        peer, [scratch.ctypes.data + lane], [state.last_dst], [1])
                    if not 0 < batch < 2**63:
                        outcome.failed_call, outcome.code = "batch_transfer_async_read", -1
                        break
                    in_flight.append((lane, batch))
                pause = self.POLL_FIRST_S
                while in_flight:
                    pause = self._poll(engine, in_flight, outcome, pause)
            except Exception as exc:  # nothing waits for this thread: say what happened
                log.warning("mooncake: disconnecting %s: %s: %s", peer, type(exc).__name__, exc)
                return
        log.info("mooncake: disconnected %s (read back %s)", peer, "fine: it is still up"
                 if not outcome.failed_call else f"failed ({outcome.code}): it is gone")

    def _write(self, peer: str, src: np.ndarray, dst: np.ndarray, length: np.ndarray, *,
               deadline: float, timeout_s: float) -> None:
        """Write the entries, each a batch of its own, at most ``max_batch * batches_in_flight``
        in flight (``_run_batches``), in a helper thread (one write per peer at a time); the
        peer's endpoint is probed first until it has answered once.

        Raises BackendError(op, peer, code) when the engine reports a failure, TransferTimeout
        when ``timeout_s`` passes first. In both cases the destination may still be written
        after this returns: Mooncake keeps landing entries of a failed or abandoned batch.
        """
        with self._write_section(peer, src, length) as (state, _):
            engine = self._engine
            state.last_dst = int(dst[0])
            probe = None if state.answered else self._start_probe(engine, peer, state)
        if probe is not None:
            self._await_probe(peer, probe, deadline, f"{len(src)} entries not done after {timeout_s} s")
        peer_lock = state.lock
        if not peer_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TransferTimeout(
                self.name, "write", "an earlier write to this peer is still running", peer=peer
            )
        outcome = _Outcome()
        try:
            self._start_helper(self._run_batches,
                               (engine, peer, peer_lock, src, dst, length, outcome),
                               f"mooncake-write-{peer}")
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

    def _start_probe(self, engine: object, peer: str, state: _Peer) -> _Probe:
        """The probe in flight for ``peer``, started if there is none (called under the lock)."""
        if state.probe is not None:
            return state.probe
        probe = state.probe = _Probe()

        def run() -> None:
            try:
                probe.code = engine.send_probe(peer)
            except Exception as exc:  # a binding error must not pass for an answer
                probe.detail = f"{type(exc).__name__}: {exc}"
            with self._lock:
                state.answered = probe.code == 0
                state.probe = None
            probe.done.set()

        try:
            self._start_helper(run, (), f"mooncake-probe-{peer}")
        except RuntimeError as exc:  # no thread could be started
            state.probe = None
            raise BackendError(self.name, "send_probe", str(exc), peer=peer) from exc
        return probe

    def _await_probe(self, peer: str, probe: _Probe, deadline: float, late: str) -> None:
        """Wait for the probe until the write's deadline; ``late`` says what a timeout means."""
        if not probe.done.wait(max(0.0, deadline - time.monotonic())):
            raise TransferTimeout(
                self.name, "send_probe",
                f"{late}: the peer's engine endpoint did not answer a probe (Mooncake's own first "
                "contact would stall every write of this engine for up to 60 s)", peer=peer)
        if probe.code != 0:
            raise BackendError(
                self.name, "send_probe",
                probe.detail or "the peer's engine endpoint refused the probe (gone, or not Mooncake)",
                peer=peer, code=probe.code)

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
        """Submit the entries, each as a batch of its own, at most ``max_batch *
        batches_in_flight`` in flight, the next submitted as the earliest ends; each polled with
        ``transfer_check_status``, sleeping between polls that found nothing ended (runs in the
        write's helper thread; see the module notes). After a failure nothing more is submitted,
        but every entry already submitted is waited for, so none lands after the write has ended
        here."""
        window = self.max_batch * self.batches_in_flight
        in_flight: collections.deque[tuple[int, int]] = collections.deque()  # (entry, batch)
        srcs, dsts, lengths = src.tolist(), dst.tolist(), length.tolist()
        entry, pause = 0, self.POLL_FIRST_S
        try:
            while True:
                while entry < len(srcs) and len(in_flight) < window and not outcome.failed_call:
                    batch = engine.batch_transfer_async_write(
                        peer, [srcs[entry]], [dsts[entry]], [lengths[entry]])
                    if not 0 < batch < 2**63:  # 0 or (uint64)-1: nothing was submitted
                        outcome.first_entry = entry
                        outcome.failed_call, outcome.code = "batch_transfer_async_write", -1
                        break
                    in_flight.append((entry, batch))
                    entry += 1
                if not in_flight:
                    break
                pause = self._poll(engine, in_flight, outcome, pause)
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

    def _poll(self, engine: object, in_flight: collections.deque, outcome: _Outcome,
              pause: float) -> float:
        """One poll of ``in_flight`` (``_reap``), then a sleep of ``pause`` if nothing had ended;
        the next pause: the first again after an end, else doubled up to ``POLL_MAX_S``."""
        if self._reap(engine, in_flight, outcome):
            return self.POLL_FIRST_S
        time.sleep(pause)
        return min(2 * pause, self.POLL_MAX_S)

    @staticmethod
    def _reap(engine: object, in_flight: collections.deque, outcome: _Outcome) -> bool:
        """Take the ended entries off the front of ``in_flight`` (a failed one's code in
        ``outcome`` unless an earlier failure is there); whether any ended. Mooncake frees an
        entry's batch when it reports it ended (1 done, -1 failed); -2 is its transfer
        timeout."""
        ended = False
        while in_flight:
            first, batch = in_flight[0]
            code = engine.transfer_check_status(batch)
            if code == 0:
                break
            in_flight.popleft()
            ended = True
            if code != 1 and not outcome.failed_call:
                outcome.first_entry = first
                outcome.failed_call, outcome.code = "transfer_check_status", code
        return ended

    def progress(self) -> None:
        """Nothing to do: the engine runs its own threads."""

    def transport(self) -> str:
        """'tcp' or 'rdma' — what the engine installed, whatever protocol was asked for."""
        return self._transport

    def close(self) -> None:
        """Wait for the helper threads (up to ``HELPERS_JOIN_S``), deregister every region and
        drop the engine; idempotent.

        A helper still running past the bound (a write abandoned by a timeout, a probe or a
        ``disconnect``, stuck on a frozen peer) keeps the engine alive until it ends (bounded by
        MC_TRANSFER_TIMEOUT / 60 s).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        running = join_helpers(self.helpers(), time.monotonic() + HELPERS_JOIN_S)
        if running:
            log.warning("mooncake: closing with %d helper thread(s) still in the engine: %s",
                        len(running), ", ".join(helper.name for helper in running))
        with self._lock:
            failures = self._unregister_all()
            rc = self._engine.unregister_memory(self._scratch.ctypes.data)
            if rc != 0:
                failures.append(f"scratch buffer refused (code {rc})")
            self._engine = None
            self._peers.clear()
        if failures:
            raise BackendError(self.name, "close", "; ".join(failures))
