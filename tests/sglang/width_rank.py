"""One sglang PD rank of a deployment whose prefill and decode have different attention-TP widths,
for ``test_sglang_tp_widths.py``, in its own process: ``python -m tests.sglang.width_rank ROLE
CONFIGS_JSON`` runs each scenario in turn and prints one ``RESULT [json, ...]`` line. Built on
``pd_rank.py`` (pools, ``MetadataBuffers``, sglang's own ``_init_kv_manager``) and ``tp_rank.py``
(a prefill rank's manager and its sender through the bootstrap queue).

Each rank is sglang rank ``tp_rank`` of ``tp_size`` with ``dp_size`` DP-attention groups and
``cp_size`` attention-CP ranks in each (its attention-TP, CP and DP ranks derived from it), its
ranks of one DP group (attention TP x CP) joined by a gloo group (``world``, ``dist_port``; with
one attention-TP rank that is sglang's CP group, whose MIN of the polls sglang's
``poll_and_all_reduce_attn_cp_tp_group`` takes), and serves ``requests`` (room, pages and aux
slots each):

- ``width-prefill``: a sender per request through sglang's bootstrap queue (polled to
  WaitingForInput), ``init``, the forward (attention-TP rank 0's pool holds the request's bytes,
  the other ranks' other bytes, attention-CP rank 0 the same, so a write from the wrong rank
  shows), ``send`` in two chunks,
  then the inflight queue: sglang's ``poll_and_all_reduce`` over the attention-TP group until
  every request's verdict.
- ``width-decode``: a receiver per request (``init`` with the prefill DP rank of its room),
  ``send_metadata``, then sglang's ``poll_and_all_reduce`` over the attention-TP group until
  every verdict; each request's pages, aux slot and the rest of the pool compared, the engines
  and nodes the rank made counted, and the prefill ranks the bootstrap server names for each
  attention-CP rank (``cp_routes``).

With ``layer_split`` (``--enable-dsa-cache-layer-split``) a prefill rank's pool is sglang's own
``LayerSplitDSATokenToKVPool`` over sglang's CP ``GroupCoordinator`` (gloo): its CP rank's layers
only, which sglang's ``_init_kv_manager`` names from the pool's ``layer_shard_start``.

With ``sharded`` (``--enable-kv-cache-sharding``) a prefill rank's pool is sglang's own
``PageInterleaveDSATokenToKVPool`` over sglang's KV shard group, a ``GroupCoordinator`` (gloo) of
its DP group: the attention-CP group with CP (the shape sglang allows for DSA pools), else the
attention-TP group. A request's ``src_pages`` are logical pages, logical page ``l`` held by rank
``l % 2`` as its local page ``l // 2``; each rank's pool holds other bytes (its own seed), and
decode compares each page with the rank that holds it (``compare_shares``). With
``all_cp_ranks`` (sglang's ``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER``, on both sides) each
prefill CP rank writes its contiguous share of the request's pages, from its own seed.
"""

from __future__ import annotations

import os
import time

import tests.sglang.conftest as shims  # noqa: F401  (the shims, before sglang)
from tests.sglang import pd_rank, tp_rank
from tests.transfer.helpers import wait_for

OTHER_RANKS_SEED = 50  # added to the seed on the prefill ranks that must not write


