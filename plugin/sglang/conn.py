"""dsa-bridge as sglang's PD transfer: KVManager, KVSender, KVReceiver and BootstrapServer.

Imported only where ``sglang`` is installed. The classes implement
``sglang.srt.disaggregation.base.conn`` as sglang 0.5.23's scheduler queues call them, over
dsa-bridge's ``PrefillNode`` / ``DecodeNode`` (layer-id pairing, bounds checks before any write,
deadlines, KVPoll states):

- ``DSABridgeKVManager(args, mode, server_args, is_mla_backend)``: one per scheduler rank. From
  the rank's ``KVArgs`` (``kvargs.bridge_buffers``: KV, DSA state and aux buffers with
  derived layer ids) it starts a ``PrefillNode`` and registers that node's control endpoint in
  sglang's bootstrap server (``PUT /route``, sglang's payload, ``kv_layout`` marking it
  dsa-bridge's); on decode it fetches the prefill's parallel info (``GET /route`` with -1s) and
  its ranks (``GET /route`` per rank), and starts one ``DecodeNode`` per prefill (DP group):
  handshake, layouts compared, buffers paired by layer id, before any request. KVArgs that are
  not a DSA pool (``kvargs.dsa_problem``) get sglang's own manager of the configured
  backend instead (logged): sglang's ``get_kv_class`` does not know the model, its KVArgs do.
- ``DSABridgeKVSender``: ``init(num_kv_indices, aux_index)``, ``send(kv_indices, state_indices)``
  (the DSA state indices, with the last chunk, must be the request's KV pages: one function
  derives the indexer pages), ``poll()``, ``failure_exception()`` raising, ``abort()``.
- ``DSABridgeKVReceiver``: ``init(prefill_dp_rank)`` (connects to that prefill; a refused
  handshake fails the request, with the reason), ``send_metadata(kv_indices, aux_index,
  state_indices, decode_prefix_len, destination)``, ``poll()``, ``failure_exception()``,
  ``abort()``, ``clear()``.
- ``DSABridgeKVBootstrapServer``: sglang's own HTTP registry (``CommonKVBootstrapServer``, the
  routes its decode calls), so prefill ranks of either connector register there.

Senders and receivers built over a sglang manager (the non-DSA fallback) are sglang's own.
Limits (refused with a message, see docs/sglang.md): equal attention-TP widths on both sides,
attention CP 1, no KV sharding, decode with one pipeline stage, prefill DP only when decode
can compute the rank (one DP group or ``follow_bootstrap_room``), device destinations only, no
decode radix-cache prefix.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time

import numpy as np
import requests
from sglang.srt.disaggregation.base.conn import (
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVPoll,
    KVTransferDestination,
    KVTransferMetric,
)
from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer, PrefillServerInfo
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs
from sglang.srt.runtime_context import get_disagg, get_parallel, get_serving
from sglang.srt.utils.network import get_local_ip_auto

from ...transfer.backends import create_backend
from ...transfer.decode import DecodeNode
from ...transfer.handshake import HandshakeError
from ...transfer.prefill import PrefillNode
from .kvargs import bridge_buffers, dsa_problem

log = logging.getLogger(__name__)

KV_LAYOUT_MARK = "dsa-bridge"  # the kv_layout a dsa-bridge prefill registers: decode requires it
BACKENDS = {"mooncake": ("sglang.srt.disaggregation.mooncake", "Mooncake"),
            "nixl": ("sglang.srt.disaggregation.nixl", "Nixl")}
HTTP_TIMEOUT_S = 5.0
REGISTER_WAIT_S = 30.0  # for the bootstrap server to listen when a prefill rank registers


def sglang_class(backend: str, role: str) -> type:
    """sglang's own class for ``role`` ("KVManager", "KVSender", ...) of ``backend``."""
    module, prefix = BACKENDS[backend]
    return getattr(importlib.import_module(module), prefix + role)


def _backend_of(server_args) -> str:
    backend = str(getattr(server_args.disaggregation_transfer_backend, "value",
                          server_args.disaggregation_transfer_backend))
    if backend not in BACKENDS:
        raise ValueError(f"dsa-bridge serves the transfer backends {sorted(BACKENDS)}, not {backend!r}")
    return backend


def _host() -> str:
    return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(get_serving().host, get_serving().host)


