"""One process of ``test_sglang_scale.py``'s process set: four prefill and four decode processes
that together serve deployments past two ranks a side, each process an sglang scheduler rank in
every scenario, in turn: ``python -m tests.sglang.scale_rank ROLE CONFIGS_JSON`` prints one
``RESULT [json, ...]`` line. Built on ``width_rank.py`` (ranks, sglang's MIN of the polls),
``tp_rank.py`` (the bootstrap queue), ``pd_rank.py`` (pools, sglang's ``_init_kv_manager``,
the pipeline stages' bootstrap consensus) and compared as they compare.

The processes of a side share one gloo world (``side_port``, ``side_rank`` of ``side_size``),
made once; each scenario every process of the side makes the scenario's groups from it (a
collective, so a process idle in the scenario takes part too): the attention-TP groups
(``tp_groups``, a partition of the side's processes: sglang's ``poll_and_all_reduce`` over each)
and, with pipeline stages, sglang's pipeline ``GroupCoordinator`` (``pp_groups``), over which a
stage's bootstrap queue takes stage 0's verdict (``poll_and_all_reduce_prefill_pp``).

- ``scale-prefill``: a rank ``tp_rank`` of ``tp_size`` (``dp_size`` DP-attention groups),
  pipeline stage ``pp_rank`` of ``pp_size`` (its pool the stage's layers), of the prefill server
  at ``port`` (its bootstrap server on the server's first process); the bootstrap queue, ``init``,
  the forward (a rank that must not write holds other bytes), ``send`` in two chunks, the inflight
  queue over its attention-TP group;
- ``scale-decode``: a rank of a decode of ``tp_size`` / ``dp_size``, each of its ``requests``
  read from the prefill at the request's own ``port`` (several prefill servers into one decode):
  receiver, parallel info, ``init`` with the room's prefill DP rank, ``send_metadata``, polled
  to every verdict over its attention-TP group; each request compared with the bytes its prefill
  wrote (its ``seed``), the rest of the pool and of the aux buffers at the sentinel.

Each serving rank also reports what it costs (``cost``): the seconds its manager took to start
(engine, buffer registration, bootstrap registration; each engine made once before the first
scenario, so no rank pays the engines' imports), and the threads and sockets it added from
before its manager to after its requests (the per-rank figures of docs/sglang.md).
"""

from __future__ import annotations

import os
import time

import tests.sglang.conftest as shims  # noqa: F401  (the shims, before sglang)
from tests.sglang import pd_rank, tp_rank, width_rank
from tests.transfer.helpers import wait_for


def side_world(cfg: dict) -> None:
    """The side's gloo world, once per process."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['side_port']}",
                                world_size=cfg["side_size"], rank=cfg["side_rank"])


def own_group(partition: list[list[int]], rank: int, name: str):
    """sglang's ``GroupCoordinator`` (gloo) of ``rank``'s part of ``partition`` (every process of
    the side makes every part)."""
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    return GroupCoordinator(partition, rank, "gloo", group_name=name, **pd_rank.GLOO_GROUP)


def usage() -> dict:
    """This process's threads and sockets now."""
    fds = os.listdir("/proc/self/fd")
    sockets = 0
    for fd in fds:
        try:
            sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:  # closed meanwhile
            pass
    return {"threads": len(os.listdir("/proc/self/task")), "sockets": sockets}


def added(before: dict, started_s: float) -> dict:
    after = usage()
    return {"start_s": round(started_s, 3), **{k: after[k] - before[k] for k in before}}


def prefill_rank(cfg: dict, server_args) -> dict:
    import torch.distributed as dist
    from sglang.srt.runtime_context import get_parallel

    side_world(cfg)
    tp = own_group(cfg["tp_groups"], cfg["side_rank"], "attn_tp")
    pp = own_group(cfg["pp_groups"], cfg["side_rank"], "pp") if cfg.get("pp_groups") else None
    if not cfg.get("serves"):
        dist.barrier()
        return {"idle": True}
    width_rank.as_rank(cfg)
    if pp is not None:
        get_parallel().override_permanently(pp_rank=cfg["pp_rank"], pp_group=pp)
        cp = own_group([[r] for r in range(cfg["side_size"])], cfg["side_rank"], "attn_cp")
    before = usage()
    started = time.monotonic()
    server, pool, metadata, manager = start(cfg, server_args)
    started_s = time.monotonic() - started
    if pp is not None:  # sglang's bootstrap queue with stages: stage 0's verdict for all
        (request,) = cfg["requests"]
        sender, seen = pd_rank.stage_bootstrap(
            {**cfg, "late_sender_s": 0.0}, lambda: sender_of({**cfg, **request}, manager),
            (pp, tp, cp), manager.node.incoming)
        assert seen["verdict"] == 2, seen
        sender.init(len(request["src_pages"]), request["src_aux"])
        senders = [sender]
    else:
        senders = [tp_rank.initialised_sender({**cfg, **request}, manager)
                   for request in cfg["requests"]]
    seed = cfg["seed"] + (0 if cfg["writes"] else width_rank.OTHER_RANKS_SEED)
    pd_rank.fill_pool(pool, seed)
    pd_rank.fill(pd_rank.aux_views(metadata), seed=seed + 1)
    for sender, request in zip(senders, cfg["requests"], strict=True):
        src = request["src_pages"]
        sender.send(src[:2], None)
        sender.send(src[2:], [src])
    verdicts = width_rank.until_every_verdict(senders, tp.cpu_group, "prefill")
    written = [s._sender for s in senders if s._sender is not None]
    wait_for(lambda: all(s.can_release() for s in written), 30, "the writes to end")
    cost = added(before, started_s)
    time.sleep(0.5)  # the last reports reach decode
    counters = manager.node.counters.snapshot()
    result = {"verdicts": verdicts, "bytes": counters["bytes"], "endpoint": manager.node.endpoint,
              "handshakes": counters["handshakes_ok"], "layers": manager.bridge.kv_layer_ids,
              "reasons": [s.state.reason for s in written], "cost": cost}
    for sender in senders:
        sender.clear()
    dist.barrier()  # the side's processes end the scenario together (the bootstrap server last)
    manager.shutdown()
    pd_rank.close(server)
    return result