def as_rank(cfg: dict) -> None:
    """This process is sglang rank ``tp_rank`` (the published context gives rank 0)."""
    from sglang.srt.runtime_context import get_parallel

    if cfg.get("all_cp_ranks"):
        os.environ["SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"] = "1"
    cp = cfg.get("cp_size", 1)
    attn_tp = cfg["tp_size"] // (cfg.get("dp_size", 1) * cp)
    get_parallel().override_permanently(tp_rank=cfg["tp_rank"], attn_tp_rank=cfg["tp_rank"] % attn_tp,
                                        attn_cp_rank=cfg["tp_rank"] // attn_tp % cp,
                                        attn_dp_rank=cfg["tp_rank"] // (attn_tp * cp))


def tp_group(cfg: dict):
    """The gloo group of this rank's DP group, attention TP x CP (``world`` processes)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['dist_port']}",
                            world_size=cfg["world"], rank=cfg["dist_rank"])
    return dist.group.WORLD


def until_every_verdict(handles: list, group, what: str) -> list[int]:
    """sglang's queue steps: each the MIN of the group's polls, until every handle is terminal."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import poll_and_all_reduce

    deadline = time.monotonic() + 90
    while True:
        verdicts = poll_and_all_reduce(handles, group)
        if all(v in (KVPoll.Success, KVPoll.Failed) for v in verdicts):
            return [int(v) for v in verdicts]
        assert time.monotonic() < deadline, f"{what}: no verdict in 90 s ({verdicts})"
        time.sleep(0.005)


def prefill_rank(cfg: dict, server_args) -> dict:
    from sglang.srt.runtime_context import get_parallel

    as_rank(cfg)
    group = tp_group(cfg)
    pool, draft = (sharded_pools(cfg) if cfg.get("sharded")
                   else (layer_split_pool(cfg) if cfg.get("layer_split") else None, None))
    server, pool, metadata, manager = tp_rank.start_prefill_rank(cfg, server_args, pool, draft)
    senders = [tp_rank.initialised_sender({**cfg, **request}, manager) for request in cfg["requests"]]
    # MLA: decode reads from the group's first rank; with CP, from CP rank 0 (with layer split,
    # from every CP rank: each holds its own layers); sharded, from every rank (its own seed)
    parallel = get_parallel()
    writes = parallel.attn_tp_rank == 0 and (parallel.attn_cp_rank == 0 or cfg.get("layer_split"))
    if cfg.get("sharded") or cfg.get("all_cp_ranks"):  # every rank writes its share
        seed = cfg["seed"] + (parallel.attn_tp_rank + parallel.attn_cp_rank) * OTHER_RANKS_SEED
    else:
        seed = cfg["seed"] + (0 if writes else OTHER_RANKS_SEED)
    pd_rank.fill_pool(pool, seed, pd_rank.draft_views(draft, cfg))
    pd_rank.fill(pd_rank.aux_views(metadata), seed=seed + 1)
    for sender, request in zip(senders, cfg["requests"], strict=True):
        src = request["src_pages"]
        sender.send(src[:2], None)
        sender.send(src[2:], [src])
    verdicts = until_every_verdict(senders, group, "prefill")
    own = [int(s.poll()) for s in senders]
    written = [s._sender for s in senders if s._sender is not None]  # (none on a dummy CP rank)
    wait_for(lambda: all(s.can_release() for s in written), 30, "the writes to end")
    time.sleep(0.5)  # the last reports reach decode
    counters = manager.node.counters.snapshot()
    result = {"verdicts": verdicts, "own": own, "bytes": counters["bytes"],
              "handshakes": counters["handshakes_ok"], "endpoint": manager.node.endpoint,
              "dummy": manager.is_dummy_cp_rank, "layers": manager.bridge.kv_layer_ids,
              "reasons": [s.state.reason for s in written]}
    for sender in senders:
        sender.clear()
    manager.shutdown()
    pd_rank.close(server)
    return result


def layer_split_pool(cfg: dict):
    """sglang's ``LayerSplitDSATokenToKVPool`` of this CP rank (every rank of the DP group is a CP
    rank here: attention TP 1), over sglang's CP ``GroupCoordinator`` on the gloo world."""
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    from sglang.srt.mem_cache.dsa_cache_layer_split import LayerSplitDSATokenToKVPool
    from sglang.srt.runtime_context import get_parallel

    cp = GroupCoordinator([list(range(cfg["world"]))], cfg["dist_rank"], "gloo",
                          group_name="attn_cp", **pd_rank.GLOO_GROUP)
    get_parallel().override_permanently(attn_cp_group=cp, enable_dsa_cache_layer_split=True)
    return LayerSplitDSATokenToKVPool(**pd_rank.pool_kwargs(cfg), layer_shard_rank=cp.rank_in_group,
                                      layer_shard_size=cp.world_size)


def sharded_pools(cfg: dict):
    """sglang's ``PageInterleaveDSATokenToKVPool`` of this rank, its KV shard group (attention CP,
    or attention TP without CP: the whole DP group here) sglang's ``GroupCoordinator`` on the
    gloo world; and with ``draft_layers`` the draft model's, sharded alike (as sglang's
    configurator makes an MTP pool under KV sharding), else None."""
    from types import SimpleNamespace

    from sglang.srt.distributed.parallel_state import GroupCoordinator
    from sglang.srt.mem_cache.page_interleave import PageShardSpec
    from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveDSATokenToKVPool
    from sglang.srt.runtime_context import get_parallel

    over_cp = cfg.get("cp_size", 1) > 1
    shard = GroupCoordinator([list(range(cfg["world"]))], cfg["dist_rank"], "gloo",
                             group_name="attn_cp" if over_cp else "attn_tp", **pd_rank.GLOO_GROUP)
    alone = SimpleNamespace(world_size=1, rank_in_group=0)
    get_parallel().override_permanently(attn_cp_group=shard if over_cp else alone,
                                        attn_tp_group=alone if over_cp else shard,
                                        enable_kv_cache_sharding=True)
    spec = PageShardSpec(shard_rank=shard.rank_in_group, shard_size=shard.world_size, page_size=64,
                         max_prefix_tokens=64 * 2 * shard.world_size, chunk_tokens=128)
    pool = PageInterleaveDSATokenToKVPool(**pd_rank.pool_kwargs(cfg), shard_spec=spec,
                                          shard_group=shard)
    if not cfg.get("draft_layers"):
        return pool, None
    draft = {**pd_rank.pool_kwargs(cfg), "layer_num": cfg["draft_layers"], "start_layer": 0,
             "skip_topk_layers": None}
    return pool, PageInterleaveDSATokenToKVPool(**draft, shard_spec=spec, shard_group=shard)


def compare_shares(cfg: dict, pool, metadata, receiver, draft=None) -> dict:
    """``pd_rank.compare`` of each of two prefill ranks' shares of the pages, each from that
    rank's pool (seeded as that rank), the aux slot from rank 0. ``split`` "kv-sharding":
    logical page ``l`` from rank ``l % 2`` at its local page ``l // 2``; "cp": the first
    ``ceil(n / 2)`` pages from CP rank 0, the rest from CP rank 1, at the same page ids."""
    pages = cfg["src_pages"]
    if cfg["split"] == "kv-sharding":
        owner, local = [p % 2 for p in pages], [p // 2 for p in pages]
    else:
        owner, local = [int(i >= (len(pages) + 1) // 2) for i in range(len(pages))], pages
    parts = []
    for rank in (0, 1):
        at = [i for i in range(len(pages)) if owner[i] == rank]
        parts.append(pd_rank.compare({**cfg, "seed": cfg["seed"] + rank * OTHER_RANKS_SEED,
                                      "src_pages": [local[i] for i in at],
                                      "dst_pages": [cfg["dst_pages"][i] for i in at]},
                                     pool, metadata, receiver, draft))
    return {**parts[0], "mismatched": parts[0]["mismatched"] + parts[1]["mismatched"]}


def decode_rank(cfg: dict, server_args) -> dict:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    from dsa_bridge.plugin.sglang import decode_nodes

    as_rank(cfg)
    group = tp_group(cfg)
    pool, metadata = pd_rank.make_pool(cfg, bridge=True), pd_rank.metadata_buffers()
    draft = pd_rank.make_draft_pool(cfg)
    for view in [*pd_rank.views(pool).values(), *pd_rank.draft_views(draft, cfg).values(),
                 *pd_rank.aux_views(metadata)]:
        view.fill_(pd_rank.SENTINEL)
    engines = []  # the engines the rank builds: one, whatever the prefill groups it reads
    real = decode_nodes.create_backend
    decode_nodes.create_backend = lambda *args, **kwargs: engines.append(1) or real(*args, **kwargs)
    manager = pd_rank.decode_manager(
        pd_rank.scheduler_stand_in(cfg, server_args, pool, metadata, draft))
    addr = f"127.0.0.1:{cfg['port']}"
    wait_for(lambda: manager.try_ensure_parallel_info(addr), 240, "prefill parallel info")
    info = manager.prefill_info_table[addr]
    routes = cp_routes(addr, info.attn_cp_size)  # now: the prefill's server is gone once it is done
    dp_size = info.dp_size
    receivers = []
    for request in cfg["requests"]:
        receiver = get_kv_class(TransferBackend(cfg["engine"]), KVClassType.RECEIVER)(
            mgr=manager, bootstrap_addr=addr, bootstrap_room=request["room"])
        receiver.init(request["room"] % dp_size)  # sglang's follow_bootstrap_room
        receivers.append(receiver)
    for receiver, request in zip(receivers, cfg["requests"], strict=True):
        wait_for(lambda r=receiver: r.poll() != KVPoll.Bootstrapping, 60, "decode bootstrap")
        dst = request["dst_pages"]
        receiver.send_metadata(dst, request["dst_aux"], [dst])
    verdicts = until_every_verdict(receivers, group, "decode")
    result = {"verdicts": verdicts,
              "reasons": [pd_rank.reason_of(r) if v == 0 else "" for r, v in zip(receivers, verdicts,
                                                                               strict=True)],
              "groups": [[len(r._group.write), len(r._group.idle), r._group.copies, r._group.shares]
                         for r in receivers],
              "compared": [(compare_shares if request.get("split") else pd_rank.compare)(
                  {**cfg, **request}, pool, metadata, receiver, draft)
                           for receiver, request in zip(receivers, cfg["requests"], strict=True)],
              "untouched": untouched(cfg, pool, draft), "engines": len(engines),
              "nodes": len(manager.decode_nodes.nodes), "peers": [r.bootstrap_infos for r in receivers],
              "cp_routes": routes,
              "verifies_checksums": manager.should_verify_kv_checksum(addr)}
    for receiver in receivers:
        receiver.clear()
    manager.shutdown()
    return result


def cp_routes(addr: str, cp_size: int) -> list[str]:
    """The endpoint the bootstrap server names for each attention-CP rank of DP group 0, TP rank
    0 (sglang's ``GET /route``)."""
    import requests

    out = []
    for cp in range(cp_size):
        rank = requests.get(f"http://{addr}/route?prefill_dp_rank=0&prefill_cp_rank={cp}"
                            "&target_tp_rank=0&target_pp_rank=0", timeout=5).json()
        out.append(f"{rank['rank_ip']}:{rank['rank_port']}")
    return out


def untouched(cfg: dict, pool, draft=None) -> bool:
    """Every page no request of this rank named still holds the sentinel (``draft``'s too)."""
    named = {p for request in cfg["requests"] for p in request["dst_pages"]}
    others = [p for p in range(1, cfg["pages"] + 1) if p not in named]
    views = {**pd_rank.views(pool), **pd_rank.draft_views(draft, cfg)}
    return all(bool((v[others] == pd_rank.SENTINEL).all()) for v in views.values())


ROLES = {"width-prefill": prefill_rank, "width-decode": decode_rank}


def main() -> None:
    pd_rank.run_scenarios(lambda role, cfg, args: ROLES[role](cfg, args), lambda role, cfg: {
        "disaggregation_mode": "decode" if role == "width-decode" else "prefill",
        "tp_size": cfg["tp_size"], "dp_size": cfg.get("dp_size", 1),
        "attn_cp_size": cfg.get("cp_size", 1),
        "enable_dp_attention": cfg.get("dp_size", 1) > 1,
        "load_balance_method": "follow_bootstrap_room"})


if __name__ == "__main__":
    main()