class DSABridgeKVManager(BaseKVManager):
    """One scheduler rank's transfer: a dsa-bridge node over the rank's KVArgs (module docstring)."""

    def __new__(cls, args, disaggregation_mode, server_args, is_mla_backend=False, **kwargs):
        problem = dsa_problem(args)
        if problem is None:
            return super().__new__(cls)
        fallback = sglang_class(_backend_of(server_args), "KVManager")
        log.info("dsa-bridge: %s; sglang's %s moves this pool", problem, fallback.__name__)
        return fallback(args, disaggregation_mode, server_args, is_mla_backend, **kwargs)

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False):
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = is_mla_backend
        self.backend = _backend_of(server_args)
        parallel = get_parallel()
        self.attn_tp_size, self.attn_tp_rank = parallel.attn_tp_size, parallel.attn_tp_rank
        self.attn_dp_size, self.attn_dp_rank = parallel.attn_dp_size, parallel.attn_dp_rank
        self.pp_size, self.pp_rank = parallel.pp_size, getattr(args, "pp_rank", 0) or 0
        self.system_dp_size = parallel.dp_size
        self.system_dp_rank = getattr(args, "system_dp_rank", 0) or 0
        self.local_ip = get_local_ip_auto()
        limits = [name for name, on in (
            ("attention context parallelism (attn_cp_size > 1)", parallel.attn_cp_size > 1),
            ("KV cache sharding", bool(parallel.enable_kv_cache_sharding)),
            ("a decode side with several pipeline stages",
             disaggregation_mode == DisaggregationMode.DECODE and self.pp_size > 1)) if on]
        if limits:
            raise ValueError(f"dsa-bridge's transfer does not support {', '.join(limits)} (docs/sglang.md)")
        prefill = disaggregation_mode == DisaggregationMode.PREFILL
        start = (getattr(args, "prefill_start_layer", 0) or 0) if prefill else 0
        device = "cpu" if getattr(args, "gpu_id", None) is None or not _cuda() else f"cuda:{args.gpu_id}"
        self.bridge = bridge_buffers(args, start_layer=start, stages=self.pp_size, device=device)
        self._lock = threading.Lock()
        self.node: PrefillNode | None = None
        self.decode_nodes: dict[tuple[str, int], DecodeNode] = {}
        self.prefill_info_table: dict[str, PrefillServerInfo] = {}
        if prefill:
            name = f"prefill-dp{self.attn_dp_rank}-tp{self.attn_tp_rank}-pp{self.pp_rank}"
            self.node = PrefillNode(
                self.bridge.buffers, create_backend(self.backend, host=self.local_ip),
                listen=f"{self.local_ip}:0", name=name, aux_buffers=self.bridge.aux,
                request_timeout_s=float(envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get()))
            self.register_to_bootstrap()
        log.info("dsa-bridge: %s manager over %d layers (%s indexer layout), backend %s",
                 disaggregation_mode.value, self.bridge.layout.num_layers,
                 self.bridge.layout.indexer_layout, self.backend)

    # ---- prefill: the bootstrap registration -------------------------------------------------
    def register_to_bootstrap(self) -> None:
        """Register this rank's control endpoint with sglang's bootstrap server (``PUT /route``)."""
        host, port = self.node.endpoint.rsplit(":", 1)
        payload = {
            "attn_tp_size": self.attn_tp_size, "attn_tp_rank": self.attn_tp_rank,
            "attn_cp_size": 1, "attn_cp_rank": 0,
            "attn_dp_size": self.attn_dp_size, "attn_dp_rank": self.attn_dp_rank,
            "pp_size": self.pp_size, "pp_rank": self.pp_rank,
            "system_dp_size": self.system_dp_size, "system_dp_rank": self.system_dp_rank,
            "rank_ip": host, "rank_port": int(port), "page_size": self.kv_args.page_size,
            "kv_cache_dtype": self.kv_args.kv_cache_dtype_str, "kv_layout": KV_LAYOUT_MARK,
            "load_balance_method": get_parallel().load_balance_method,
            "prefill_http_port": get_serving().port,
        }
        url = f"http://{_host()}:{get_disagg().disaggregation_bootstrap_port}/route"
        deadline = time.monotonic() + REGISTER_WAIT_S
        while True:  # the bootstrap server (another process) may not be listening yet
            try:
                response = requests.put(url, json=payload, timeout=HTTP_TIMEOUT_S)
                break
            except requests.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        if response.status_code != 200:
            raise RuntimeError(f"dsa-bridge: the bootstrap server at {url} refused this prefill rank: "
                               f"{response.status_code} {response.text}")

    # ---- decode: parallel info and one node per prefill ------------------------------------
    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Fetch (once) the prefill's parallel info; False while it is not fully registered.
        A prefill dsa-bridge cannot pair with raises, naming why."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        url = (f"http://{bootstrap_addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
               "&target_tp_rank=-1&target_pp_rank=-1")
        try:
            response = requests.get(url, timeout=HTTP_TIMEOUT_S)
        except requests.RequestException as exc:
            log.warning("dsa-bridge: bootstrap server %s: %s", bootstrap_addr, exc)
            return False
        if response.status_code != 200:
            log.info("dsa-bridge: bootstrap server %s: %d %s", bootstrap_addr, response.status_code,
                     response.text)
            return False
        info = PrefillServerInfo(**response.json())
        problems = [f"{what}: prefill {theirs} != decode {ours}" for what, theirs, ours in (
            ("transfer (kv_layout)", info.kv_layout, KV_LAYOUT_MARK),
            ("page_size", info.page_size, self.kv_args.page_size),
            ("kv_cache_dtype", info.kv_cache_dtype, self.kv_args.kv_cache_dtype_str),
            ("attention TP width (dsa-bridge pairs rank r with rank r)", info.attn_tp_size,
             self.attn_tp_size),
            ("attention CP width", info.attn_cp_size, 1)) if theirs != ours]
        if info.dp_size > 1 and not info.follow_bootstrap_room:
            problems.append(f"prefill has {info.dp_size} DP groups and no follow_bootstrap_room: "
                            "decode cannot compute a request's group")
        if problems:
            raise RuntimeError(f"dsa-bridge cannot pair with the prefill at {bootstrap_addr}: "
                               + "; ".join(problems))
        self.prefill_info_table[bootstrap_addr] = info
        return True

    def _rank_endpoint(self, bootstrap_addr: str, dp_rank: int, pp_rank: int) -> str:
        url = (f"http://{bootstrap_addr}/route?prefill_dp_rank={dp_rank}&prefill_cp_rank=0"
               f"&target_tp_rank={self.attn_tp_rank}&target_pp_rank={pp_rank}")
        response = requests.get(url, timeout=HTTP_TIMEOUT_S)
        if response.status_code != 200:
            raise HandshakeError(f"bootstrap server {bootstrap_addr} has no prefill rank dp {dp_rank} "
                                 f"tp {self.attn_tp_rank} pp {pp_rank}: {response.status_code} "
                                 f"{response.text}")
        rank = response.json()
        return f"{rank['rank_ip']}:{rank['rank_port']}"

    def decode_node(self, bootstrap_addr: str, dp_rank: int) -> DecodeNode:
        """The node connected to prefill DP group ``dp_rank`` at ``bootstrap_addr`` (every
        pipeline stage of it), made and handshaken on first use."""
        with self._lock:
            node = self.decode_nodes.get((bootstrap_addr, dp_rank))
            if node is not None:
                return node
            if not self.try_ensure_parallel_info(bootstrap_addr):
                raise HandshakeError(f"the prefill at {bootstrap_addr} is not registered yet")
            stages = self.prefill_info_table[bootstrap_addr].pp_size
            endpoints = [self._rank_endpoint(bootstrap_addr, dp_rank, p) for p in range(stages)]
            node = DecodeNode(self.bridge.buffers, create_backend(self.backend, host=self.local_ip),
                              endpoints, name=f"decode-dp{self.attn_dp_rank}-tp{self.attn_tp_rank}",
                              request_timeout_s=float(envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get()),
                              aux_buffers=self.bridge.aux)
            self.decode_nodes[(bootstrap_addr, dp_rank)] = node
            return node

    def shutdown(self) -> None:
        """Close the nodes (and their engines)."""
        if self.node is not None:
            self.node.close()
        for node in self.decode_nodes.values():
            node.close()
        self.decode_nodes.clear()


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


