"""One sglang PD rank for ``test_sglang_phases.py``, in its own process: ``python -m
tests.sglang.phases_rank ROLE CONFIGS_JSON`` runs each scenario in turn and prints one ``RESULT
[json, ...]`` line. sglang's per-phase variables come from the environment the test sets.

As ``pd_rank.py`` (sglang's own ``load_plugins``, pools, ``MetadataBuffers`` and
``_init_kv_manager``), with the waits of sglang's queues held for a scenario's time: both sides
make their sender / receiver at the same moment (a file, as a request reaching both servers at
once); decode then stays ``decode_hold_s`` in its prealloc queue (polled, as sglang polls it)
before ``send_metadata`` — or never sends (``skip_metadata``); prefill, once decode's pages
arrived (its bootstrap queue polls), stays ``prefill_hold_s`` in its waiting queue and forward
(not polled, as sglang does not poll it there) before ``init`` and ``send``; then both poll to
the end. Each side reports its status, its reason, and when it ended from its request's start.
"""

from __future__ import annotations

import time
from pathlib import Path

import tests.sglang.conftest as shims  # noqa: F401  (the shims, before sglang)
from tests.sglang.pd_rank import (
    SENTINEL,
    aux_views,
    close,
    compare,
    decode_manager,
    fill,
    fill_pool,
    make_pool,
    metadata_buffers,
    prefill_manager,
    reason_of,
    run_scenarios,
    scheduler_stand_in,
    views,
)
from tests.transfer.helpers import wait_for

END_S = 60.0  # every wait of a scenario is bounded by this


def run_prefill(cfg: dict, server_args) -> dict:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    backend = TransferBackend(cfg["engine"])
    server = get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER)(host="127.0.0.1", port=cfg["port"])
    pool, metadata = make_pool(cfg, bridge=False), metadata_buffers()
    manager = prefill_manager(scheduler_stand_in(cfg, server_args, pool, metadata))
    result = {"node_timeout_s": manager.node.request_timeout_s}
    wait_for(lambda: Path(cfg["sync"]).exists(), 180, "decode ready")
    start = time.monotonic()  # before the sender: its phase clock starts when it is made
    sender = get_kv_class(backend, KVClassType.SENDER)(
        mgr=manager, bootstrap_addr=f"127.0.0.1:{cfg['port']}", bootstrap_room=cfg["room"])
    wait_for(lambda: sender.poll() != KVPoll.Bootstrapping, END_S, "prefill bootstrap")  # its queue
    result["bootstrapped_s"] = time.monotonic() - start
    if sender.poll() == KVPoll.WaitingForInput:
        time.sleep(cfg["prefill_hold_s"])  # the waiting queue and the forward: sglang does not poll
        src = cfg["src_pages"]
        sender.init(len(src), cfg["src_aux"])
        fill_pool(pool, cfg["seed"])
        fill(aux_views(metadata), seed=cfg["seed"] + 1)
        sender.send(src[:2], None)
        sender.send(src[2:], [src])
        wait_for(lambda: sender.poll() in (KVPoll.Success, KVPoll.Failed), END_S, "prefill end")
    result.update(poll=int(sender.poll()), reason=reason_of(sender) if sender.poll() == 0 else "",
                  ended_s=time.monotonic() - start, started_at=start)
    if sender.poll() == KVPoll.Success:
        sender.clear()
    manager.shutdown()
    close(server)
    return result


def run_decode(cfg: dict, server_args) -> dict:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    backend = TransferBackend(cfg["engine"])
    pool, metadata = make_pool(cfg, bridge=True), metadata_buffers()
    for view in [*views(pool).values(), *aux_views(metadata)]:
        view.fill_(SENTINEL)
    manager = decode_manager(scheduler_stand_in(cfg, server_args, pool, metadata))
    addr = f"127.0.0.1:{cfg['port']}"
    wait_for(lambda: manager.try_ensure_parallel_info(addr), 180, "prefill parallel info",
             poll_s=0.2)  # sglang asks once a second
    Path(cfg["sync"]).touch()  # the request reaches both servers now
    start = time.monotonic()  # before the receiver: its phase clock starts when it is made
    receiver = get_kv_class(backend, KVClassType.RECEIVER)(mgr=manager, bootstrap_addr=addr,
                                                           bootstrap_room=cfg["room"])
    receiver.init(0)
    hold_until = start + cfg["decode_hold_s"]
    while time.monotonic() < hold_until and receiver.poll() != KVPoll.Failed:  # the prealloc queue
        time.sleep(0.01)
    # sglang sends the pages only to a receiver past Bootstrapping (its node connected)
    wait_for(lambda: receiver.poll() != KVPoll.Bootstrapping, END_S, "decode bootstrap")
    result = {"node_timeout_s": next(iter(manager.decode_nodes.nodes.values())).request_timeout_s}
    if receiver.poll() != KVPoll.Failed and not cfg.get("skip_metadata"):
        receiver.send_metadata(cfg["dst_pages"], cfg["dst_aux"], [cfg["dst_pages"]])
        wait_for(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), END_S, "decode end")
    result.update(poll=int(receiver.poll()), reason=reason_of(receiver) if receiver.poll() == 0 else "",
                  ended_s=time.monotonic() - start, started_at=start)
    if receiver.poll() == KVPoll.Success:
        result.update(compare(cfg, pool, metadata, receiver))
    receiver.clear()
    manager.shutdown()
    return result


def main() -> None:
    run_scenarios(lambda role, cfg, args: (run_prefill if role == "prefill" else run_decode)(cfg, args))


if __name__ == "__main__":
    main()
