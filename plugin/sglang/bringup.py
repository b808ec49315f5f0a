"""Bring-up of a dsa-bridge rank inside sglang, pure: which backend and sglang class, the host a
prefill rank registers to, whether a decode rank can pair with a prefill, and when to retry a
prefill that could not be reached.

- ``backend_of`` / ``sglang_class``: the configured transfer backend, and sglang's own class of it
  (the fallback for pools that are not DSA pools);
- ``bootstrap_host``: the host sglang's ``register_to_bootstrap`` would register;
- ``cp_problems``: the attention context parallelism (CP) a rank refuses at start-up, by name;
  ``dummy_cp_rank``: whether a prefill CP rank writes nothing (sglang's ``is_dummy_cp_rank``);
  ``target_cp_ranks``: which prefill CP ranks a decode rank reads from;
- ``PageShare``: the share of each request's pages a prefill rank writes when the pages are
  split among ranks (sglang's KV sharding, prefill CP's page split), and ``cp_page_bounds``;
- ``pairing_problems``: why a decode rank cannot pair with a prefill, each reason naming the flag
  to change (empty when it can);
- ``tp_targets``: which prefill attention-TP ranks a decode rank reads from and tells it has
  nothing to send, and to how many decode ranks a prefill rank writes, for any two widths;
- ``target_stages``: which prefill pipeline stages a decode stage reads from;
- ``dp_route``: how a prefill request's DP rank reaches decode (registered, or computed from its
  room, or a conflict);
- ``PeerBackoff``: retry times after failed connections, doubling up to a bound.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import numpy as np
from sglang.srt.disaggregation.common.conn import PrefillServerInfo
from sglang.srt.utils.network import NetworkAddress

from .mixed import CP_PAGE_SPLIT_MARK, bridge_layout, marked_policy

BACKENDS = {"mooncake": ("sglang.srt.disaggregation.mooncake", "Mooncake"),
            "nixl": ("sglang.srt.disaggregation.nixl", "Nixl")}
BACKOFF_FIRST_S = 1.0  # after a prefill's first failed connection; doubling per failure...
BACKOFF_MAX_S = 30.0  # ...up to this


def sglang_class(backend: str, role: str) -> type:
    """sglang's own class for ``role`` ("KVManager", "KVSender", ...) of ``backend``."""
    module, prefix = BACKENDS[backend]
    return getattr(importlib.import_module(module), prefix + role)


def backend_of(server_args) -> str:
    backend = str(getattr(server_args.disaggregation_transfer_backend, "value",
                          server_args.disaggregation_transfer_backend))
    if backend not in BACKENDS:
        raise ValueError(f"dsa-bridge serves the transfer backends {sorted(BACKENDS)}, not {backend!r}")
    return backend


