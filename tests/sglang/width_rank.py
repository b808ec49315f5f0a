"""One sglang PD rank of a deployment whose prefill and decode have different attention-TP widths,
for ``test_sglang_tp_widths.py``, in its own process: ``python -m tests.sglang.width_rank ROLE
CONFIGS_JSON`` runs each scenario in turn and prints one ``RESULT [json, ...]`` line. Built on
``pd_rank.py`` (pools, ``MetadataBuffers``, sglang's own ``_init_kv_manager``) and ``tp_rank.py``
(a prefill rank's manager and its sender through the bootstrap queue).

Each rank is sglang rank ``tp_rank`` of ``tp_size`` with ``dp_size`` DP-attention groups (its
attention-TP and DP ranks derived as sglang derives them), its ranks of one attention-TP group
joined by a gloo group (``world``, ``dist_port``), and serves ``requests`` (room, pages and aux
slots each):

- ``width-prefill``: a sender per request through sglang's bootstrap queue (polled to
  WaitingForInput), ``init``, the forward (attention-TP rank 0's pool holds the request's bytes,
  the other ranks' other bytes, so a write from the wrong rank shows), ``send`` in two chunks,
  then the inflight queue: sglang's ``poll_and_all_reduce`` over the attention-TP group until
  every request's verdict.
- ``width-decode``: a receiver per request (``init`` with the prefill DP rank of its room),
  ``send_metadata``, then sglang's ``poll_and_all_reduce`` over the attention-TP group until
  every verdict; each request's pages, aux slot and the rest of the pool compared, and the
  engines and nodes the rank made counted.
"""

from __future__ import annotations

import time

import tests.sglang.conftest as shims  # noqa: F401  (the shims, before sglang)
from tests.sglang import pd_rank, tp_rank
from tests.transfer.helpers import wait_for

OTHER_RANKS_SEED = 50  # added to the seed on the prefill ranks that must not write


def as_rank(cfg: dict) -> None:
    """This process is sglang rank ``tp_rank`` (the published context gives rank 0)."""
    from sglang.srt.runtime_context import get_parallel

    attn_tp = cfg["tp_size"] // cfg.get("dp_size", 1)
    get_parallel().override_permanently(tp_rank=cfg["tp_rank"], attn_tp_rank=cfg["tp_rank"] % attn_tp,
                                        attn_dp_rank=cfg["tp_rank"] // attn_tp)


def tp_group(cfg: dict):
    """The gloo group of this rank's attention-TP group (``world`` processes)."""
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
    server, pool, metadata, manager = tp_rank.prefill_manager(cfg, server_args)
    senders = [tp_rank.initialised_sender({**cfg, **request}, manager) for request in cfg["requests"]]
    writes = get_parallel().attn_tp_rank == 0  # MLA: decode reads from the group's first rank
    seed = cfg["seed"] + (0 if writes else OTHER_RANKS_SEED)
    pd_rank.fill_pool(pool, seed)
    pd_rank.fill(pd_rank.aux_views(metadata), seed=seed + 1)
    for sender, request in zip(senders, cfg["requests"], strict=True):
        src = request["src_pages"]
        sender.send(src[:2], None)
        sender.send(src[2:], [src])
    verdicts = until_every_verdict(senders, group, "prefill")
    own = [int(s.poll()) for s in senders]
    wait_for(lambda: all(s._sender.can_release() for s in senders), 30, "the writes to end")
    time.sleep(0.5)  # the last reports reach decode
    result = {"verdicts": verdicts, "own": own, "bytes": manager.node.counters.snapshot()["bytes"],
              "reasons": [s._sender.state.reason for s in senders]}
    for sender in senders:
        sender.clear()
    manager.shutdown()
    pd_rank.close(server)
    return result


def decode_rank(cfg: dict, server_args) -> dict:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    from dsa_bridge.plugin.sglang import manager as bridge_manager

    as_rank(cfg)
    group = tp_group(cfg)
    pool, metadata = pd_rank.make_pool(cfg, bridge=True), pd_rank.metadata_buffers()
    for view in [*pd_rank.views(pool).values(), *pd_rank.aux_views(metadata)]:
        view.fill_(pd_rank.SENTINEL)
    engines = []  # the engines the rank builds: one, whatever the prefill groups it reads
    real = bridge_manager.create_backend
    bridge_manager.create_backend = lambda *args, **kwargs: engines.append(1) or real(*args, **kwargs)
    manager = DecodePreallocQueue._init_kv_manager(
        pd_rank.scheduler_stand_in(cfg, server_args, pool, metadata, "decode"))
    addr = f"127.0.0.1:{cfg['port']}"
    wait_for(lambda: manager.try_ensure_parallel_info(addr), 240, "prefill parallel info")
    dp_size = manager.prefill_info_table[addr].dp_size
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
              "groups": [[len(r._group.write), len(r._group.idle), r._group.copies] for r in receivers],
              "compared": [pd_rank.compare({**cfg, **request}, pool, metadata, receiver)
                           for receiver, request in zip(receivers, cfg["requests"], strict=True)],
              "untouched": untouched(cfg, pool), "engines": len(engines),
              "nodes": len(manager.decode_nodes)}
    for receiver in receivers:
        receiver.clear()
    manager.shutdown()
    return result


def untouched(cfg: dict, pool) -> bool:
    """Every page no request of this rank named still holds the sentinel."""
    named = {p for request in cfg["requests"] for p in request["dst_pages"]}
    others = [p for p in range(1, cfg["pages"] + 1) if p not in named]
    return all(bool((v[others] == pd_rank.SENTINEL).all()) for v in pd_rank.views(pool).values())


ROLES = {"width-prefill": prefill_rank, "width-decode": decode_rank}


def main() -> None:
    pd_rank.run_scenarios(lambda role, cfg, args: ROLES[role](cfg, args), lambda role, cfg: {
        "disaggregation_mode": "decode" if role == "width-decode" else "prefill",
        "tp_size": cfg["tp_size"], "dp_size": cfg.get("dp_size", 1),
        "enable_dp_attention": cfg.get("dp_size", 1) > 1,
        "load_balance_method": "follow_bootstrap_room"})


if __name__ == "__main__":
    main()
