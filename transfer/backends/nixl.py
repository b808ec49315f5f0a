"""NVIDIA NIXL (UCX backend) behind the TransferBackend interface.

Facts this module is built on (nixl-cu12 1.5.1 with its bundled UCX 1.23, see docs/engines.md):

- Errors are typed exceptions (nixlNotFoundError, nixlRemoteDisconnectError, ...) with no common
  base class; each one is turned into a BackendError that keeps the original message.
- The agent runs without a progress thread (it would busy-poll a core): the passive side must
  call ``progress()`` every few ms or the first transfer into it hangs, and the agent is not
  thread-safe in that mode — every agent call here holds one lock (NIXL calls this mode
  "caller-serialised"). Between processes of one host UCX moves the bytes by CMA inside
  ``transfer`` (the post): a 788 MB post held the lock, and so the control thread's
  ``progress()``, for the whole copy (150-600 ms here). A write therefore posts its descriptors
  in slices of at most ``post_bytes`` (8 MiB; a longer descriptor is split), taking the lock for
  one slice's post at a time, then polls them all, releasing the lock between polls: no agent
  call waits longer than one slice's copy. ``progress()`` does not wait at all while a write
  holds the lock (the write drives the agent itself), up to ``PROGRESS_MAX_SKIP_S``.
- There is no transfer timeout: a write that needs an unresponsive peer (to wire up, or over
  UCX tcp) stays "PROC" forever. ``write`` polls with its own deadline, then releases (cancels)
  the request and raises TransferTimeout. (Over CMA, once wired up, a write into a stopped
  process completes: process_vm_writev needs nothing from it.)
- A NIXL transfer needs the memory type and device of the *remote* descriptors, which the agent
  metadata does not tell us in a usable form. ``metadata()`` therefore wraps the agent metadata
  with the list of regions registered here; ``connect`` reads both, and ``write`` checks every
  destination range against them before the engine sees it.
- ``prep_xfer_dlist`` + ``make_prepped_xfer`` moves DSA-sized descriptors that lie apart as fast
  as ``initialize_xfer`` (or a little faster), and 1.3-2.8x faster when descriptors are adjacent
  on both sides, because it merges them. Writes use the prepped path.
- Over CMA each descriptor costs about 2.5 us besides its bytes: 7,930 DSA pages that lie apart
  took twice as long as the same bytes merged. The UCX backend's ``num_threads`` workers share a
  post longer than ``split_batch_size`` descriptors with the caller, who returns when all are
  copied: with 2 and 32 (``UCX_PARAMS``) such a write took 24 ms instead of 38, for 18 % more
  CPU; merged descriptors, fewer than 32 a slice, are not split. Idle, the workers cost nothing.
  But a worker is driven only while it copies: after ``remove_remote_agent`` each one kept its
  connection to a departed peer in CLOSE-WAIT until its next split post. ``disconnect``
  therefore posts a local copy of 512 one-byte descriptors in a scratch area of its own
  (``_Wake``), which gives every worker a share and so closes them, and ``progress()`` posts
  it four more times, 50 ms apart, for a worker the machine's load kept asleep through one.
"""

from __future__ import annotations

import importlib
import ipaddress
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...plugin.descriptors import BufferDescriptor, raw_region
from .base import (
    BackendError,
    BackendUnavailable,
    EngineBackend,
    FairLock,
    RegionTable,
    TransferTimeout,
    device_index,
)
from .environment import env_defaults, interface_of, rdma_devices, rdma_ports

log = logging.getLogger(__name__)

_MODULES = ("nixl_cu12", "nixl_cu13", "nixl")  # the wheels, then the meta package (imports torch)
_MAGIC = b"DSAB-NIXL/1\n"
_UCX_SETTINGS = ("UCX_TLS", "UCX_NET_DEVICES")
_POLL_SPIN = 200  # polls before the wait starts sleeping
_POLL_MAX_SLEEP_S = 0.001
POST_BYTES = 8 * 2**20  # bytes per posted slice: one slice's CMA copy is the longest lock hold
PROGRESS_MAX_SKIP_S = 0.05  # progress() skips a busy agent for at most this long after it ran
# The UCX backend's parameters unless the operator gives them: a post of over 32 descriptors is
# split across two worker threads besides the caller (a slice holds ~200 DSA pages)
UCX_PARAMS = {"num_threads": "2", "split_batch_size": "32"}
# A wake's descriptors: 16 shares of 32 (1.6 ms here); one of two threads missed 6 shares now
# and then
WAKE_DESCRIPTORS = 512
WAKE_TIMEOUT_S = 1.0
# ... posted at a disconnect and again by the next progress() calls, WAKE_GAP_S apart: a worker
# thread the machine's load keeps asleep through one wake (seen under load) gets the next
WAKE_REPEATS = 5
WAKE_GAP_S = 0.05


