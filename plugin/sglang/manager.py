"""The sglang KVManager of dsa-bridge: one per scheduler rank (``conn.py`` is the overview).

``DSABridgeKVManager(args, mode, server_args, is_mla_backend)``: one per scheduler rank. From
the rank's ``KVArgs`` (``kvargs.bridge_buffers``: KV, DSA state and aux buffers with
derived layer ids) it starts a ``PrefillNode`` on the rank's IP (sglang's
``get_local_ip_auto``: ``SGLANG_HOST_IP`` or detected) and registers that node's control
endpoint in sglang's bootstrap server (``bootstrap_route``); with pipeline stages it
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
reads every CP rank as it reads stages (``target_cp_ranks``). Where each request's pages are split
among prefill ranks (sglang's KV sharding over its shard group, ``kv_shard``; the CP page split of
``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER``) each rank writes its share (``page_share``) and
decode reads those ranks as share writers (``page_split``). The other CP modes are refused at
start-up (``cp_problems``) and, from the prefill's parallel info, by decode (``pairing_problems``).
KVArgs that are not a DSA pool (``kvargs.dsa_problem``) get sglang's own manager of the
configured backend instead (logged): sglang's ``get_kv_class`` does not know the model, its
KVArgs do.

The manager keeps the rank's bring-up and the memory saver; its parts own the rest, each its
own state: ``StageConsensus`` (``stage_consensus.py``: the prefill pipeline stages' consensus),
``BootstrapRoute`` (``bootstrap_route.py``: the prefill rank's row in sglang's bootstrap server),
``DecodeNodes`` (``decode_nodes.py``: decode's parallel info of each prefill, the rank's engine
and one node per prefill DP group), ``DeferredRelease`` (``deferred_release.py``: sglang's
deferred release answered by the fence) and ``DecodeHttp`` (``decode_http.py``: sglang's HTTP
calls off its thread, the rebootstrap of a retracted request); ``rank_engine.py`` reads what the
rank's engine is made with. sglang's names for what a part answers (``try_ensure_parallel_info``,
``prefill_info_table``, ``register_deferred_abort_room``, ``is_abort_release_safe``,
``clear_deferred_abort_state``, ``_ensure_prefill_recompute_executor``,
``submit_prefill_recompute``, ``register_dp_rank``) stay on the manager and hand over to the part.

With sglang's ``prefill_complete`` allocation policy (``defer_allocation``) prefill senders are
deferred (no deadline until ``mark_prefill_complete``) and decode receivers reserve their request
first, allocating once the prefill is ready; each prefill registers its policy (``policy_mark``)
and decode refuses a prefill of the other one.

Each buffer is registered as the memory its pointer is (``memory_kinds``). sglang's HiSparse decode
(``hisparse``) holds the KV in a host pool without a padding page and the indexer in its device
pool: the nodes take both, and each request names both page lists (``receiver.py``); a draft
model's KV stays on the device, in the indexer's pages (``kv_on_index_pages``), on Mooncake (over
NIXL it is refused at start-up, as sglang's decode refuses it). sglang's memory saver releases
the cache through ``deregister_buffer_to_engine`` (running requests fail, the cache leaves the
engines first) and resumes it through ``register_buffer_to_engine``. sglang's runtime role
switch tears the manager down (``teardown``: as ``shutdown``) and makes the other role's over the
same pool.

sglang's deferred decode release (``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE``, on by
default) is answered by dsa-bridge's fence: the manager supports it, ``register_deferred_abort_room``
arms a room, ``is_abort_release_safe(room, required_acks)`` is the fence's ``can_release`` for that
room's request, so sglang holds a failed request's pages exactly as long as the fence does, up to
one bound for both (``release_bound``: sglang's ``..._TIMEOUT`` raised to the fence's bound, set
on sglang's transfer queue by ``hooks.one_release_bound``). With deferral off sglang releases at
once: a release the fence had not allowed (``clear_deferred_abort_state`` or ``clear`` while
``can_release`` is False) is counted (``forced_releases``) and logged. A cleared request
leaves its ``DecodeNode`` once its fence lifts (``forget_released``, run from sglang's next call
into the manager). ``--disaggregation-enable-kv-checksum`` turns dsa-bridge's checksums on in both
nodes.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from sglang.srt.disaggregation.base.conn import BaseKVManager, BaseKVReceiver
from sglang.srt.disaggregation.common.conn import PrefillServerInfo
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.environ import envs
from sglang.srt.runtime_context import get_disagg, get_memory, get_parallel
from sglang.srt.utils.network import get_local_ip_auto

from ...transfer import auth
from ...transfer.backends import create_backend
from ...transfer.backends.environment import mooncake_port_warning
from ...transfer.counters import merge
from ...transfer.memory_kinds import kind_of, pointer_info
from ...transfer.plan import as_aux_buffers
from ...transfer.prefill import PrefillNode
from .bootstrap_route import BootstrapRoute, post_dp_rank, route_row
from .bringup import (
    backend_of,
    cp_problems,
    dummy_cp_rank,
    page_share,
    sglang_class,
)
from .decode_http import DecodeHttp
from .decode_nodes import STAGING_BYTES, DecodeNodes
from .deferred_release import DeferredRelease, log_release_bounds
from .early_send import EarlySendDispatcher
from .kvargs import bridge_buffers, draft_entries, dsa_problem
from .memory_kinds import hisparse_problem
from .mixed import PrefillAborts
from .paged_buffers import PagedBuffers
from .phases import PhaseLimits
from .pool import stage_start_layer
from .rank_config import read_rank_config
from .rank_engine import cuda_available, rank_engine_options, sglang_mooncake_engine
from .rank_metrics import RankMetrics, RankReading, exported
from .release_bound import release_bound
from .stage_consensus import StageConsensus
from .tuning import TUNING_ENVS, heartbeat_line, ignored_lines, read_tuning

log = logging.getLogger(__name__)


class DSABridgeKVManager(BaseKVManager):
    """One scheduler rank's transfer: a dsa-bridge node over the rank's KVArgs (module docstring)."""

    # sglang holds a failed request's decode pages until ``is_abort_release_safe``: answered by
    # dsa-bridge's fence (``KVReceiver.can_release``), not by an ack count
    supports_deferred_decode_kv_release = True
    # sglang's P<->D role switch (``--enable-pd-role-switch``) tears this manager down
    # (``teardown``) and makes the other role's over the same pool
    supports_role_switch = True

    def __new__(cls, args, disaggregation_mode, server_args, is_mla_backend=False, **kwargs):
        problem = dsa_problem(args)
        if problem is None:
            return super().__new__(cls)
        fallback = sglang_class(backend_of(server_args), "KVManager")
        log.info("dsa-bridge: %s; sglang's %s moves this pool", problem, fallback.__name__)
        if backend_of(server_args) == "mooncake":  # its engine was not started for dsa-bridge
            sglang_mooncake_engine(getattr(args, "gpu_id", 0) or 0)
        return fallback(args, disaggregation_mode, server_args, is_mla_backend, **kwargs)

    def __init__(self, args, disaggregation_mode, server_args, is_mla_backend=False):
        self.kv_args = args
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.is_mla_backend = is_mla_backend
        self.backend = backend_of(server_args)
        parallel = get_parallel()
        rank = self.rank = read_rank_config(parallel, args)  # (rank_config.py; sglang's names below)
        self.attn_tp_size, self.attn_tp_rank = rank.attn_tp_size, rank.attn_tp_rank
        self.attn_dp_size, self.attn_dp_rank = rank.attn_dp_size, rank.attn_dp_rank
        self.pp_size, self.pp_rank = rank.pp_size, rank.pp_rank
        self.system_dp_size, self.system_dp_rank = rank.system_dp_size, rank.system_dp_rank
        self.local_ip = get_local_ip_auto()
        # the GPU's devices and sglang's engine variables, as sglang's connectors (rank_engine.py)
        self.engine_options = rank_engine_options(self.backend, args)
        self._transport_logged = False
        prefill = disaggregation_mode == DisaggregationMode.PREFILL
        self.attn_cp_size, self.attn_cp_rank = rank.attn_cp_size, rank.attn_cp_rank
        problems = cp_problems(prefill=prefill, attn_cp_size=self.attn_cp_size,
                               kv_sharding=rank.kv_sharding,
                               cp_tp_group_sharing=rank.cp_tp_group_sharing)
        if problems:
            raise ValueError("dsa-bridge's transfer does not serve " + "; ".join(problems)
                             + " (docs/sglang.md)")
        layer_split = rank.layer_split
        # the share of each request's pages this prefill rank writes, when they are split
        self.page_share = page_share(
            attn_cp_size=self.attn_cp_size, attn_cp_rank=self.attn_cp_rank,
            layer_split=layer_split,
            all_cp_ranks=bool(envs.SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER.get()),
            shard=kv_shard(is_mla_backend)) if prefill else None
        # sglang's default CP mode: a prefill CP rank other than 0 writes nothing, its senders end
        # without decode (with layer split every CP rank writes its layers, with a page split
        # its share)
        # sglang's name: each CP rank sends (its share); sglang then copies page indices itself
        self.enable_all_cp_ranks_for_transfer = self.page_share is not None
        self.is_dummy_cp_rank = prefill and dummy_cp_rank(
            self.attn_cp_size, self.attn_cp_rank, layer_split, self.page_share is not None)
        start = (getattr(args, "prefill_start_layer", 0) or 0) if prefill else self._stage_start(args)
        # sglang's HiSparse decode: the KV into its host pool (no padding page), the indexer into
        # its device pool, each at its own pages
        self.hisparse = not prefill and bool(get_memory().enable_hisparse)
        problem = hisparse_problem(not prefill, self.hisparse,
                                   draft_entries(args), self.backend)
        if problem:
            raise ValueError(problem)
        cuda = cuda_available()
        info = pointer_info(cuda)  # each buffer registered as the memory its pointer is
        # senders take page indices still being copied to the host (sender.py)
        self.host_tensor_indices = prefill and cuda
        self.bridge = bridge_buffers(args, start_layer=start,
                                     device_of=lambda ptr: kind_of(ptr, info(ptr)).device,
                                     split_devices=self.hisparse)
        # HiSparse keeps a draft model's KV on the device, at the indexer's pages
        self.kv_on_index_pages = tuple(self.bridge.draft_layer_ids) if self.hisparse else ()
        device = self.bridge.buffers.buffer_descriptors()[0].device
        self.pool = PagedBuffers(self.bridge.buffers, device)  # what the nodes take as their pool
        self.secret = auth.load_secret()  # DSA_BRIDGE_SECRET, the same on prefill and decode
        self.checksums = bool(get_disagg().disaggregation_enable_kv_checksum)  # both sides' flag
        self.allocation_policy = get_disagg().disaggregation_decode_allocation_policy
        self.defer_allocation = self.allocation_policy == "prefill_complete"  # (phases.py)
        self.phase_limits = PhaseLimits(  # sglang's per-phase bounds (phases.py)
            float(envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get()),
            float(envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get()))
        # one bound for sglang's deferred release and the fence (release_bound.py; hooks.py)
        self.release_bound = release_bound(
            envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT.get())
        self.enable_deferred_decode_kv_release = bool(
            envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.get()
            and self.supports_deferred_decode_kv_release)
        # sglang's tuning variables: its heartbeat honoured, the others named as ignored (tuning.py)
        self.tuning = read_tuning({name: getattr(envs, name).get() for name in TUNING_ENVS
                                   if getattr(envs, name).is_set()})
        log.info("dsa-bridge: %s", heartbeat_line(self.tuning))
        for line in ignored_lines(self.tuning):
            log.warning("dsa-bridge: %s", line)
        self._lock = threading.Lock()
        self.node: PrefillNode | None = None
        self.http = DecodeHttp(  # decode: sglang's HTTP calls, off its thread (decode_http.py)
            f"dsa-bridge-dp{self.attn_dp_rank}-tp{self.attn_tp_rank}",
            waiting_s=self.phase_limits.waiting_s,
            prefill_info=lambda addr: self.prefill_info_table.get(addr))
        self.stages = StageConsensus(self.pp_size, self.pp_rank)  # prefill: its pipeline stages
        self.decode_nodes = DecodeNodes(  # decode: the prefills' parallel info, one node per DP group
            kv_args=args, pool=self.pool, aux_buffers=self.bridge.aux_buffers, backend=self.backend,
            local_ip=self.local_ip, engine_options=self.engine_options, secret=self.secret,
            checksums=self.checksums, phase_limits=self.phase_limits,
            allocation_policy=self.allocation_policy, attn_tp_size=self.attn_tp_size,
            attn_tp_rank=self.attn_tp_rank, attn_dp_rank=self.attn_dp_rank, pp_size=self.pp_size,
            kv_page_zero=self.hisparse,
            kv_on_index_pages=self.kv_on_index_pages,
            pp_rank=self.pp_rank, memory_released=lambda: self.memory_released,
            peer_timeout_s=self.tuning.peer_timeout_s, heartbeat_s=self.tuning.heartbeat_s,
            quarantine_timeout_s=self.release_bound.bound_s)
        self.deferred_release = DeferredRelease(self.decode_nodes, self.release_bound)  # decode
        self.early_sends = EarlySendDispatcher(  # chunks held until sglang's forward wrote them
            f"dp{self.attn_dp_rank}-tp{self.attn_tp_rank}-pp{self.pp_rank}")
        self.memory_released = False  # sglang's memory saver released the cache (not resumed)
        self.route = BootstrapRoute(getattr(args, "rust_http_port", None))  # (bootstrap_route.py)
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
            clash = mooncake_port_warning("sglang's --disaggregation-bootstrap-port",
                                          get_disagg().disaggregation_bootstrap_port)
            if clash:
                log.warning("dsa-bridge: %s", clash)
            self.register_to_bootstrap()
            if self.pp_size > 1:
                self.stages.start(parallel.pp_group)
        else:
            self.decode_nodes.start_engine(self._cache_regions())
            self.log_transport(self.decode_nodes.engine.engine)
            log_release_bounds(self.enable_deferred_decode_kv_release)
        # dsa-bridge's counters on sglang's /metrics, merged over the server's ranks
        self.metrics = RankMetrics(disaggregation_mode.value, self._reading) if exported() else None
        log.info("dsa-bridge: %s", "its counters go to sglang's /metrics (dsa_bridge_*), merged over "
                 "the server's ranks" if self.metrics else "its counters are not exported: sglang's "
                 "metrics are off (--enable-metrics)")
        log.info("dsa-bridge: %s manager over %d layers (%s indexer layout) on %s, aux on %s, backend "
                 "%s, checksums %s", disaggregation_mode.value, self.bridge.layout.num_layers,
                 self.bridge.layout.indexer_layout, device, sorted(set(self.bridge.aux_devices)),
                 self.backend, "on" if self.checksums else "off")

    def _reading(self) -> RankReading:
        """This rank's counts for sglang's metrics (``rank_metrics``; the metrics thread)."""
        if self.node is not None:
            return RankReading(self.node.counters.stats())
        nodes = self.decode_nodes.every_node()
        return RankReading(merge(*(node.counters.stats() for node in nodes)),
                           forced_releases=self.deferred_release.forced_releases,
                           pages_held=sum(node.held_pages() for node in nodes),
                           pages_quarantined=sum(node.quarantined_pages() for node in nodes))

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
            secret=self.secret, checksums=self.checksums, route="direct", staging_bytes=STAGING_BYTES,
            peer_timeout_s=self.tuning.peer_timeout_s, heartbeat_s=self.tuning.heartbeat_s)

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
        failed = self.deferred_release.fail_all(reason)
        self.decode_nodes.close_nodes()
        self.decode_nodes.registration.unregister(self._cache_regions())
        log.info("dsa-bridge: decode rank dp%d-tp%d released its cache (%d request(s) failed)",
                 self.attn_dp_rank, self.attn_tp_rank, failed)

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
            self.decode_nodes.registration.register(self._cache_regions())
            return
        try:
            self.node = self._prefill_node(self.node.endpoint)
        except OSError as exc:  # the port was taken meanwhile
            log.info("dsa-bridge: prefill rank %s: %s; listening on a new port", self.node.endpoint,
                     exc)
            self.node = self._prefill_node(f"{self.local_ip}:0")
            self.register_to_bootstrap()
        log.info("dsa-bridge: prefill rank %s resumed its cache", self.node.endpoint)

    def _cache_regions(self) -> list:
        return [*self.pool.buffer_descriptors(), *as_aux_buffers(self.bridge.aux_buffers)]

    # ---- prefill: the bootstrap registration -------------------------------------------------
    def register_to_bootstrap(self) -> None:
        """Register this rank's control endpoint with sglang's bootstrap server, where sglang's
        own managers register (``bootstrap_route.py``)."""
        row = route_row(self.rank, self.node.endpoint, page_size=self.kv_args.page_size,
                        kv_cache_dtype=self.kv_args.kv_cache_dtype_str,
                        split_pages=self.page_share is not None and not self.page_share.interleaved,
                        allocation_policy=self.allocation_policy)
        self.route.register(row, f" as attention CP rank {self.attn_cp_rank} of {self.attn_cp_size}, "
                            "writing nothing (CP rank 0 writes every request)"
                            if self.is_dummy_cp_rank else "")

    # ---- decode: sglang's names for what the parts answer --------------------------------------
    @property
    def prefill_info_table(self) -> dict[str, PrefillServerInfo]:
        return self.decode_nodes.prefill_info_table

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        return self.decode_nodes.try_ensure_parallel_info(bootstrap_addr)

    def decode_node_for(self, bootstrap_addr: str, dp_rank: int):
        """A receiver's prefill DP group: its ``(DecodeNode, PrefillGroup)`` once connected, None
        while connecting (``DecodeNodes.node_for``)."""
        return self.decode_nodes.node_for(bootstrap_addr, dp_rank)

    def prefill_refusal(self, bootstrap_addr: str) -> str | None:
        """Why this rank refuses the prefill at ``bootstrap_addr``; None when it does not."""
        return self.decode_nodes.refusal(bootstrap_addr)

    def drop_announcements(self) -> None:
        """Empty the prefill node's ``incoming`` (rooms decode announced before their sender was
        made): sglang makes a sender per request itself, so they are informational only."""
        while not self.node.incoming.empty():
            self.node.incoming.get_nowait()

    def register_deferred_abort_room(self, bootstrap_room: int) -> int:
        return self.deferred_release.register_deferred_abort_room(bootstrap_room)

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        return self.deferred_release.is_abort_release_safe(bootstrap_room, required_acks)

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        self.deferred_release.clear_deferred_abort_state(bootstrap_room)

    def should_verify_kv_checksum(self, bootstrap_addr: str) -> bool:
        """Whether sglang's own digest from the prefill at ``bootstrap_addr`` covers the bytes this
        rank holds: True for a prefill dsa-bridge paired with (an MLA pool is whole on every
        attention-TP rank, so the rank that writes holds the same pages; another layout is told
        apart by sglang's own layout signature). Not for a prefill with attention-CP layer split:
        the digest in the aux slot covers only the layers of the CP rank that wrote it."""
        info = self.prefill_info_table.get(bootstrap_addr)
        return info is not None and not (info.attn_cp_size > 1 and info.enable_dsa_cache_layer_split)

    # ---- the rank's transport said once; HTTP to the bootstrap server and the prefill --------
    def log_transport(self, backend) -> None:
        """Say once per rank what moves its cache: the engine and the transport it installed
        (Mooncake: RDMA, or TCP where asked or where this machine has no RDMA device)."""
        if not self._transport_logged:
            self._transport_logged = True
            log.info("dsa-bridge: rank dp%d-tp%d-pp%d moves its cache with %s over %s (options %s)",
                     self.attn_dp_rank, self.attn_tp_rank, self.pp_rank, self.backend,
                     backend.transport(), self.engine_options or "the engine's own")

    def register_dp_rank(self, bootstrap_addr: str, room: int) -> None:
        """Tell the bootstrap server this rank's DP rank serves ``room`` (``post_dp_rank``)."""
        post_dp_rank(bootstrap_addr, room, self.attn_dp_rank)

    def _ensure_prefill_recompute_executor(self) -> ThreadPoolExecutor:
        """The threads sglang's decode queue runs its HTTP calls on (the name is sglang's): its
        prefill DP-rank queries and the rebootstrap (``decode_http.py``)."""
        return self.http.executor()

    def submit_prefill_recompute(self, receiver: BaseKVReceiver, payload: dict) -> None:
        """sglang's rebootstrap of a retracted request: ask its prefill to compute it again
        (``DecodeHttp.submit_prefill_recompute``), once per request, by attention-TP rank 0 of the
        first stage, as sglang's managers do."""
        if self.attn_tp_rank == 0 and self.pp_rank == 0:
            self.http.submit_prefill_recompute(receiver, payload)

    def tell_sglang_prefill(self, bootstrap_addr: str, room: int, reason: str) -> None:
        """This rank refused ``room`` of the prefill at ``bootstrap_addr`` for ``reason``: a prefill
        running sglang's own connector is told in sglang's protocol (``DecodeHttp``)."""
        self.http.tell_sglang_prefill(bootstrap_addr, room, reason)

    @property
    def prefill_aborts(self) -> PrefillAborts | None:
        """What tells sglang's own prefills, once made (``tell_sglang_prefill``)."""
        return self.http.prefill_aborts

    def teardown(self) -> None:
        """sglang's role switch (``role_switch.teardown_disaggregation``, only on an instance
        with no request left): the manager closes as ``shutdown`` does, its engines releasing
        the pool's registration; the pool stays, and sglang makes the other role's manager over
        it."""
        log.info("dsa-bridge: %s rank torn down for sglang's role switch",
                 self.disaggregation_mode.value)
        self.shutdown()

    def shutdown(self) -> None:
        """Publish the last counts, then close the stages' consensus, the nodes and their
        engines."""
        if self.metrics is not None:
            self.metrics.close()
        self.stages.close()
        self.early_sends.close()
        self.http.close()
        if self.node is not None:
            self.node.close()
        self.decode_nodes.close()


def kv_shard(is_mla_backend: bool) -> tuple[int, int] | None:
    """This rank's (rank, size) in sglang's KV shard group (``--enable-kv-cache-sharding``: its
    attention-CP group, else for MLA pools its attention-TP group), as sglang's managers take
    it; None without sharding."""
    if not get_parallel().enable_kv_cache_sharding:
        return None
    from sglang.srt.mem_cache.page_interleave import get_kv_shard_group

    group = get_kv_shard_group(is_mla_backend)
    return group.rank_in_group, group.world_size
