"""One rank of a mixed deployment for ``test_sglang_mixed.py``, in its own process: ``python -m
tests.sglang.mixed_rank ROLE CONFIG_JSON`` prints one ``RESULT {json}`` line. The plugin is
loaded by sglang's own ``load_plugins()`` when the test sets ``SGLANG_PLUGINS=dsa_bridge`` for the
process, so the same calls give dsa-bridge's classes on one side and sglang's own on the other.

As ``pd_rank.py``: sglang's own pool, ``MetadataBuffers`` and ``_init_kv_manager`` on the CPU (for
sglang's own Mooncake manager, sglang's shared Mooncake engine first, as its model runner does),
then the calls of sglang's queues. Prefill (``prefill``): the bootstrap server, the manager, a
sender, polled (its bootstrap queue) until decode is done (a file) — sglang's own prefill until
its request failed too, or ``ABORT_WAIT_S`` after that — then its status, when it failed and why
(sglang's ``failure_exception``, what its bootstrap queue aborts the request with); with
dsa-bridge's server, the foreign-decode count and when it first rose; then it says it is done (a
second file). Decode (``decode``): once the prefill is fully registered, a
receiver (``t0``), the parallel info asked once a second and the receiver polled (its prealloc
queue), ``init`` once the info is known, until the request fails or 30 s pass; its status, its
reason and the time it took; it stays up (dsa-bridge's ABORT sender is a thread of its process)
until the prefill is done, and reports the ABORT messages sent. Times are wall clock
(``time.time``), compared across the two processes of one host.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import requests

import tests.sglang.conftest as shims  # noqa: F401  (the shims, before sglang)
from dsa_bridge.plugin.sglang.mixed import marked_route_query
from tests.sglang.pd_rank import (
    close,
    decode_manager,
    make_pool,
    metadata_buffers,
    prefill_manager,
    reason_of,
    scheduler_stand_in,
)
from tests.transfer.helpers import wait_for

END_S = 30.0
ABORT_WAIT_S = 15.0  # how long sglang's prefill waits for its request to fail once decode is done


def init_engine(cfg: dict, manager_class) -> None:
    """sglang's shared Mooncake engine, which its own Mooncake manager takes (the model runner
    initialises it for PD)."""
    if cfg["engine"] == "mooncake" and not manager_class.__module__.startswith("dsa_bridge"):
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            init_mooncake_transfer_engine,
        )

        init_mooncake_transfer_engine("127.0.0.1")


def manager_class(cfg: dict):
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    return get_kv_class(TransferBackend(cfg["engine"]), KVClassType.MANAGER)


def run_prefill(cfg: dict, server_args) -> dict:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
    from sglang.srt.runtime_context import get_parallel

    backend = TransferBackend(cfg["engine"])
    server = get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER)(host="127.0.0.1", port=cfg["port"])
    init_engine(cfg, manager_class(cfg))
    get_parallel().override_permanently(pp_group=None)  # one stage: sglang's manager keeps it only
    pool, metadata = make_pool(cfg, bridge=False), metadata_buffers()
    manager = prefill_manager(scheduler_stand_in(cfg, server_args, pool, metadata))
    sender = get_kv_class(backend, KVClassType.SENDER)(
        mgr=manager, bootstrap_addr=f"127.0.0.1:{cfg['port']}", bootstrap_room=cfg["room"])
    foreign = getattr(server, "foreign_decodes", None)
    result = {"manager": type(manager).__name__, "recognised_at": None, "failed_at": None}
    deadline, decode_done = time.monotonic() + 240, None  # decode's start, its request, its report
    while time.monotonic() < deadline:
        if sender.poll() == KVPoll.Failed and result["failed_at"] is None:  # the bootstrap queue
            result["failed_at"] = time.time()
        if foreign is not None and foreign.count and result["recognised_at"] is None:
            result["recognised_at"] = time.time()
        if decode_done is None and Path(cfg["done"]).exists():
            decode_done = time.monotonic()
        if decode_done is not None and (foreign is not None or result["failed_at"] is not None
                                        or time.monotonic() - decode_done > ABORT_WAIT_S):
            break
        time.sleep(0.05)
    result.update(poll=int(sender.poll()), foreign=None if foreign is None else foreign.count)
    if result["failed_at"] is not None:
        result["reason"] = reason_of(sender)
    close(server)
    Path(cfg["prefill_done"]).touch()
    return result


def run_decode(cfg: dict, server_args) -> dict:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    backend = TransferBackend(cfg["engine"])
    init_engine(cfg, manager_class(cfg))
    pool, metadata = make_pool(cfg, bridge=True), metadata_buffers()
    manager = decode_manager(scheduler_stand_in(cfg, server_args, pool, metadata))
    addr = f"127.0.0.1:{cfg['port']}"
    url = (f"http://{addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1"
           "&target_pp_rank=-1" + marked_route_query())  # the test's own look: not counted

    def registered() -> bool:
        try:
            return requests.get(url, timeout=5).status_code == 200
        except requests.ConnectionError:
            return False

    wait_for(registered, 180, "prefill registered", poll_s=0.2)
    receiver = get_kv_class(backend, KVClassType.RECEIVER)(mgr=manager, bootstrap_addr=addr,
                                                           bootstrap_room=cfg["room"])
    t0, initialised, asked = time.time(), False, 0.0
    while receiver.poll() != KVPoll.Failed and time.time() - t0 < END_S:  # the prealloc queue
        if not initialised and time.monotonic() - asked >= 1.0:
            asked = time.monotonic()
            if manager.try_ensure_parallel_info(addr):
                receiver.init(0)
                initialised = True
        time.sleep(0.05)
    result = {"manager": type(manager).__name__, "poll": int(receiver.poll()), "t0": t0,
              "elapsed_s": time.time() - t0, "initialised": initialised}
    reason = reason_of(receiver)
    if reason:
        result["reason"] = reason
    Path(cfg["done"]).touch()
    wait_for(lambda: Path(cfg["prefill_done"]).exists(), ABORT_WAIT_S + 30, "the prefill's end")
    aborts = getattr(manager, "prefill_aborts", None)  # dsa-bridge's decode only
    result["aborts_sent"] = None if aborts is None else aborts.sent
    return result


def main() -> None:
    role, cfg = sys.argv[1], json.loads(sys.argv[2])
    from sglang.srt.plugins import load_plugins

    load_plugins()
    with shims.published_context(disaggregation_mode=role, disaggregation_transfer_backend=cfg["engine"],
                                 disaggregation_bootstrap_port=cfg["port"], host="127.0.0.1") as args:
        result = (run_prefill if role == "prefill" else run_decode)(cfg, args)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