def _import_nixl() -> tuple[Any, tuple[type[Exception], ...]]:
    """``(its _api module, its exception classes)`` from the first NIXL package found."""
    missing = []
    for module in _MODULES:
        try:
            api = importlib.import_module(f"{module}._api")
        except ImportError as exc:
            missing.append(f"{module}: {exc}")
            continue
        errors = tuple(
            value
            for key, value in vars(api.nixlBind).items()
            if key.startswith("nixl") and isinstance(value, type) and issubclass(value, Exception)
        )
        return api, errors
    raise BackendUnavailable(
        "nixl", "import", f"no NIXL package ({'; '.join(missing)}); install nixl-cu12 (no CUDA "
        "or CUDA 12) or nixl-cu13 (CUDA 13), each bundles UCX"
    )


def _parse_metadata(data: bytes) -> tuple[str, list[BufferDescriptor], bytes]:
    """``(agent name, announced regions, NIXL agent metadata)`` from what ``metadata()`` built."""
    try:
        if not data.startswith(_MAGIC):
            raise ValueError("not dsa-bridge NIXL metadata")
        start = len(_MAGIC) + 4
        size = int.from_bytes(data[len(_MAGIC) : start], "big")
        header = json.loads(data[start : start + size])
        regions = [raw_region(int(p), int(n), str(d)) for p, n, d in header["regions"]]
        return str(header["agent"]), regions, data[start + size :]
    except (ValueError, KeyError, TypeError) as exc:
        raise BackendError("nixl", "connect", f"malformed peer metadata: {exc}") from exc


def _net_devices(host: str, devices: list[str] | None = None) -> str:
    """The UCX_NET_DEVICES that keeps UCX's TCP listener on ``host``'s interface ("" if unknown).

    UCX's TCP transport listens on the address of every network device it may use; it gets this
    host's interface only (``lo`` for a loopback host), plus the RDMA ports of ``devices`` (the
    operator's, sglang's ``--disaggregation-ib-device`` for this GPU), or of every RDMA device
    where none are named, so that UCX keeps its RDMA transports (untested here: no RDMA
    device). CMA and shared memory are not network devices.
    """
    try:
        if ipaddress.ip_address(host).is_loopback:
            return "lo"
    except ValueError:
        return "lo" if host == "localhost" else ""
    interface = interface_of(host)
    ports = [port for port in rdma_ports() if devices is None or port.split(":")[0] in devices]
    return ",".join([interface, *ports]) if interface else ""


def device_list_of(params: dict[str, str]) -> list[str] | None:
    """The RDMA devices NIXL's UCX ``device_list`` parameter names (None: not given)."""
    given = params.get("device_list")
    return None if given is None else [name.strip() for name in given.split(",") if name.strip()]


