"""A decode rank's nodes, one per prefill DP group, and the prefills' parallel info.

``DecodeNodes``: the prefills' parallel info (``try_ensure_parallel_info``: sglang's ``GET /route``
with -1s, ``prefill_info_table``; a prefill it cannot pair with is refused, ``refusal``), the
rank's one engine (``SharedEngine``, the cache registered once), and one ``DecodeNode`` per
prefill DP group (``node_for``), connected on a connector thread off sglang's scheduler thread,
retried with backoff (``PeerBackoff``) and, for a restarted prefill on new endpoints, retired and
made anew (``retired_nodes``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import requests
from sglang.srt.disaggregation.common.conn import PrefillServerInfo
from sglang.srt.utils.network import NetworkAddress

from ...transfer.backends import create_backend
from ...transfer.backends.shared import SharedEngine
from ...transfer.decode import DecodeNode
from ...transfer.handshake import HandshakeError
from .bringup import (
    PeerBackoff,
    PrefillGroup,
    page_split,
    pairing_problems,
    target_cp_ranks,
    target_stages,
    tp_targets,
)
from .mixed import marked_route_query
from .paged_buffers import PagedBuffers
from .phases import PhaseLimits
from .release_bound import FENCE_BOUND_S
from .tuning import HEARTBEAT_S, PEER_TIMEOUT_S

log = logging.getLogger(__name__)

HTTP_TIMEOUT_S = 5.0
ROUTE_RECHECK_S = 1.0  # how often an unreachable prefill's endpoints are looked up again
# decode's fence (DecodeNode): a failed engine write's bytes may land for IN_FLIGHT_GRACE_S after
# prefill reports it; pages on a silent prefill are held up to the rank's release bound
# (``quarantine_timeout_s``: release_bound.py)
IN_FLIGHT_GRACE_S = 35.0
# the staged route is off inside sglang: it is slower for DSA pages on every engine measured
# (docs/benchmarks.md) and its staging area would be device memory taken from the KV cache
STAGING_BYTES = 0


class DecodeNodes:
    """A decode rank's connections to its prefills (module docstring): their parallel info, the
    rank's engine and one ``DecodeNode`` per prefill DP group. ``memory_released`` says whether
    sglang's memory saver released the cache (no connection is made meanwhile)."""

    def __init__(self, *, kv_args, pool: PagedBuffers, aux_buffers, backend: str, local_ip: str,
                 engine_options: dict, secret, checksums: bool, phase_limits: PhaseLimits,
                 allocation_policy: str, attn_tp_size: int, attn_tp_rank: int, attn_dp_rank: int,
                 pp_size: int, pp_rank: int, memory_released: Callable[[], bool],
                 kv_page_zero: bool = False, kv_on_index_pages: Sequence[int] = (),
                 peer_timeout_s: float = PEER_TIMEOUT_S, heartbeat_s: float = HEARTBEAT_S,
                 quarantine_timeout_s: float = FENCE_BOUND_S):
        self.kv_args, self.pool, self.aux_buffers = kv_args, pool, aux_buffers
        self.backend, self.local_ip, self.engine_options = backend, local_ip, engine_options
        self.secret, self.checksums, self.phase_limits = secret, checksums, phase_limits
        self.allocation_policy = allocation_policy
        self.attn_tp_size, self.attn_tp_rank = attn_tp_size, attn_tp_rank
        self.attn_dp_rank = attn_dp_rank
        self.pp_size, self.pp_rank = pp_size, pp_rank
        self.kv_page_zero = kv_page_zero  # the KV in a pool without a padding page (HiSparse)
        self.kv_on_index_pages = kv_on_index_pages  # KV layers at the indexer's pages (its draft)
        self.memory_released = memory_released
        self.peer_timeout_s, self.heartbeat_s = peer_timeout_s, heartbeat_s  # (tuning.py)
        self.quarantine_timeout_s = quarantine_timeout_s  # the fence's bound (release_bound.py)
        self.clock = time.monotonic  # the backoff's clock
        self._lock = threading.Lock()
        self.nodes: dict[tuple[str, int], DecodeNode] = {}
        self._connecting: dict[tuple[str, int], Future] = {}  # connections being made
        self._connector: ThreadPoolExecutor | None = None  # makes them, off sglang's thread
        self.engine: SharedEngine | None = None  # one engine for every node of the rank
        self.registration = None  # the engine's user that registers the cache
        self.groups: dict[tuple[str, int], PrefillGroup] = {}  # the ranks each node talks to
        self.node_failures: dict[tuple[str, int], PeerBackoff] = {}
        self.route_checked: dict[tuple[str, int], float] = {}  # when a lost prefill was looked up
        self.retired_nodes: list[DecodeNode] = []  # nodes of a restarted prefill, until idle
        self.prefill_info_table: dict[str, PrefillServerInfo] = {}
        self.refused_prefills: dict[str, str] = {}  # bootstrap address -> why it cannot pair

    # ---- the prefills' parallel info -----------------------------------------------------------
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

    def refusal(self, bootstrap_addr: str) -> str | None:
        """Why the prefill at ``bootstrap_addr`` was refused; None when it was not."""
        return self.refused_prefills.get(bootstrap_addr)

    # ---- one node per prefill DP group -------------------------------------------------------
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

    def start_engine(self, cache_regions: list) -> None:
        """The rank's one engine, with the pool and the aux buffers (``cache_regions``) registered
        once, at start-up (as sglang's managers do); every ``DecodeNode`` of the rank shares it
        (``SharedEngine``), and connections are made off sglang's scheduler thread."""
        self.engine = SharedEngine(create_backend(self.backend, host=self.local_ip,
                                                  **self.engine_options))
        self.registration = self.engine.user()
        self.registration.register(cache_regions)
        self._connector = ThreadPoolExecutor(
            1, thread_name_prefix=f"dsa-bridge-dp{self.attn_dp_rank}-tp{self.attn_tp_rank}-connect")

    def node_for(self, bootstrap_addr: str,
                 dp_rank: int) -> tuple[DecodeNode, PrefillGroup] | None:
        """The node connected to the ranks of prefill DP group ``dp_rank`` at ``bootstrap_addr``
        this rank talks to (``PrefillGroup``: every pipeline stage of each), and that group;
        None while the connection (handshakes included) is being made on the connector
        thread, started by the first call. A failed attempt raises its reason, and is not
        repeated before its backoff ends: until then this raises the last reason at once."""
        key = (bootstrap_addr, dp_rank)
        with self._lock:
            node = self.nodes.get(key)
            if node is not None and not self._restarted(key, node):
                return node, self.groups[key]
            pending = self._connecting.get(key)
            if pending is not None:
                if not pending.done():
                    return None
                del self._connecting[key]
                return self._connected(key, pending)
            if self.memory_released():
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
        self.nodes[key] = node
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
        del self.nodes[key], self.groups[key]
        self.retired_nodes.append(node)
        self.close_idle_retired()
        return True

    def every_node(self) -> tuple[DecodeNode, ...]:
        """The rank's decode nodes, connected and retired (read off sglang's thread: a copy)."""
        return (*tuple(self.nodes.values()), *tuple(self.retired_nodes))

    def close_idle_retired(self) -> None:
        """Close the retired nodes no request is left on (every one forgotten)."""
        for node in [n for n in self.retired_nodes if n.requests == 0]:
            node.close()
            self.retired_nodes.remove(node)

    def _group(self, bootstrap_addr: str, dp_rank: int) -> PrefillGroup:
        """The ranks of DP group ``dp_rank`` this rank talks to, as sglang maps attention-TP
        ranks between two widths (``tp_targets``), attention-CP ranks (``target_cp_ranks``: CP
        rank 0, or with layer split each CP rank, its layers written as a pipeline stage's, or
        with a page split each CP rank, its share of the pages) and pipeline stages
        (``target_stages``). KV sharding over attention TP (``page_split`` "tp"): every
        attention-TP rank writes its share of the pages to every decode attention-TP rank."""
        info = self.prefill_info_table[bootstrap_addr]
        split = page_split(info)
        cp_ranks = target_cp_ranks(info.attn_cp_size, bool(info.enable_dsa_cache_layer_split),
                                   split == "cp")
        pp_ranks = target_stages(self.pp_rank, self.pp_size, info.pp_size)

        def stages(tp_rank: int) -> list[str]:
            return [self._rank_endpoint(bootstrap_addr, dp_rank, cp, tp_rank, pp)
                    for cp in cp_ranks for pp in pp_ranks]

        if split == "tp":  # (equal widths: each prefill rank writes to every decode rank)
            return PrefillGroup(tuple(e for tp in range(info.attn_tp_size) for e in stages(tp)),
                                copies=self.attn_tp_size, shares=True)
        targets = tp_targets(self.attn_tp_rank, self.attn_tp_size, info.attn_tp_size)
        return PrefillGroup(tuple(stages(targets.source)),
                            tuple(e for tp in targets.idle for e in stages(tp)), targets.copies,
                            shares=split == "cp")

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
                              quarantine_timeout_s=self.quarantine_timeout_s,
                              peer_timeout_s=self.peer_timeout_s, heartbeat_s=self.heartbeat_s,
                              aux_buffers=self.aux_buffers, secret=self.secret,
                              checksums=self.checksums, staging_bytes=STAGING_BYTES,
                              kv_page_zero=self.kv_page_zero,
                              kv_on_index_pages=self.kv_on_index_pages)
        except BaseException:
            backend.close()  # (a node that failed closes it too: idempotent)
            raise
        return node, group

    def close_nodes(self) -> None:
        """Close every decode node: connected, retired, and made by an attempt still running
        (which ends first)."""
        made = [f.result()[0] for f in self._connecting.values() if f.exception() is None]
        for node in [*self.nodes.values(), *self.retired_nodes, *made]:
            node.close()
        self.nodes.clear()
        self.groups.clear()
        self.retired_nodes.clear()
        self._connecting.clear()

    def close(self) -> None:
        """Stop the connector (its attempt ends first), close the nodes, then the engine."""
        if self._connector is not None:
            self._connector.shutdown(wait=True)
        self.close_nodes()
        if self.engine is not None:
            self.registration.close()
            self.engine.close()