class _Failed:
    """A request that failed before a dsa-bridge request existed for it."""

    def __init__(self, room: int, reason: str):
        self.room, self.reason = room, reason

    def exception(self) -> RuntimeError:
        return RuntimeError(f"room {self.room}: {self.reason}")


class DSABridgeKVSender(BaseKVSender):
    """One request on a prefill rank (``mgr.node.sender(room)``)."""

    def __new__(cls, mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank=False):
        if isinstance(mgr, DSABridgeKVManager):
            return super().__new__(cls)
        return sglang_class(_backend_of(mgr.server_args), "KVSender")(
            mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank)

    def __init__(self, mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank=False):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self._sent: list[np.ndarray] = []
        self._started = time.monotonic()
        self._failed: _Failed | None = None
        while not mgr.node.incoming.empty():  # rooms decode announced first: informational only
            mgr.node.incoming.get_nowait()
        try:
            self._sender = mgr.node.sender(bootstrap_room)
        except ValueError as exc:
            self._sender = None
            self._failed = _Failed(bootstrap_room, str(exc))

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        if self._sender is None:
            return
        try:
            self._sender.init(int(num_kv_indices), aux_index=aux_index)
        except ValueError as exc:
            self._sender.abort(f"bad init: {exc}")

    def send(self, kv_indices, state_indices=None, num_kv_tokens=None) -> None:
        if self._sender is None:
            return
        pages = np.asarray(kv_indices, dtype=np.int64)
        self._sent.append(pages)
        if state_indices is not None:
            problem = _state_problem(state_indices, np.concatenate(self._sent))
            if problem:
                self._sender.abort(problem)
                return
        self._sender.send(pages)

    def poll(self) -> KVPoll:
        return KVPoll.Failed if self._sender is None else int(self._sender.poll())

    def failure_exception(self):
        if self._failed is not None:
            raise self._failed.exception()
        raise self._sender.failure_exception() or RuntimeError(
            f"room {self.bootstrap_room}: not failed (status {self._sender.poll().name})")

    def abort(self) -> None:
        if self._sender is not None:
            self._sender.abort("aborted by sglang")

    def get_transfer_metric(self) -> KVTransferMetric:
        state = self._sender.state if self._sender is not None else None
        if state is None or state.finished_at is None:
            return KVTransferMetric()
        started = state.transferring_at or state.created
        return KVTransferMetric(transfer_latency_s=state.finished_at - started)