class NixlBackend(EngineBackend[RegionTable]):
    """TransferBackend over a ``nixl_agent`` with the UCX backend and no progress thread."""

    name = "nixl"
    tick_ms = 2  # the passive side's ``progress`` every few ms (no progress thread)
    needs_progress = True

    def __init__(self, *, host: str = "127.0.0.1", agent_name: str = "",
                 post_bytes: int = POST_BYTES, backend_params: dict[str, str] | None = None) -> None:
        """``backend_params``: the UCX backend's parameters (NIXL's ``create_backend``), as
        sglang's ``SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS``, over ``UCX_PARAMS``; its
        ``device_list`` names the RDMA devices UCX may use, each one this machine must have
        (refused by name otherwise, never left to fall back to TCP)."""
        if post_bytes < 1:
            raise BackendError(self.name, "init", f"post_bytes must be >= 1, got {post_bytes}")
        self.post_bytes = post_bytes
        params = {**UCX_PARAMS, **(backend_params or {})}
        devices = device_list_of(params)
        missing = [name for name in devices or [] if name not in rdma_devices()]
        if missing or devices == []:
            raise BackendUnavailable(
                self.name, "init", f"UCX device_list names {', '.join(missing) or 'no device'}, "
                f"which this machine does not have (its RDMA devices: "
                f"{', '.join(rdma_devices()) or 'none'})")
        # UCX_NET_DEVICES binds UCX's listener to the interface of ``host`` (see _net_devices).
        # UCX_MODULES=^ib: without an RDMA device the InfiniBand module is useless, and loading
        # it (bundled rdma-core next to the system's libibverbs providers) makes every process
        # crash with SIGSEGV at exit.
        defaults = {"NIXL_LOG_LEVEL": "WARN"}
        net_devices = _net_devices(host, devices)
        if net_devices:
            defaults["UCX_NET_DEVICES"] = net_devices
        elif "UCX_NET_DEVICES" not in os.environ:
            log.warning("nixl: no interface of this machine holds %s: UCX listens on every "
                        "interface (set UCX_NET_DEVICES)", host)
        if not rdma_devices():
            defaults["UCX_MODULES"] = "^ib"
        with env_defaults(defaults):
            api, self._errors = _import_nixl()
            self.agent_name = agent_name or f"dsa-bridge-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            ucx = ", ".join(f"{key}={os.environ.get(key, '<unset>')}" for key in _UCX_SETTINGS)
            config = api.nixl_agent_config(enable_prog_thread=False, backends=[])
            try:
                agent = api.nixl_agent(self.agent_name, config)
                if "UCX" in agent.get_plugin_list():
                    agent.create_backend("UCX", params)
            except (RuntimeError, *self._errors) as exc:
                raise BackendUnavailable(
                    self.name,
                    "create_agent",
                    f"{type(exc).__name__}: {exc} (no usable UCX transport? {ucx})",
                ) from exc
        if "UCX" not in agent.backends:
            raise BackendUnavailable(self.name, "create_agent", "this NIXL has no UCX plugin")
        self._mem_types = set(agent.get_backend_mem_types("UCX"))
        self._transport = f"ucx ({ucx})"
        self._agent = agent
        self._lock = FairLock()  # the agent lock: granted in order (see FairLock)
        self._init_bookkeeping()  # ``_peers``: the regions each peer announced
        self._reg_lists: dict[int, object] = {}
        self._unreleased: list[_Posting] = []
        self._progressed_at = time.monotonic()  # when progress() last drove the agent
        self._wake = _Wake.for_params(self, agent.get_backend_params("UCX"))
        log.info("nixl: agent %s up, transport %s", self.agent_name, self._transport)

    def _register_region(self, region: BufferDescriptor) -> None:
        cuda = device_index(self.name, region)
        mem = "DRAM" if cuda is None else "VRAM"
        if f"{mem}_SEG" not in self._mem_types:
            raise BackendError(self.name, "register", f"{region}: UCX cannot do {mem}")
        self._reg_lists[region.ptr] = self._call(
            "register_memory", "", self._agent.register_memory,
            [(region.ptr, region.nbytes, cuda or 0, "")], mem)

    def _unregister_region(self, region: BufferDescriptor) -> None:
        self._call("deregister_memory", "", self._agent.deregister_memory,
                   self._reg_lists.pop(region.ptr))

    def metadata(self) -> bytes:
        """The agent metadata, prefixed with the regions registered here (see the module notes)."""
        with self._lock:
            self._check_open("metadata")
            header = json.dumps(
                {
                    "agent": self.agent_name,
                    "regions": [[r.ptr, r.nbytes, r.device] for r in self._regions.regions.values()],
                }
            ).encode()
            agent_md = self._call("get_agent_metadata", "", self._agent.get_agent_metadata)
        return _MAGIC + len(header).to_bytes(4, "big") + header + agent_md

    def connect(self, peer_metadata: bytes) -> str:
        """Load a peer's agent metadata and remember its regions; returns the peer agent's name."""
        with self._lock:
            self._check_open("connect")
            expected, regions, agent_md = _parse_metadata(peer_metadata)
            table = RegionTable(self.name)
            try:
                if regions:
                    table.check_new(regions)
            except BackendError as exc:
                raise BackendError(self.name, "connect", f"peer announced {exc}") from exc
            table.add(regions)
            loaded = self._call("add_remote_agent", expected, self._agent.add_remote_agent, agent_md)
            peer = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if peer != expected:
                raise BackendError(self.name, "connect", f"metadata names agent {peer}", peer=expected)
            self._peers[peer] = table
        return peer

    def disconnect(self, peer: str) -> None:
        """Forget ``peer``'s regions and remove its remote agent (UCX closes its endpoints).

        A write to it still polling then ends with a BackendError (NIXL reports the agent as
        invalidated); its request is released as after any failure. Unknown peers are ignored.
        """
        with self._lock:
            if self._closed or self._peers.pop(peer, None) is None:
                return
            self._call("remove_remote_agent", peer, self._agent.remove_remote_agent, peer)
            if self._wake:
                self._wake.start(self, time.monotonic())

    def _write(self, peer: str, src: np.ndarray, dst: np.ndarray, length: np.ndarray, *,
               deadline: float, timeout_s: float) -> None:
        """Check every destination range against the regions the peer announced, post the
        descriptors in slices of ``post_bytes`` and poll until all are "DONE".

        Raises BackendError on an engine error ("ERR" or a nixl exception, message kept) and
        TransferTimeout when ``timeout_s`` passes first; the request is then released (UCX
        cancels it) and the destination may still be partly written.
        """
        with self._write_section(peer, src, length) as (remote, local_slot):
            remote_slot = remote.locate("dst", dst, length, peer=peer)
            lists = _xfer_lists(self._regions, local_slot, src, length, remote, remote_slot, dst)
        postings: list[_Posting] = []
        try:
            for (local_mem, local_descs), (remote_mem, remote_descs) in lists:
                local_descs, remote_descs = split_descriptors(local_descs, remote_descs,
                                                              self.post_bytes)
                posting = self._prepare(peer, local_mem, local_descs, remote_mem, remote_descs)
                postings.append(posting)
                for first, end in slices(local_descs[:, 1], self.post_bytes):
                    self._post(peer, posting, first, end)
            self._wait(peer, [r for p in postings for r in p.requests], deadline, len(src),
                       timeout_s)
        finally:
            with self._lock:
                self._release(postings)

    def _prepare(self, peer: str, local_mem: str, local_descs: np.ndarray, remote_mem: str,
                 remote_descs: np.ndarray) -> _Posting:
        """Both descriptor lists prepared (the prepped path: as fast as ``initialize_xfer`` for
        descriptors that are apart, much faster when some are adjacent on both sides, because it
        merges them)."""
        with self._lock:
            self._check_open("write")
            agent = self._agent
            mine = self._call("prep_xfer_dlist", peer, agent.prep_xfer_dlist, "", local_descs,
                              local_mem)
            try:
                theirs = self._call("prep_xfer_dlist", peer, agent.prep_xfer_dlist, peer,
                                    remote_descs, remote_mem)
            except BackendError:
                mine.release()
                raise
        return _Posting([], [mine, theirs])

    def _post(self, peer: str, posting: _Posting, first: int, end: int) -> None:
        """Make and post the request of descriptors ``first:end`` of ``posting``'s lists; the
        lock is held for this one post (and, over CMA, its copy) only."""
        index = np.arange(first, end, dtype=np.int32)
        with self._lock:
            self._check_open("write")
            mine, theirs = posting.lists
            request = self._call("make_prepped_xfer", peer, self._agent.make_prepped_xfer,
                                 "WRITE", mine, index, theirs, index)
            posting.requests.append(request)
            if self._call("transfer", peer, self._agent.transfer, request) == "ERR":
                raise BackendError(self.name, "transfer", "posting failed", peer=peer)

    def _wait(self, peer: str, handles: list[object], deadline: float, count: int, timeout_s: float) -> None:
        """Poll the requests until all are DONE; spin briefly, then back off to 1 ms sleeps."""
        pending, polls = list(handles), 0
        while True:
            with self._lock:
                if self._closed:
                    raise BackendError(self.name, "write", "backend closed during the write")
                states = [
                    self._call("check_xfer_state", peer, self._agent.check_xfer_state, h) for h in pending
                ]
            if "ERR" in states:
                raise BackendError(self.name, "check_xfer_state", "transfer in ERR state", peer=peer)
            pending = [h for h, state in zip(pending, states, strict=True) if state != "DONE"]
            if not pending:
                return
            if time.monotonic() >= deadline:
                raise TransferTimeout(
                    self.name,
                    "write",
                    f"{count} descriptors not done after {timeout_s} s",
                    peer=peer,
                )
            polls += 1
            if polls > _POLL_SPIN:
                time.sleep(min(_POLL_MAX_SLEEP_S, max(0.0, deadline - time.monotonic())))

    def progress(self) -> None:
        """Drive the agent (the passive side must call this every few ms); drops notifications.

        While another call holds or waits for the agent lock (a write posting or polling, which
        drives the agent itself), this returns at once instead of queueing behind it: waiting
        cost the control thread up to one slice's copy per tick, and the write the hand-over of
        the lock to and from the control thread at every tick (10-30 % of its time with 16-64
        requests in flight). ``PROGRESS_MAX_SKIP_S`` after it last ran, it waits its turn."""
        if not self._lock.acquire_if_free():
            if time.monotonic() - self._progressed_at < PROGRESS_MAX_SKIP_S:
                return
            self._lock.acquire()
        self._progressed_at = time.monotonic()
        try:
            if self._closed:
                return
            if self._unreleased:
                self._release(self._unreleased)
            notifs = self._call("get_new_notifs", "", self._agent.get_new_notifs)
            if self._wake:
                self._wake.again(self, self._progressed_at)
        finally:
            self._lock.release()
        if notifs:
            log.debug("nixl: ignored notifications from %s", sorted(notifs))

    def transport(self) -> str:
        """'ucx (UCX_TLS=..., UCX_NET_DEVICES=...)'; UCX picks cma, tcp, ... per peer in them."""
        return self._transport

    def close(self) -> None:
        """Forget the peers, deregister every region and drop the agent; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            failures = []
            self._release(self._unreleased)
            for peer in list(self._peers):
                try:
                    self._call("remove_remote_agent", peer, self._agent.remove_remote_agent, peer)
                except BackendError as exc:
                    failures.append(str(exc))
            self._peers.clear()
            failures += self._unregister_all()
            if self._wake:
                self._call("deregister_memory", "", self._agent.deregister_memory,
                           self._wake.registration)
            if self._unreleased:
                failures.append(f"{len(self._unreleased)} transfer requests could not be released")
            self._agent = None
        if failures:
            raise BackendError(self.name, "close", "; ".join(failures))

    def _call(self, op: str, peer: str, method: Callable[..., Any], *args: object) -> Any:
        """Run one agent call, turning a nixl exception into a BackendError with its message."""
        try:
            return method(*args)
        except self._errors as exc:
            raise BackendError(self.name, op, f"{type(exc).__name__}: {exc}", peer=peer) from exc

    def _release(self, postings: list[_Posting]) -> None:
        """Release (cancelling if still running) each posting's requests, then its descriptor
        lists. A posting with a request NIXL refuses to release keeps that request and its
        lists; ``progress()`` retries them."""
        kept = []
        for posting in postings:
            left = []
            for request in posting.requests:
                try:
                    request.release()
                except self._errors as exc:
                    log.warning("nixl: cannot release a transfer request yet: %s", exc)
                    left.append(request)
            posting.requests = left
            if left:
                kept.append(posting)
                continue
            for dlist in posting.lists:
                dlist.release()
            posting.lists = []
        self._unreleased = [p for p in self._unreleased if p not in postings] + kept


@dataclass(eq=False)
class _Wake:
    """A local copy that gives each of the UCX backend's worker threads a share, so that each
    drives its worker once (see the module notes): ``WAKE_DESCRIPTORS`` one-byte descriptors from the
    even bytes of a scratch area to its odd ones (none adjacent, none merged), posted
    ``WAKE_REPEATS`` times after a disconnect. The caller holds the agent lock."""

    scratch: np.ndarray
    registration: object
    evens: object  # the descriptor lists (NIXL's), made once
    odds: object
    due: int = 0  # posts still to come
    posted_at: float = 0.0

    @classmethod
    def for_params(cls, backend: NixlBackend, params: dict[str, str]) -> _Wake | None:
        """The wake for a backend made with ``params`` (None: it has no worker threads)."""
        if int(params.get("num_threads", "0")) <= 0:
            return None
        agent, scratch = backend._agent, np.zeros(2 * WAKE_DESCRIPTORS, dtype=np.uint8)
        registration = backend._call("register_memory", "", agent.register_memory,
                                     [(scratch.ctypes.data, scratch.nbytes, 0, "")], "DRAM")
        evens, odds = ([(scratch.ctypes.data + 2 * i + odd, 1, 0) for i in range(WAKE_DESCRIPTORS)]
                       for odd in (0, 1))
        return cls(scratch, registration, agent.get_xfer_descs(evens, "DRAM"),
                   agent.get_xfer_descs(odds, "DRAM"))

    def start(self, backend: NixlBackend, now: float) -> None:
        """Post now, and ``WAKE_REPEATS - 1`` more times from ``again``."""
        self.due, self.posted_at = WAKE_REPEATS - 1, now
        self.post(backend)

    def again(self, backend: NixlBackend, now: float) -> None:
        """Post if one is due and ``WAKE_GAP_S`` passed since the last."""
        if self.due and now - self.posted_at >= WAKE_GAP_S:
            self.due, self.posted_at = self.due - 1, now
            self.post(backend)

    def post(self, backend: NixlBackend) -> None:
        """Copy the scratch area's even bytes to its odd ones and wait; a failure is logged:
        the connections then close at the workers' next split post."""
        agent, deadline = backend._agent, time.monotonic() + WAKE_TIMEOUT_S
        try:
            request = agent.initialize_xfer("WRITE", self.evens, self.odds, backend.agent_name)
            try:
                state = agent.transfer(request)
                while state not in ("DONE", "ERR") and time.monotonic() < deadline:
                    state = agent.check_xfer_state(request)
            finally:
                request.release()
        except backend._errors as exc:
            state = f"{type(exc).__name__}: {exc}"
        if state != "DONE":
            log.warning("nixl: waking the worker threads failed (%s); their connections to a "
                        "departed peer close at their next post", state)