def bootstrap_host(serving_host: str, dist_init_addr: str | None) -> str:
    """The host a prefill rank registers to, as sglang's ``CommonKVManager.register_to_bootstrap``
    chooses it: with ``--dist-init-addr`` (multi-node) that address's host, where the bootstrap
    server runs beside rank 0; otherwise ``--host``, a wildcard rewritten to the loopback of its
    family (the wildcard listener binds it too, and a single node's ranks are all local)."""
    if dist_init_addr:
        return NetworkAddress.parse(dist_init_addr).resolved().host
    return {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(serving_host, serving_host)


def cp_problems(*, prefill: bool, attn_cp_size: int, kv_sharding: bool = False,
                cp_tp_group_sharing: bool = False) -> list[str]:
    """Why a rank refuses to start, by its context parallelism (attention CP), each reason naming
    the flag or variable to change; empty when it is served. Served on prefill, any
    ``--attn-cp-size``: sglang's default for DSA pools, every CP rank holding the whole KV and
    indexer (prefill CP all-gathers before writing the pool), CP rank 0 writing every request and
    the others ending it writing nothing (``dummy_cp_rank``); ``--enable-dsa-cache-layer-split``,
    each CP rank holding and writing its own layers, as pipeline stages do; and the page splits
    (``PageShare``: ``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER``, KV sharding), each CP rank
    writing its share of every layer. Refused: CP-TP group sharing, CP on decode (sglang's own
    decode asserts CP 1) and KV sharding on decode (sglang serves it on prefill only)."""
    problems = []
    if not prefill:
        if kv_sharding:
            problems.append("--enable-kv-cache-sharding on decode: sglang serves it on prefill "
                            "only (remove it from the decode)")
        if attn_cp_size > 1:
            problems.append(f"--attn-cp-size {attn_cp_size} on decode: sglang serves attention "
                            "context parallelism on prefill only (give decode --attn-cp-size 1)")
        return problems
    if attn_cp_size == 1:
        return problems
    if cp_tp_group_sharing:
        problems.append("CP-TP group sharing (sglang's enable_cp_tp_group_sharing, derived from the "
                        "model under --enable-prefill-cp): each CP rank holds a share of the state, "
                        "which dsa-bridge does not move (give prefill --attn-cp-size 1)")
    return problems


def dummy_cp_rank(attn_cp_size: int, attn_cp_rank: int, layer_split: bool = False,
                  split_pages: bool = False) -> bool:
    """Whether a prefill rank writes nothing of any request, as sglang's ``is_dummy_cp_rank`` in
    sglang's default CP mode (``cp_problems``): every CP rank but 0 (with layer split or a page
    split, none). Its senders reach WaitingForInput at once and Success with the request's last
    chunk; decode never reads from it."""
    return attn_cp_size > 1 and attn_cp_rank != 0 and not (layer_split or split_pages)


def target_cp_ranks(prefill_cp_size: int, layer_split: bool,
                    split_pages: bool = False) -> tuple[int, ...]:
    """The prefill CP ranks a decode rank reads from, as sglang's ``_resolve_rank_mapping``: CP
    rank 0 (the others are dummy senders), or with layer split every CP rank (each writes its
    own layers, as a pipeline stage), or with the request's pages split among them
    (``split_pages``) every CP rank (each writes its share of every layer)."""
    return tuple(range(prefill_cp_size)) if layer_split or split_pages else (0,)


def cp_page_bounds(num_pages: int, rank: int, size: int) -> tuple[int, int]:
    """The request's pages ``[start, end)`` prefill CP rank ``rank`` of ``size`` writes in
    sglang's CP page split: contiguous shares, the first ``num_pages % size`` one page longer."""
    base, longer = divmod(num_pages, size)
    start = rank * base + min(rank, longer)
    return start, start + base + (1 if rank < longer else 0)


@dataclass(frozen=True)
class PageShare:
    """The share of each request's pages prefill rank ``rank`` of ``size`` writes (every layer of
    each). ``interleaved``: sglang's KV sharding, where logical page ``l`` lives on rank
    ``l % size`` as its local page ``l // size`` (sglang's page-interleave placement); else
    prefill CP's page split (``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER``), where every
    rank holds every page and writes a contiguous share (``cp_page_bounds``)."""

    rank: int
    size: int
    interleaved: bool

    def of_chunk(self, pages: np.ndarray, start: int,
                 num_pages: int) -> tuple[np.ndarray, np.ndarray]:
        """This rank's (page ids in its pool, positions in the request) of a chunk whose
        ``pages`` are the request's pages from ``start`` on, of ``num_pages`` in all."""
        positions = np.arange(start, start + pages.size, dtype=np.int64)
        if self.interleaved:
            owned = pages % self.size == self.rank
            return pages[owned] // self.size, positions[owned]
        low, high = cp_page_bounds(num_pages, self.rank, self.size)
        owned = (positions >= low) & (positions < high)
        return pages[owned], positions[owned]


def page_share(*, attn_cp_size: int, attn_cp_rank: int, layer_split: bool, all_cp_ranks: bool,
               shard: tuple[int, int] | None) -> PageShare | None:
    """The share a prefill rank writes of each request's pages, as sglang's senders choose it:
    its KV shard (``shard``: (rank, size) in sglang's KV shard group, size above 1), else with
    ``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER`` and CP but no layer split its CP range; None:
    every page it writes."""
    if shard is not None and shard[1] > 1:
        return PageShare(*shard, interleaved=True)
    if all_cp_ranks and attn_cp_size > 1 and not layer_split:
        return PageShare(attn_cp_rank, attn_cp_size, interleaved=False)
    return None


def pairing_problems(info: PrefillServerInfo, *, page_size: int, kv_cache_dtype: str | None,
                     attn_tp_size: int, pp_size: int = 1, policy: str = "early") -> list[str]:
    """Why this decode rank cannot pair with the prefill whose parallel info is ``info``, each
    reason naming the flag to change; empty when it can."""
    problems = []
    if not bridge_layout(info.kv_layout):
        problems.append(f"the prefill registered kv_layout {info.kv_layout!r}, not dsa-bridge's: it "
                        "does not run dsa-bridge's transfer (set SGLANG_PLUGINS=dsa_bridge on the "
                        "prefill too)")
    if info.page_size != page_size:
        problems.append(f"page size: prefill {info.page_size}, decode {page_size} (both servers "
                        "need the same --page-size)")
    if info.kv_cache_dtype != kv_cache_dtype:
        problems.append(f"KV cache dtype: prefill {info.kv_cache_dtype}, decode {kv_cache_dtype} "
                        "(both servers need the same --kv-cache-dtype)")
    wider, narrower = max(info.attn_tp_size, attn_tp_size), min(info.attn_tp_size, attn_tp_size)
    if wider % narrower:
        problems.append(f"attention-TP widths: prefill {info.attn_tp_size}, decode {attn_tp_size}, "
                        "neither a multiple of the other (give the servers --tp-size / "
                        "(--attn-dp-size x --attn-cp-size) that divide each other)")
    sharded_tp = info.enable_kv_cache_sharding and info.attn_cp_size == 1
    if sharded_tp and info.attn_tp_size != attn_tp_size:
        problems.append(f"--enable-kv-cache-sharding on the prefill needs equal attention-TP "
                        f"widths (sglang's own decode asserts it): prefill {info.attn_tp_size}, "
                        f"decode {attn_tp_size} (give the servers equal --tp-size / --attn-dp-size, "
                        "or remove it)")
    theirs = marked_policy(info.decode_allocation_policy) or "early"  # (unmarked: the default)
    if bridge_layout(info.kv_layout) and theirs != policy:
        problems.append(f"decode allocation policy: prefill {theirs}, decode {policy} (set "
                        "--disaggregation-decode-allocation-policy identically on both servers)")
    if pp_size > 1 and info.pp_size != pp_size:
        problems.append(f"pipeline stages: prefill {info.pp_size}, decode {pp_size} (a decode with "
                        "pipeline stages needs the prefill's --pp-size; or give decode --pp-size 1)")
    return problems


@dataclass(frozen=True)
class TPTargets:
    """Which prefill attention-TP ranks a decode rank talks to, as sglang's ``CommonKVReceiver``
    maps them for MLA pools (whose KV every rank holds whole): ``source`` writes the request;
    each of ``idle`` is told it has nothing to send (a prefill wider than decode); ``copies``:
    how many decode ranks ``source`` writes the request to (a decode wider than prefill)."""

    source: int
    idle: tuple[int, ...] = ()
    copies: int = 1


@dataclass(frozen=True)
class PrefillGroup:
    """A decode rank's prefill DP group, by control endpoint: ``write``, the ranks that write
    its requests (one per pipeline stage; with ``shares``, each a share of the pages); ``idle``,
    those told they have nothing to send (every stage of each); ``copies`` as in
    ``TPTargets``."""

    write: tuple[str, ...]
    idle: tuple[str, ...] = ()
    copies: int = 1
    shares: bool = False

    @property
    def endpoints(self) -> list[str]:
        return [*self.write, *self.idle]


def tp_targets(decode_tp_rank: int, decode_tp_size: int, prefill_tp_size: int) -> TPTargets:
    """The prefill TP ranks of decode attention-TP rank ``decode_tp_rank`` (widths that divide
    each other: ``pairing_problems``)."""
    if decode_tp_size >= prefill_tp_size:
        copies = decode_tp_size // prefill_tp_size
        return TPTargets(decode_tp_rank // copies, (), copies)
    group = prefill_tp_size // decode_tp_size
    first = decode_tp_rank * group
    return TPTargets(first, tuple(range(first + 1, first + group)))


def page_split(info: PrefillServerInfo) -> str:
    """Over which ranks the prefill whose parallel info is ``info`` splits each request's pages:
    "tp" (KV sharding without CP: every attention-TP rank writes its share, widths equal), "cp"
    (its CP ranks: KV sharding with CP, or ``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER`` on the
    prefill, which its ``kv_layout`` says: ``mixed.layout_mark``), or "" (no split). sglang's own
    decode reads its own ``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER`` instead, so a decode
    without it would read CP rank 0 alone."""
    if info.attn_cp_size == 1:
        return "tp" if info.enable_kv_cache_sharding else ""
    if info.enable_dsa_cache_layer_split:
        return ""
    return "cp" if info.enable_kv_cache_sharding or info.kv_layout == CP_PAGE_SPLIT_MARK else ""


def target_stages(decode_pp_rank: int, decode_pp_size: int, prefill_pp_size: int) -> tuple[int, ...]:
    """The prefill pipeline stages decode stage ``decode_pp_rank`` reads from, as sglang maps
    them: a one-stage decode reads every stage (each writes its layers), a decode with the
    prefill's stages reads its own (the same layers; ``pairing_problems`` refuses the rest)."""
    if decode_pp_size == 1:
        return tuple(range(prefill_pp_size))
    return (decode_pp_rank,)


@dataclass(frozen=True)
class DPRoute:
    """How a prefill request's DP rank reaches decode, as sglang's ``CommonKVSender`` decides it:
    ``register`` it with the bootstrap server (``POST /register_dp_rank``, which sglang's decode
    queries), or nothing (one DP rank, the rank given with the request, or decode computes it
    from the room: ``follow_bootstrap_room``); ``conflict``: the request was dispatched to
    another rank than its room implies, and fails with this reason."""

    register: bool = False
    conflict: str = ""


def dp_route(room: int, dp_rank: int, num_dp_ranks: int, *, load_balance_method: str,
             force_query: bool, given_dp_rank: bool) -> DPRoute:
    """The DP route of request ``room`` on prefill DP rank ``dp_rank`` (see ``DPRoute``)."""
    if num_dp_ranks <= 1 or given_dp_rank:
        return DPRoute()
    if load_balance_method != "follow_bootstrap_room" or force_query:
        return DPRoute(register=True)
    if dp_rank != room % num_dp_ranks:
        return DPRoute(conflict=(
            f"follow_bootstrap_room conflict: dispatched to dp_rank {dp_rank} but bootstrap_room "
            f"{room} implies dp_rank {room % num_dp_ranks}. Set "
            "SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK=1 to allow mixed routing."))
    return DPRoute()


@dataclass(frozen=True)
class PeerBackoff:
    """Why connecting to a prefill (DP group) last failed, and when to try again: ``BACKOFF_FIRST_S``
    after the first failure, doubling with each further one up to ``BACKOFF_MAX_S``. Pure: the
    caller passes ``now``."""

    reason: str
    failures: int
    retry_at: float

    @staticmethod
    def after(previous: PeerBackoff | None, reason: str, now: float) -> PeerBackoff:
        failures = 1 if previous is None else previous.failures + 1
        delay = min(BACKOFF_FIRST_S * 2 ** (failures - 1), BACKOFF_MAX_S)
        return PeerBackoff(reason, failures, now + delay)