def _state_problem(state_indices, pages: np.ndarray) -> str | None:
    """The DSA state indices sglang passes must be the request's KV pages (the indexer page ids
    are the KV page ids); None when they are, or when sglang passed none."""
    if len(state_indices) != 1:
        return f"{len(state_indices)} state components, but the pool has only the DSA indexer"
    given = state_indices[0]
    if given is None:
        return None
    given = np.asarray(given, dtype=np.int64).ravel()
    if not np.array_equal(given, pages):
        return (f"DSA state indices ({given.size} pages) are not the request's KV pages "
                f"({pages.size}): dsa-bridge moves page p of the indexer with KV page p")
    return None


class DSABridgeKVReceiver(BaseKVReceiver):
    """One request on a decode rank, fed by the prefill DP group ``init`` names."""

    def __new__(cls, mgr, bootstrap_addr, bootstrap_room=None, **kwargs):
        if isinstance(mgr, DSABridgeKVManager):
            return super().__new__(cls)
        return sglang_class(_backend_of(mgr.server_args), "KVReceiver")(
            mgr, bootstrap_addr, bootstrap_room, **kwargs)

    def __init__(self, mgr, bootstrap_addr, bootstrap_room=None):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self.conclude_state = None
        self.require_staging = False
        self._node: DecodeNode | None = None
        self._receiver = None
        self._metadata_sent = False
        self._failed: _Failed | None = None

    def _fail(self, reason: str) -> None:
        if self._failed is None:
            log.warning("dsa-bridge: room %s failed: %s", self.bootstrap_room, reason)
            self._failed = _Failed(self.bootstrap_room, reason)
            if self._receiver is not None:
                self._receiver.abort(reason)

    def init(self, prefill_dp_rank: int) -> None:
        try:
            self._node = self.kv_mgr.decode_node(self.bootstrap_addr, int(prefill_dp_rank))
            self._receiver = self._node.receiver(self.bootstrap_room)
        except (HandshakeError, RuntimeError, ValueError, OSError) as exc:
            self._fail(f"prefill {self.bootstrap_addr} (dp {prefill_dp_rank}): {exc}")

    def send_metadata(self, kv_indices, aux_index=None, state_indices=None, decode_prefix_len=None,
                      destination=KVTransferDestination.DEVICE) -> None:
        if self._receiver is None:
            self._fail("send_metadata before a successful init")
            return
        if self._failed is not None:
            return
        pages = np.asarray(kv_indices, dtype=np.int64)
        problem = (
            "a decode radix-cache prefix (decode_prefix_len > 0) is not supported" if decode_prefix_len
            else f"destination {destination} is not supported (device only)"
            if destination != KVTransferDestination.DEVICE
            else _state_problem(state_indices, pages) if state_indices is not None else None)
        if problem:
            self._fail(problem)
            return
        try:
            self._receiver.init(pages, aux_index=aux_index)
        except ValueError as exc:
            self._fail(f"bad metadata: {exc}")
            return
        self._metadata_sent = True

    def poll(self) -> KVPoll:
        if self._failed is not None:
            return KVPoll.Failed
        if self._receiver is None:
            return KVPoll.Bootstrapping
        status = self._receiver.poll()
        if not self._metadata_sent and status != KVPoll.Failed:
            return KVPoll.WaitingForInput  # connected: ready for the pages
        return int(status)

    def failure_exception(self):
        if self._failed is not None:
            raise self._failed.exception()
        exc = self._receiver.failure_exception() if self._receiver is not None else None
        raise exc or RuntimeError(f"room {self.bootstrap_room}: not failed (status {self.poll()})")

    def abort(self) -> None:
        self._fail("aborted by sglang")

    def clear(self) -> None:
        if self._receiver is not None and self._receiver.can_release():
            self._node.forget(self._receiver)


class DSABridgeKVBootstrapServer(CommonKVBootstrapServer):
    """sglang's HTTP bootstrap registry, unchanged: dsa-bridge's prefill ranks register their
    control endpoints there (``PUT /route``) and its decode ranks look them up (``GET
    /route``) exactly as sglang's own connectors do, so either connector's ranks can use it."""