@dataclass(eq=False)
class _Posting:
    """The requests posted from one pair of prepared descriptor lists, and the lists."""

    requests: list[object]
    lists: list[object]


def split_descriptors(local: np.ndarray, remote: np.ndarray,
                      limit: int) -> tuple[np.ndarray, np.ndarray]:
    """Nx3 (addr, len, device) local/remote descriptor arrays with every descriptor longer than
    ``limit`` bytes cut into consecutive pieces of at most ``limit`` (both sides alike)."""
    lengths = local[:, 1]
    pieces = np.maximum(1, (lengths + np.uint64(limit - 1)) // np.uint64(limit)).astype(np.int64)
    if (pieces == 1).all():
        return local, remote
    row = np.repeat(np.arange(len(local)), pieces)
    offset = (np.arange(row.size) - np.repeat(np.cumsum(pieces) - pieces, pieces)).astype(
        np.uint64) * np.uint64(limit)
    cut = []
    for descs in (local, remote):
        out = descs[row].copy()
        out[:, 0] += offset
        out[:, 1] = np.minimum(descs[row, 1] - offset, np.uint64(limit))
        cut.append(out)
    return cut[0], cut[1]


def slices(lengths: np.ndarray, limit: int) -> list[tuple[int, int]]:
    """Consecutive ``(first, end)`` index ranges whose lengths sum to at most ``limit`` bytes
    each, each as long as that allows (a single longer descriptor is a range of its own); one
    search per range, not a Python step per descriptor."""
    ends = np.cumsum(lengths, dtype=np.uint64)
    out, first, done = [], 0, 0
    while first < len(ends):
        end = max(first + 1, int(np.searchsorted(ends, np.uint64(done + limit), side="right")))
        out.append((first, end))
        first, done = end, int(ends[end - 1])
    return out


def _xfer_lists(
    local: RegionTable,
    local_slot: np.ndarray,
    src: np.ndarray,
    length: np.ndarray,
    remote: RegionTable,
    remote_slot: np.ndarray,
    dst: np.ndarray,
) -> list[tuple[tuple[str, np.ndarray], tuple[str, np.ndarray]]]:
    """Nx3 (addr, len, device) arrays, one local/remote pair per (local, remote) memory type."""
    local_cuda, remote_cuda = local.on_cuda[local_slot], remote.on_cuda[remote_slot]
    lists = []
    for lc in (False, True):
        for rc in (False, True):
            pick = (local_cuda == lc) & (remote_cuda == rc)
            if not pick.any():
                continue
            mine = np.column_stack((src[pick], length[pick], local.device_ids[local_slot[pick]]))
            theirs = np.column_stack((dst[pick], length[pick], remote.device_ids[remote_slot[pick]]))
            lists.append((("VRAM" if lc else "DRAM", mine), ("VRAM" if rc else "DRAM", theirs)))
    return lists