def start(cfg: dict, server_args):
    """The rank's bootstrap server (the server's first process only), its stage's pool,
    metadata buffers and manager (sglang's ``_init_kv_manager``, as the rank's stage)."""
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    first = cfg["tp_rank"] == 0 and cfg.get("pp_rank", 0) == 0
    server = (get_kv_class(TransferBackend(cfg["engine"]), KVClassType.BOOTSTRAP_SERVER)(
        host="127.0.0.1", port=cfg["port"]) if first else None)
    pool, metadata = pd_rank.make_pool(cfg, bridge=False), pd_rank.metadata_buffers()
    stand_in = pd_rank.scheduler_stand_in(cfg, server_args, pool, metadata)
    stand_in.pp_rank = cfg.get("pp_rank", 0)
    return server, pool, metadata, pd_rank.prefill_manager(stand_in)


def sender_of(cfg: dict, manager):
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    return get_kv_class(TransferBackend(cfg["engine"]), KVClassType.SENDER)(
        mgr=manager, bootstrap_addr=f"127.0.0.1:{cfg['port']}", bootstrap_room=cfg["room"])


def decode_rank(cfg: dict, server_args) -> dict:
    import torch.distributed as dist
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    side_world(cfg)
    tp = own_group(cfg["tp_groups"], cfg["side_rank"], "attn_tp")
    if not cfg.get("serves"):
        dist.barrier()
        return {"idle": True}
    width_rank.as_rank(cfg)
    pool, metadata = pd_rank.make_pool(cfg, bridge=True), pd_rank.metadata_buffers()
    for view in [*pd_rank.views(pool).values(), *pd_rank.aux_views(metadata)]:
        view.fill_(pd_rank.SENTINEL)
    before = usage()
    started = time.monotonic()
    manager = pd_rank.decode_manager(pd_rank.scheduler_stand_in(cfg, server_args, pool, metadata))
    started_s = time.monotonic() - started
    receivers = []
    for request in cfg["requests"]:
        addr = f"127.0.0.1:{request['port']}"
        wait_for(lambda a=addr: manager.try_ensure_parallel_info(a), 240, "prefill parallel info")
        receiver = get_kv_class(TransferBackend(cfg["engine"]), KVClassType.RECEIVER)(
            mgr=manager, bootstrap_addr=addr, bootstrap_room=request["room"])
        receiver.init(request["room"] % manager.prefill_info_table[addr].dp_size)
        receivers.append(receiver)
    for receiver, request in zip(receivers, cfg["requests"], strict=True):
        wait_for(lambda r=receiver: r.poll() != KVPoll.Bootstrapping, 60, "decode bootstrap")
        dst = request["dst_pages"]
        receiver.send_metadata(dst, request["dst_aux"], [dst])
    verdicts = width_rank.until_every_verdict(receivers, tp.cpu_group, "decode")
    cost = added(before, started_s)
    result = {"verdicts": verdicts, "cost": cost,
              "reasons": [pd_rank.reason_of(r) if v == 0 else "" for r, v in
                          zip(receivers, verdicts, strict=True)],
              "groups": [[len(r._group.write), len(r._group.idle), r._group.copies]
                         for r in receivers],
              "peers": [r.bootstrap_infos for r in receivers],
              "compared": [pd_rank.compare({**cfg, **request}, pool, metadata, receiver)
                           for receiver, request in zip(receivers, cfg["requests"], strict=True)],
              "untouched": width_rank.untouched(cfg, pool) and aux_untouched(cfg, metadata),
              "nodes": len(manager.decode_nodes.nodes)}
    for receiver in receivers:
        receiver.clear()
    dist.barrier()
    manager.shutdown()
    return result


def aux_untouched(cfg: dict, metadata) -> bool:
    """Every aux row no request of this rank named still holds the sentinel."""
    named = {request["dst_aux"] for request in cfg["requests"]}
    return all(bool((rows[[i for i in range(rows.shape[0]) if i not in named]] == pd_rank.SENTINEL).all())
               for rows in pd_rank.aux_views(metadata))


ROLES = {"scale-prefill": prefill_rank, "scale-decode": decode_rank}


def warm_up() -> None:
    """Each engine made and closed once, so that no rank's first manager pays the engines'
    imports and first start in what it reports (``cost``)."""
    from dsa_bridge.transfer.backends import create_backend

    for engine in ("mooncake", "nixl"):
        create_backend(engine, host="127.0.0.1").close()


def main() -> None:
    warm_up()
    pd_rank.run_scenarios(lambda role, cfg, args: ROLES[role](cfg, args), lambda role, cfg: {
        "disaggregation_mode": "decode" if role == "scale-decode" else "prefill",
        "tp_size": cfg.get("tp_size", 1), "dp_size": cfg.get("dp_size", 1),
        "pp_size": cfg.get("pp_size", 1), "enable_dp_attention": cfg.get("dp_size", 1) > 1,
        "load_balance_method": "follow_bootstrap_room"})


if __name__ == "__main__":
    main()
