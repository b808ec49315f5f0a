"""The sglang KVManager of dsa-bridge: one per scheduler rank (``conn.py`` is the overview).

``DSABridgeKVManager(args, mode, server_args, is_mla_backend)``: one per scheduler rank. From
the rank's ``KVArgs`` (``kvargs.bridge_buffers``: KV, DSA state and aux buffers with
derived layer ids) it starts a ``PrefillNode`` on the rank's IP (sglang's
``get_local_ip_auto``: ``SGLANG_HOST_IP`` or detected) and registers that node's control
endpoint in sglang's bootstrap server (``PUT /route``, sglang's payload, ``kv_layout`` marking
it dsa-bridge's) at the host sglang registers to (``bootstrap_host``); with pipeline stages it
keeps every stage's request status in sglang's ``PPConsensusStore`` for ``poll_pp_consensus``.
On decode it fetches the prefill's parallel info (``GET /route`` with -1s) and its ranks
(``GET /route`` per rank), and starts one ``DecodeNode`` per prefill (DP group): handshake,
layouts compared, buffers paired by layer id, before any request. Between two attention-TP
widths the ranks are mapped as sglang maps them for MLA pools (``tp_targets``): a wider
decode's ranks each receive the whole request from one prefill rank (which writes it to each:
``copies``); a wider prefill's request is written by one of its ranks, and decode tells the
others they have nothing to send (``nothing_to_send``), so their senders end with it. A
one-stage decode reads every prefill pipeline stage; a decode with the prefill's stages reads
its own stage's (``target_stages``; its first layer from its pool, ``stage_start_layer``). A
prefill it cannot pair with (``pairing_problems``) is refused, never raised:
``try_ensure_parallel_info`` answers False, logs the reason once, and that prefill's
receivers fail with it. A node that failed to connect is retried with backoff
(``PeerBackoff``), its requests failing at once meanwhile.
With attention context parallelism on prefill (``--attn-cp-size``), every CP rank holds the whole
cache and registers its CP rank; CP rank 0 writes every request and the others are dummy senders
(``is_dummy_cp_rank``, sglang's name), which decode never connects to: it reads CP rank 0 of its
``tp_targets``. With ``--enable-dsa-cache-layer-split`` each CP rank holds its own layers (its
KVArgs name them as a pipeline stage's: ``prefill_start_layer``) and writes them, and decode
reads every CP rank as it reads stages (``target_cp_ranks``). The other CP modes are refused at
start-up (``cp_problems``) and, from the prefill's parallel info, by decode (``pairing_problems``).
KVArgs that are not a DSA pool (``kvargs.dsa_problem``) get sglang's own manager of the
configured backend instead (logged): sglang's ``get_kv_class`` does not know the model, its
KVArgs do.

sglang's decode queue makes its HTTP calls on the manager's threads
(``_ensure_prefill_recompute_executor``: its prefill DP-rank queries); a retracted request's
rebootstrap asks the prefill to compute it again (``submit_prefill_recompute``: ``POST /generate``
at the HTTP port the prefill registered, once per request), a failure failing the request.

With sglang's ``prefill_complete`` allocation policy (``defer_allocation``) prefill senders are
deferred (no deadline until ``mark_prefill_complete``) and decode receivers reserve their request
first, allocating once the prefill is ready; each prefill registers its policy (``policy_mark``)
and decode refuses a prefill of the other one.

Each buffer is registered as the memory its pointer is (``memory_kinds``); HiSparse on decode is
refused at start-up. sglang's memory saver releases the cache through
``deregister_buffer_to_engine`` (running requests fail, the cache leaves the engines first) and
resumes it through ``register_buffer_to_engine``.

sglang's deferred decode release (``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE``, on by
default) is answered by dsa-bridge's fence: the manager supports it, ``register_deferred_abort_room``
arms a room, ``is_abort_release_safe(room, required_acks)`` is the fence's ``can_release`` for that
room's request, so sglang holds a failed request's pages exactly as long as the fence does. sglang
releases a held page at its own deadline (``..._TIMEOUT``) even unproven, and at once with
deferral off: a release the fence had not allowed (``clear_deferred_abort_state`` or ``clear``
while ``can_release`` is False) is counted (``forced_releases``) and logged. A cleared request
leaves its ``DecodeNode`` once its fence lifts (``forget_released``, run from sglang's next call
into the manager). ``--disaggregation-enable-kv-checksum`` turns dsa-bridge's checksums on in both
nodes.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import requests
from sglang.srt.disaggregation.base.conn import BaseKVManager, BaseKVReceiver, BaseKVSender, KVPoll
from sglang.srt.disaggregation.common.conn import PrefillServerInfo
from sglang.srt.disaggregation.pp_consensus_store import PPConsensusStore
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import get_ib_devices_for_gpu
from sglang.srt.environ import envs
from sglang.srt.runtime_context import get_disagg, get_memory, get_parallel, get_serving
from sglang.srt.utils.network import NetworkAddress, get_local_ip_auto

from ...transfer import auth
from ...transfer.backends import create_backend
from ...transfer.backends.environment import rdma_devices
from ...transfer.backends.shared import SharedEngine
from ...transfer.decode import DecodeNode, KVReceiver
from ...transfer.handshake import HandshakeError
from ...transfer.plan import as_aux_buffers
from ...transfer.prefill import PrefillNode
from .bringup import (
    KV_LAYOUT_MARK,
    PeerBackoff,
    PrefillGroup,
    backend_of,
    bootstrap_host,
    cp_problems,
    dummy_cp_rank,
    engine_options,
    pairing_problems,
    sglang_class,
    target_cp_ranks,
    target_stages,
    tp_targets,
)
from .early_send import EarlySendDispatcher
from .failures import TERMINAL
from .kvargs import bridge_buffers, dsa_problem
from .memory_kinds import hisparse_problem, kind_of, pointer_info
from .mixed import PrefillAborts, marked_route_query, policy_mark
from .paged_buffers import PagedBuffers
from .phases import PhaseLimits
from .pool import stage_start_layer

log = logging.getLogger(__name__)

HTTP_TIMEOUT_S = 5.0
ROUTE_RECHECK_S = 1.0  # how often an unreachable prefill's endpoints are looked up again
REGISTER_WAIT_S = 30.0  # for the bootstrap server to listen when a prefill rank registers
HTTP_WORKERS = 4  # threads for sglang's HTTP calls off its scheduler thread (DP-rank queries, rebootstrap)
STAGE_REPORT_S = 0.005  # how often a later pipeline stage reports its senders' statuses to stage 0
# decode's fence (DecodeNode): a failed engine write's bytes may land for IN_FLIGHT_GRACE_S after
# prefill reports it; pages on a silent prefill are held up to QUARANTINE_TIMEOUT_S
IN_FLIGHT_GRACE_S = 35.0
# the staged route is off inside sglang: it is slower for DSA pages on every engine measured
# (docs/benchmarks.md) and its staging area would be device memory taken from the KV cache
STAGING_BYTES = 0
QUARANTINE_TIMEOUT_S = 600.0
DEFERRED_RELEASE_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"


class DSABridgeKVManager(BaseKVManager):
    """One scheduler rank's transfer: a dsa-bridge node over the rank's KVArgs (module docstring)."""

    # sglang holds a failed request's decode pages until ``is_abort_release_safe``: answered by
    # dsa-bridge's fence (``KVReceiver.can_release``), not by an ack count
    supports_deferred_decode_kv_release = True

    def __new__(cls, args, disaggregation_mode, server_args, is_mla_backend=False, **kwargs):
        problem = dsa_problem(args)
        if problem is None:
            return super().__new__(cls)
        fallback = sglang_class(backend_of(server_args), "KVManager")
        log.info("dsa-bridge: %s; sglang's %s moves this pool", problem, fallback.__name__)
        return fallback(args, disaggregation_mode, server_args, is_mla_backend, **kwargs)

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False):
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = is_mla_backend
        self.backend = backend_of(server_args)
        parallel = get_parallel()
        self.attn_tp_size, self.attn_tp_rank = parallel.attn_tp_size, parallel.attn_tp_rank
        self.attn_dp_size, self.attn_dp_rank = parallel.attn_dp_size, parallel.attn_dp_rank
        self.pp_size, self.pp_rank = parallel.pp_size, getattr(args, "pp_rank", 0) or 0
        self.system_dp_size = parallel.dp_size
        self.system_dp_rank = getattr(args, "system_dp_rank", 0) or 0
        self.local_ip = get_local_ip_auto()
        ib_devices = get_ib_devices_for_gpu(getattr(args, "ib_device", None),
                                            getattr(args, "gpu_id", 0) or 0)
        self.engine_options = engine_options(  # RDMA where there is a device, as sglang's engine
            self.backend, protocol=envs.MOONCAKE_PROTOCOL.get(), ib_devices=ib_devices,
            forced_tcp=os.environ.get("MC_FORCE_TCP") == "1",
            rdma_present=bool(rdma_devices(ib_devices or "")))
        self._transport_logged = False
        prefill = disaggregation_mode == DisaggregationMode.PREFILL
        self.attn_cp_size, self.attn_cp_rank = parallel.attn_cp_size, parallel.attn_cp_rank
        problems = cp_problems(
            prefill=prefill, attn_cp_size=self.attn_cp_size,
            all_cp_ranks=bool(envs.SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER.get()),
            layer_split=bool(parallel.enable_dsa_cache_layer_split),
            kv_sharding=bool(parallel.enable_kv_cache_sharding),
            cp_tp_group_sharing=bool(parallel.enable_cp_tp_group_sharing))
        if problems:
            raise ValueError("dsa-bridge's transfer does not serve " + "; ".join(problems)
                             + " (docs/sglang.md)")
        # sglang's default CP mode: a prefill CP rank other than 0 writes nothing, its senders end
        # without decode (with layer split every CP rank writes its layers)
        self.is_dummy_cp_rank = prefill and dummy_cp_rank(
            self.attn_cp_size, self.attn_cp_rank, bool(parallel.enable_dsa_cache_layer_split))
        start = (getattr(args, "prefill_start_layer", 0) or 0) if prefill else self._stage_start(args)
        problem = hisparse_problem(not prefill, bool(get_memory().enable_hisparse))
        if problem:
            raise ValueError(problem)
        info = pointer_info(_cuda())  # each buffer registered as the memory its pointer is
        self.bridge = bridge_buffers(args, start_layer=start, stages=self.pp_size,
                                     device_of=lambda ptr: kind_of(ptr, info(ptr)).device)
        device = self.bridge.buffers.buffer_descriptors()[0].device
        self.pool = PagedBuffers(self.bridge.buffers, device)  # what the nodes take as their pool
        self.secret = auth.load_secret()  # DSA_BRIDGE_SECRET, the same on prefill and decode
        self.checksums = bool(get_disagg().disaggregation_enable_kv_checksum)  # both sides' flag
        self.allocation_policy = get_disagg().disaggregation_decode_allocation_policy
        self.defer_allocation = self.allocation_policy == "prefill_complete"  # (phases.py)
        self.phase_limits = PhaseLimits(  # sglang's per-phase bounds (phases.py)
            float(envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get()),
            float(envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get()))
        self.enable_deferred_decode_kv_release = bool(
            envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.get()
            and self.supports_deferred_decode_kv_release)
        self.forced_releases = 0  # pages sglang released while the fence still held them
        self._abort_generation = 0  # sglang's wire id of a held room's abort (kept, not sent)
        self._armed: dict[int, int] = {}  # room -> generation, while sglang holds its pages
        self._live: dict[int, BaseKVReceiver] = {}  # room -> receiver with a dsa-bridge request
        self._unreleased: list[tuple[DecodeNode, KVReceiver]] = []  # cleared, fence still up
        self.clock = time.monotonic  # the backoff's clock
        self._lock = threading.Lock()
        self.node: PrefillNode | None = None
        self.decode_nodes: dict[tuple[str, int], DecodeNode] = {}
        self._connecting: dict[tuple[str, int], Future] = {}  # connections being made
        self._connector: ThreadPoolExecutor | None = None  # makes them, off sglang's thread
        self.engine: SharedEngine | None = None  # decode: one engine for every node of the rank
        self.prefill_aborts: PrefillAborts | None = None  # decode: sglang's own prefills told
        self._http_calls: ThreadPoolExecutor | None = None  # decode: sglang's, off its thread
        self.groups: dict[tuple[str, int], PrefillGroup] = {}  # the ranks each node talks to
        self.node_failures: dict[tuple[str, int], PeerBackoff] = {}
        self.route_checked: dict[tuple[str, int], float] = {}  # when a lost prefill was looked up
        self.retired_nodes: list[DecodeNode] = []  # nodes of a restarted prefill, until idle
        self.prefill_info_table: dict[str, PrefillServerInfo] = {}
        self.refused_prefills: dict[str, str] = {}  # bootstrap address -> why it cannot pair
        self.stage_status: PPConsensusStore | None = None
        self._stage_senders: dict[int, BaseKVSender] = {}
        self._stop = threading.Event()
        self._stage_reporter: threading.Thread | None = None
        self.early_sends = EarlySendDispatcher(  # chunks held until sglang's forward wrote them
            f"dp{self.attn_dp_rank}-tp{self.attn_tp_rank}-pp{self.pp_rank}")
        self.memory_released = False  # sglang's memory saver released the cache (not resumed)
        if prefill:
            try:
                auth.check_listener(self.local_ip, self.secret, allow_insecure=False)
            except auth.AuthError:
                raise auth.AuthError(
                    f"dsa-bridge: this prefill rank listens on {self.local_ip} (SGLANG_HOST_IP or "
                    f"sglang's detection), which is not a loopback address: set {auth.SECRET_ENV} to "
                    "the same secret on prefill and decode") from None
            self.node = self._prefill_node(f"{self.local_ip}:0")
            self.log_transport(self.node.backend)
            self.register_to_bootstrap()
            if self.pp_size > 1:
                self._start_stage_consensus(parallel.pp_group)
        else:
            self._start_decode_engine()
            self._log_release_bounds()
        log.info("dsa-bridge: %s manager over %d layers (%s indexer layout) on %s, aux on %s, backend "
                 "%s, checksums %s", disaggregation_mode.value, self.bridge.layout.num_layers,
                 self.bridge.layout.indexer_layout, device, sorted(set(self.bridge.aux_devices)),
                 self.backend, "on" if self.checksums else "off")

    def _stage_start(self, args) -> int:
        """A decode stage's first global layer, which its ``KVArgs`` do not say: its pool's
        ``start_layer`` (dsa-bridge's pool records it); 0 with one stage."""
        if self.pp_size == 1:
            return 0
        start = stage_start_layer(args.kv_data_ptrs[0]) if args.kv_data_ptrs else None
        if start is None:
            raise ValueError("dsa-bridge: a decode with pipeline stages needs dsa-bridge's DSA pool "
                             "(its stage's first layer), and sglang built another (set "
                             "SGLANG_PLUGINS=dsa_bridge, or give decode --pp-size 1)")
        return start

    def _prefill_node(self, listen: str) -> PrefillNode:
        return PrefillNode(
            self.pool, create_backend(self.backend, host=self.local_ip, **self.engine_options),
            listen=listen, name=f"prefill-dp{self.attn_dp_rank}-tp{self.attn_tp_rank}-pp{self.pp_rank}",
            aux_buffers=self.bridge.aux_buffers, request_timeout_s=self.phase_limits.node_timeout_s,
            secret=self.secret, checksums=self.checksums, route="direct", staging_bytes=STAGING_BYTES)

    # ---- sglang's memory saver: the cache's memory released, then resumed --------------------
    def deregister_buffer_to_engine(self) -> None:
        """sglang releases the cache's memory (``release_memory_occupation``, with
        ``--enable-memory-saver``): every request still running fails, then the cache leaves the
        engine before its memory goes, so no write can reach that memory (a late one fails at
        the engine). Prefill closes its node, engine included; decode closes its nodes and
        deregisters the cache from the rank's engine. Until ``register_buffer_to_engine`` new
        requests fail, naming the release."""
        with self._lock:
            if self.memory_released:
                return
            self.memory_released = True
        reason = "the cache's memory was released (sglang's release_memory_occupation)"
        if self.node is not None:
            failed = self.node.abort_all(reason)
            self.node.close()
            log.info("dsa-bridge: prefill rank %s released its cache (%d request(s) failed)",
                     self.node.endpoint, failed)
            return
        live = list(self._live.values())
        for receiver in live:
            receiver._fail(reason)
        self._close_decode_nodes()
        self._live.clear()
        self._unreleased.clear()  # their pages leave with the memory: nothing can land there now
        self._registration.unregister(self._cache_regions())
        log.info("dsa-bridge: decode rank dp%d-tp%d released its cache (%d request(s) failed)",
                 self.attn_dp_rank, self.attn_tp_rank, len(live))

    def register_buffer_to_engine(self) -> None:
        """sglang resumed the cache's memory (``resume_memory_occupation``, at the same
        addresses): prefill starts its node again (a new engine, on the same port where it can:
        decode's nodes re-handshake with it; else a new port, registered with the bootstrap
        server), decode registers the cache with its engine again and connects anew on demand."""
        with self._lock:
            if not self.memory_released:
                return
            self.memory_released = False
        if self.node is None:
            self._registration.register(self._cache_regions())
            return
        try:
            self.node = self._prefill_node(self.node.endpoint)
        except OSError as exc:  # the port was taken meanwhile
            log.info("dsa-bridge: prefill rank %s: %s; listening on a new port", self.node.endpoint,
                     exc)
            self.node = self._prefill_node(f"{self.local_ip}:0")
            self.register_to_bootstrap()
        log.info("dsa-bridge: prefill rank %s resumed its cache", self.node.endpoint)

    def _close_decode_nodes(self) -> None:
        """Close every decode node: connected, retired, and made by an attempt still running
        (which ends first)."""
        made = [f.result()[0] for f in self._connecting.values() if f.exception() is None]
        for node in [*self.decode_nodes.values(), *self.retired_nodes, *made]:
            node.close()
        self.decode_nodes.clear()
        self.groups.clear()
        self.retired_nodes.clear()
        self._connecting.clear()

    def _cache_regions(self) -> list:
        return [*self.pool.buffer_descriptors(), *as_aux_buffers(self.bridge.aux_buffers)]

    # ---- prefill: the bootstrap registration -------------------------------------------------
    def register_to_bootstrap(self) -> None:
        """Register this rank's control endpoint with sglang's bootstrap server (``PUT /route``)
        at the host and port sglang's own managers register to."""
        host, port = self.node.endpoint.rsplit(":", 1)
        payload = {
            "attn_tp_size": self.attn_tp_size, "attn_tp_rank": self.attn_tp_rank,
            "attn_cp_size": self.attn_cp_size, "attn_cp_rank": self.attn_cp_rank,
            "attn_dp_size": self.attn_dp_size, "attn_dp_rank": self.attn_dp_rank,
            "pp_size": self.pp_size, "pp_rank": self.pp_rank,
            "system_dp_size": self.system_dp_size, "system_dp_rank": self.system_dp_rank,
            "rank_ip": host, "rank_port": int(port), "page_size": self.kv_args.page_size,
            "kv_cache_dtype": self.kv_args.kv_cache_dtype_str, "kv_layout": KV_LAYOUT_MARK,
            "load_balance_method": get_parallel().load_balance_method,
            "prefill_http_port": get_serving().port,
            "decode_allocation_policy": policy_mark(self.allocation_policy),  # (mixed.py)
            "enable_dsa_cache_layer_split": bool(get_parallel().enable_dsa_cache_layer_split),
            "enable_kv_cache_sharding": bool(get_parallel().enable_kv_cache_sharding),
        }
        dist_init_addr = get_parallel().dist_init_addr
        bootstrap_port = get_disagg().disaggregation_bootstrap_port
        if dist_init_addr and get_parallel().nnodes > 1:  # each host may have reserved its own port
            bootstrap_port = get_parallel().world_group.broadcast_object(bootstrap_port, src=0)
        url = NetworkAddress(bootstrap_host(get_serving().host, dist_init_addr), bootstrap_port).to_url()
        url += "/route"
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
        log.info("dsa-bridge: prefill rank %s registered at %s%s", self.node.endpoint, url,
                 f" as attention CP rank {self.attn_cp_rank} of {self.attn_cp_size}, writing nothing "
                 "(CP rank 0 writes every request)" if self.is_dummy_cp_rank else "")

    # ---- prefill: the pipeline stages' consensus ---------------------------------------------
    def _start_stage_consensus(self, pp_group) -> None:
        """sglang's ``PPConsensusStore`` over the pipeline group, as sglang's managers keep their
        request statuses with stages: stage 0 collects every stage's status of a room
        (``poll_pp_consensus``); a later stage's reporter thread sends its senders' statuses as
        they change (nothing else polls them there: sglang's later stages take stage 0's verdict)."""
        self.stage_status = PPConsensusStore(self.pp_size, self.pp_rank, pp_group)
        if self.pp_rank > 0:
            self._stage_reporter = threading.Thread(target=self._report_stage_statuses, daemon=True,
                                                    name=f"dsa-bridge-pp{self.pp_rank}-status")
            self._stage_reporter.start()

    def track_stage_status(self, sender: BaseKVSender) -> None:
        if self.stage_status is not None and self.pp_rank > 0:
            with self._lock:
                self._stage_senders[sender.bootstrap_room] = sender

    def forget_stage_status(self, room: int) -> None:
        if self.stage_status is not None:
            with self._lock:
                self._stage_senders.pop(room, None)
            self.stage_status.pop(room)

    def _report_stage_statuses(self) -> None:
        reported: dict[int, int] = {}
        while not self._stop.wait(STAGE_REPORT_S):
            with self._lock:
                senders = list(self._stage_senders.items())
            for room, sender in senders:
                status = int(sender.poll())
                if reported.get(room) != status:
                    self.stage_status[room] = status
                    reported[room] = status
                if status in TERMINAL:
                    with self._lock:
                        self._stage_senders.pop(room, None)
                    reported.pop(room, None)

    def stage_consensus(self, room: int, own: int) -> int:
        """Stage 0's view of ``room`` over every stage (sglang's ``check_status_pp_consensus``),
        ``own`` being stage 0's status: Failed once any stage failed, Bootstrapping while a stage
        has not reported, else the least advanced status."""
        self.stage_status[room] = int(own)
        statuses = self.stage_status.collect(room)
        if KVPoll.Failed in statuses:
            return KVPoll.Failed
        if None in statuses:
            return KVPoll.Bootstrapping
        return min(statuses)

    # ---- decode: parallel info and one node per prefill ------------------------------------
    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Fetch (once) the prefill's parallel info: True once known and pairable. False while it
        is not fully registered, and for a prefill dsa-bridge cannot pair with (never raised:
        sglang's decode queue does not catch it); the reason is logged once per prefill and
        fails that prefill's receivers (``refusal``). Asked again (sglang retries each second
        while requests wait), a refused prefill is fetched again: it may have been restarted."""
        if bootstrap_addr in self.prefill_info_table:
            return True
        url = (f"http://{bootstrap_addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
               "&target_tp_rank=-1&target_pp_rank=-1" + marked_route_query())
        try:
            response = requests.get(url, timeout=HTTP_TIMEOUT_S)
        except requests.RequestException as exc:
            log.warning("dsa-bridge: bootstrap server %s: %s", bootstrap_addr, exc)
            return False
        if response.status_code != 200:
            log.info("dsa-bridge: bootstrap server %s: %d %s", bootstrap_addr, response.status_code,
                     response.text)
            return False
        try:
            info = PrefillServerInfo(**response.json())
        except (TypeError, ValueError) as exc:
            problems = [f"its parallel info does not parse ({exc})"]
        else:
            problems = pairing_problems(
                info, page_size=self.kv_args.page_size,
                kv_cache_dtype=getattr(self.kv_args, "kv_cache_dtype_str", None),
                attn_tp_size=self.attn_tp_size, pp_size=self.pp_size, policy=self.allocation_policy)
        if problems:
            reason = f"dsa-bridge cannot pair with the prefill at {bootstrap_addr}: " + "; ".join(problems)
            if self.refused_prefills.get(bootstrap_addr) != reason:
                log.warning("%s; its requests fail", reason)
            self.refused_prefills[bootstrap_addr] = reason
            return False
        if self.refused_prefills.pop(bootstrap_addr, None) is not None:
            log.info("dsa-bridge: the prefill at %s can be paired with now", bootstrap_addr)
        self.prefill_info_table[bootstrap_addr] = info
        return True

    def log_transport(self, backend) -> None:
        """Say once per rank what moves its cache: the engine and the transport it installed
        (Mooncake: RDMA, or TCP where asked or where this machine has no RDMA device)."""
        if not self._transport_logged:
            self._transport_logged = True
            log.info("dsa-bridge: rank dp%d-tp%d-pp%d moves its cache with %s over %s (options %s)",
                     self.attn_dp_rank, self.attn_tp_rank, self.pp_rank, self.backend,
                     backend.transport(), self.engine_options or "the engine's own")

    def register_dp_rank(self, bootstrap_addr: str, room: int) -> None:
        """Tell the bootstrap server this rank's DP rank serves ``room`` (``POST
        /register_dp_rank``), which sglang's decode queries when it cannot compute it, as
        sglang's own senders do; a failure is logged (decode's query then waits for the room
        until its own timeout, as with sglang's)."""
        url = f"http://{bootstrap_addr}/register_dp_rank"
        try:
            response = requests.post(url, json={"bootstrap_room": room, "dp_rank": self.attn_dp_rank},
                                     timeout=HTTP_TIMEOUT_S)
        except requests.RequestException as exc:
            log.error("dsa-bridge: room %s: registering its prefill DP rank failed: %s", room, exc)
            return
        if response.status_code != 200:
            log.error("dsa-bridge: room %s: registering its prefill DP rank failed: %d %s", room,
                      response.status_code, response.text)

    def _ensure_prefill_recompute_executor(self) -> ThreadPoolExecutor:
        """The threads sglang's decode queue runs its HTTP calls on, made on first use, as
        sglang's own managers make them (the name is sglang's): its prefill DP-rank queries
        (``prefetch_prefill_dp_rank_queries``, every step of its event loop while a request
        waits for its DP rank) and the rebootstrap ``/generate`` (``submit_prefill_recompute``)."""
        with self._lock:
            if self._http_calls is None:
                self._http_calls = ThreadPoolExecutor(
                    HTTP_WORKERS, thread_name_prefix=f"dsa-bridge-dp{self.attn_dp_rank}-tp"
                    f"{self.attn_tp_rank}-http")
            return self._http_calls

    def submit_prefill_recompute(self, receiver: BaseKVReceiver, payload: dict) -> None:
        """sglang's rebootstrap of a retracted request (``pause_generation(mode="retract")``,
        then its decode queue's ``add(req, is_rebootstrap=True)``): ask the request's prefill to
        compute it again (``POST /generate`` with sglang's ``payload``, at the HTTP port the
        prefill registered), which then writes it to the request's new receiver. Asked once per
        request, by attention-TP rank 0 of the first stage, as sglang's managers do; a prefill
        that cannot be asked, or refuses, fails the request with the reason."""
        if self.attn_tp_rank != 0 or self.pp_rank != 0:
            return
        info = self.prefill_info_table.get(receiver.bootstrap_addr)
        port = getattr(info, "prefill_http_port", None)
        if port is None:
            receiver.fail_recompute(f"rebootstrap: the prefill at {receiver.bootstrap_addr} "
                                    "registered no HTTP port to ask for the request again")
            return
        host = NetworkAddress.parse(receiver.bootstrap_addr).host
        url = NetworkAddress(host, int(port)).to_url() + "/generate"
        self._ensure_prefill_recompute_executor().submit(self._recompute, receiver, url, payload)

    def _recompute(self, receiver: BaseKVReceiver, url: str, payload: dict) -> None:
        """One rebootstrap ``POST`` (an HTTP thread), bounded by sglang's waiting timeout."""
        try:
            response = requests.post(url, json=payload, timeout=self.phase_limits.waiting_s)
        except requests.RequestException as exc:
            receiver.fail_recompute(f"rebootstrap: POST {url} failed: {exc}")
            return
        if response.status_code >= 400:
            receiver.fail_recompute(f"rebootstrap: POST {url} answered {response.status_code} "
                                    f"{response.text[:200]}")

    def tell_sglang_prefill(self, bootstrap_addr: str, room: int, reason: str) -> None:
        """This rank refused ``room`` of the prefill at ``bootstrap_addr`` for ``reason``: if that
        prefill runs sglang's own connector, its ranks are told in sglang's protocol, off the
        scheduler thread (``mixed.PrefillAborts``, made on first use)."""
        with self._lock:
            if self.prefill_aborts is None:
                self.prefill_aborts = PrefillAborts(KV_LAYOUT_MARK)
        self.prefill_aborts.notify(bootstrap_addr, room, reason)

    def refusal(self, bootstrap_addr: str) -> str | None:
        """Why the prefill at ``bootstrap_addr`` was refused; None when it was not."""
        return self.refused_prefills.get(bootstrap_addr)

    def _rank_endpoint(self, bootstrap_addr: str, dp_rank: int, cp_rank: int, tp_rank: int,
                       pp_rank: int) -> str:
        url = (f"http://{bootstrap_addr}/route?prefill_dp_rank={dp_rank}&prefill_cp_rank={cp_rank}"
               f"&target_tp_rank={tp_rank}&target_pp_rank={pp_rank}")
        response = requests.get(url, timeout=HTTP_TIMEOUT_S)
        if response.status_code != 200:
            raise HandshakeError(f"bootstrap server {bootstrap_addr} has no prefill rank dp {dp_rank} "
                                 f"cp {cp_rank} tp {tp_rank} pp {pp_rank}: {response.status_code} "
                                 f"{response.text}")
        rank = response.json()
        return NetworkAddress(rank["rank_ip"], int(rank["rank_port"])).to_host_port_str()

    def _start_decode_engine(self) -> None:
        """The rank's one engine, with the pool and the aux buffers registered once, at start-up
        (as sglang's managers do); every ``DecodeNode`` of the rank shares it
        (``SharedEngine``), and connections are made off sglang's scheduler thread."""
        self.engine = SharedEngine(create_backend(self.backend, host=self.local_ip,
                                                  **self.engine_options))
        self.log_transport(self.engine.engine)
        self._registration = self.engine.user()
        self._registration.register(self._cache_regions())
        self._connector = ThreadPoolExecutor(
            1, thread_name_prefix=f"dsa-bridge-dp{self.attn_dp_rank}-tp{self.attn_tp_rank}-connect")

    def decode_node(self, bootstrap_addr: str,
                    dp_rank: int) -> tuple[DecodeNode, PrefillGroup] | None:
        """The node connected to the ranks of prefill DP group ``dp_rank`` at ``bootstrap_addr``
        this rank talks to (``PrefillGroup``: every pipeline stage of each), and that group;
        None while the connection (handshakes included) is being made on the manager's
        connector thread, started by the first call. A failed attempt raises its reason, and is
        not repeated before its backoff ends: until then this raises the last reason at once."""
        key = (bootstrap_addr, dp_rank)
        with self._lock:
            node = self.decode_nodes.get(key)
            if node is not None and not self._restarted(key, node):
                return node, self.groups[key]
            pending = self._connecting.get(key)
            if pending is not None:
                if not pending.done():
                    return None
                del self._connecting[key]
                return self._connected(key, pending)
            if self.memory_released:
                raise HandshakeError("this rank's cache memory is released (sglang's "
                                     "release_memory_occupation, not resumed yet)")
            if not self.try_ensure_parallel_info(bootstrap_addr):
                raise HandshakeError(self.refusal(bootstrap_addr)
                                     or f"the prefill at {bootstrap_addr} is not registered yet")
            failure, now = self.node_failures.get(key), self.clock()
            if failure is not None and now < failure.retry_at:
                raise HandshakeError(f"{failure.reason} (failed {failure.failures} time(s); next "
                                     f"attempt in {failure.retry_at - now:.1f}s)")
            self._connecting[key] = self._connector.submit(self._connect, bootstrap_addr, dp_rank)
            return None

    def _connected(self, key: tuple[str, int],
                   attempt: Future) -> tuple[DecodeNode, PrefillGroup]:
        """The outcome of a connection attempt: the node kept, or the failure given a backoff
        (logged once per attempt) and raised as a ``HandshakeError`` (whatever failed: an engine
        refusing the registration, a lookup, the handshake; never out of sglang's queue)."""
        try:
            node, group = attempt.result()
        except Exception as exc:  # any failed attempt fails only its requests
            failure = self.node_failures.get(key)
            self.node_failures[key] = PeerBackoff.after(failure, str(exc), self.clock())
            log.warning("dsa-bridge: connecting to prefill %s (dp %d) failed (%d time(s), next "
                        "attempt in %.0fs): %s", key[0], key[1], self.node_failures[key].failures,
                        self.node_failures[key].retry_at - self.clock(), exc)
            raise HandshakeError(str(exc)) from exc
        self.node_failures.pop(key, None)
        self.decode_nodes[key] = node
        self.groups[key] = group
        return node, group

    def _restarted(self, key: tuple[str, int], node: DecodeNode) -> bool:
        """Whether the prefill behind ``node``, which it cannot reach, registered new endpoints
        (a restarted prefill listens on a new port): then ``node`` is retired, closed once its
        requests are forgotten, and a new one is made. Looked up at most once per
        ``ROUTE_RECHECK_S``; a prefill back on the same port is the node's own re-handshake."""
        now = self.clock()
        if not node.unreachable() or now < self.route_checked.get(key, -ROUTE_RECHECK_S) + ROUTE_RECHECK_S:
            return False
        self.route_checked[key] = now
        bootstrap_addr, dp_rank = key
        known = self.prefill_info_table.pop(bootstrap_addr, None)  # it may have changed too
        if not self.try_ensure_parallel_info(bootstrap_addr):
            if known is not None and bootstrap_addr not in self.refused_prefills:
                self.prefill_info_table[bootstrap_addr] = known  # not registered again yet
            return False  # (refused now: its requests fail with the reason)
        try:
            endpoints = self._group(bootstrap_addr, dp_rank).endpoints
        except (HandshakeError, requests.RequestException, KeyError, ValueError) as exc:
            log.info("dsa-bridge: prefill %s (dp %d) unreachable, its new endpoints not known: %s",
                     bootstrap_addr, dp_rank, exc)
            return False
        old = [peer.endpoint for peer in node.peers]
        if endpoints == old:
            return False
        log.warning("dsa-bridge: prefill %s (dp %d) moved from %s to %s (restarted): connecting "
                    "anew", bootstrap_addr, dp_rank, ", ".join(old), ", ".join(endpoints))
        del self.decode_nodes[key], self.groups[key]
        self.retired_nodes.append(node)
        self._close_idle_retired()
        return True

    def _close_idle_retired(self) -> None:
        """Close the retired nodes no request is left on (every one forgotten)."""
        for node in [n for n in self.retired_nodes if n.requests == 0]:
            node.close()
            self.retired_nodes.remove(node)

    def _group(self, bootstrap_addr: str, dp_rank: int) -> PrefillGroup:
        """The ranks of DP group ``dp_rank`` this rank talks to, as sglang maps attention-TP
        ranks between two widths (``tp_targets``), attention-CP ranks (``target_cp_ranks``: CP
        rank 0, or with layer split each CP rank, its layers written as a pipeline stage's) and
        pipeline stages (``target_stages``)."""
        info = self.prefill_info_table[bootstrap_addr]
        targets = tp_targets(self.attn_tp_rank, self.attn_tp_size, info.attn_tp_size)
        cp_ranks = target_cp_ranks(info.attn_cp_size, bool(info.enable_dsa_cache_layer_split))
        pp_ranks = target_stages(self.pp_rank, self.pp_size, info.pp_size)

        def stages(tp_rank: int) -> list[str]:
            return [self._rank_endpoint(bootstrap_addr, dp_rank, cp, tp_rank, pp)
                    for cp in cp_ranks for pp in pp_ranks]

        return PrefillGroup(tuple(stages(targets.source)),
                            tuple(e for tp in targets.idle for e in stages(tp)), targets.copies)

    def _connect(self, bootstrap_addr: str, dp_rank: int) -> tuple[DecodeNode, PrefillGroup]:
        """Connect a node to the ranks of DP group ``dp_rank`` this rank talks to, over the
        rank's shared engine (the connector thread)."""
        group = self._group(bootstrap_addr, dp_rank)
        backend = self.engine.user()
        try:
            node = DecodeNode(self.pool, backend, group.endpoints,
                              name=f"decode-dp{self.attn_dp_rank}-tp{self.attn_tp_rank}",
                              request_timeout_s=self.phase_limits.node_timeout_s,
                              in_flight_grace_s=IN_FLIGHT_GRACE_S,
                              quarantine_timeout_s=QUARANTINE_TIMEOUT_S,
                              aux_buffers=self.bridge.aux_buffers, secret=self.secret,
                              checksums=self.checksums, staging_bytes=STAGING_BYTES)
        except BaseException:
            backend.close()  # (a node that failed closes it too: idempotent)
            raise
        return node, group

    # ---- decode: sglang's deferred release, answered by the fence ----------------------------
    def _log_release_bounds(self) -> None:
        """Say once, at start-up, how sglang's release of a failed request's pages meets the fence."""
        if not self.enable_deferred_decode_kv_release:
            log.warning("dsa-bridge: %s is off: sglang frees a failed request's decode pages at once, "
                        "while a prefill write into them may still land (into the next request's "
                        "KV); dsa-bridge can only count and log each such release (forced_releases). "
                        "Unset it to keep the pages until dsa-bridge's fence lets them go",
                        DEFERRED_RELEASE_ENV)
            return
        timeout = float(envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT.get())
        if timeout < QUARANTINE_TIMEOUT_S:
            log.info("dsa-bridge: sglang releases a held decode destination after %s_TIMEOUT=%.0fs "
                     "even unproven; dsa-bridge's fence may hold one up to %.0fs (a failed write: %.0fs "
                     "after prefill's report; a silent prefill: until it is proven gone). A release "
                     "before the fence lifts is counted (forced_releases) and logged",
                     DEFERRED_RELEASE_ENV, timeout, QUARANTINE_TIMEOUT_S, IN_FLIGHT_GRACE_S)

    def register_deferred_abort_room(self, bootstrap_room: int) -> int:
        """sglang holds ``bootstrap_room``'s pages from now on (its receiver's abort notification,
        which dsa-bridge's receiver sends as its own ``Abort``); returns the generation, as
        sglang's managers do."""
        self._abort_generation += 1
        self._armed[bootstrap_room] = self._abort_generation
        return self._abort_generation

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        """True exactly when dsa-bridge's fence lets the room's pages go (``can_release``): no
        prefill write into them can still land. A room without a dsa-bridge request (never asked
        of a prefill, or already released) is safe. ``required_acks`` (sglang's count of prefill
        ranks to ack) is not needed: the fence covers every prefill rank of the request."""
        self.forget_released()
        receiver = self._live.get(bootstrap_room)
        return receiver is None or receiver.can_release()

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        """sglang's ``_do_release`` is releasing the room's pages (drained, or at its deadline):
        a release while the fence still holds them is forced, counted and logged."""
        self._armed.pop(bootstrap_room, None)
        receiver = self._live.get(bootstrap_room)
        if receiver is not None and not receiver.can_release():
            receiver.release_forced(
                f"at sglang's deferred-release deadline ({DEFERRED_RELEASE_ENV}_TIMEOUT="
                f"{float(envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT.get()):g}s)")

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        """Whether sglang's own digest from the prefill at ``bootstrap_addr`` covers the bytes this
        rank holds: True for a prefill dsa-bridge paired with (an MLA pool is whole on every
        attention-TP rank, so the rank that writes holds the same pages; another layout is told
        apart by sglang's own layout signature). Not for a prefill with attention-CP layer split:
        the digest in the aux slot covers only the layers of the CP rank that wrote it."""
        info = self.prefill_info_table.get(bootstrap_addr)
        return info is not None and not (info.attn_cp_size > 1 and info.enable_dsa_cache_layer_split)

    def count_forced_release(self, room: int, how: str) -> None:
        self.forced_releases += 1
        log.warning("dsa-bridge: room %s: sglang released its decode pages %s while dsa-bridge's "
                    "fence still held them: a prefill write may land in them (%d such release(s))",
                    room, how, self.forced_releases)

    def track(self, receiver: BaseKVReceiver) -> None:
        """``receiver`` has a dsa-bridge request: its fence answers for its room."""
        self._live[receiver.bootstrap_room] = receiver

    def untrack(self, receiver: BaseKVReceiver, node: DecodeNode, request: KVReceiver) -> None:
        """sglang is done with ``receiver``: its request leaves the node now if the fence lets it,
        else once it does (``forget_released``)."""
        if self._live.get(receiver.bootstrap_room) is receiver:
            del self._live[receiver.bootstrap_room]
        self._unreleased.append((node, request))
        self.forget_released()

    def forget_released(self) -> None:
        """Remove from their nodes the cleared requests whose fence has lifted. Called from
        sglang's own calls on the scheduler thread (polls, clears, release checks), so no thread
        of its own; the list is bounded by the fence's own bound (``QUARANTINE_TIMEOUT_S``)."""
        held = []
        for node, request in self._unreleased:
            if request.can_release():
                node.forget(request)
            else:
                held.append((node, request))
        self._unreleased = held
        if self.retired_nodes:
            self._close_idle_retired()

    @property
    def unreleased_receivers(self) -> int:
        """Requests sglang cleared whose fence still holds their pages (not yet forgotten)."""
        return len(self._unreleased)

    def shutdown(self) -> None:
        """Close the nodes (and their engines) and the stages' consensus."""
        self._stop.set()
        if self._stage_reporter is not None:
            self._stage_reporter.join()
        if self.stage_status is not None:
            self.stage_status.close()
        self.early_sends.close()
        if self.prefill_aborts is not None:
            self.prefill_aborts.close()
        if self.node is not None:
            self.node.close()
        if self._connector is not None:
            self._connector.shutdown(wait=True)
        if self._http_calls is not None:  # a rebootstrap POST may wait for its prefill: not joined
            self._http_calls.shutdown(wait=False, cancel_futures=True)
        self._close_decode_nodes()
        if self.engine is not None:
            self._registration.close()
            self.engine.close()


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
