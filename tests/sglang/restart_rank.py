"""A decode rank for ``test_sglang_restart.py``, in its own process: ``python -m
tests.sglang.restart_rank decode CONFIGS_JSON`` serves the requests of the list in turn through
ONE manager (sglang's own ``_init_kv_manager`` of ``DecodePreallocQueue``, as ``pd_rank.py``
makes it), as a decode server outlives a prefill's restart. Before each request it waits for
that request's ``go_file`` (the test writes it once the request's prefill process registered),
then makes the calls sglang's queues make (``try_ensure_parallel_info``, ``init``,
``send_metadata``, poll to the end, ``clear``), compares the bytes with what prefill wrote, and
prints ``FINISHED``; at the end one ``RESULT [json, ...]`` line: each request's outcome, and the
manager's nodes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import tests.sglang.conftest as shims  # noqa: F401  (the shims, before sglang)
from tests.sglang.pd_rank import (
    SENTINEL,
    aux_views,
    compare,
    decode_manager,
    make_pool,
    metadata_buffers,
    reason_of,
    scheduler_stand_in,
    views,
)
from tests.transfer.helpers import wait_for


def serve(configs: list[dict], server_args) -> list[dict]:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    first = configs[0]
    backend = TransferBackend(first["engine"])
    pool, metadata = make_pool(first, bridge=True), metadata_buffers()
    manager = decode_manager(scheduler_stand_in(first, server_args, pool, metadata))
    addr = f"127.0.0.1:{first['port']}"
    results = []
    for cfg in configs:
        wait_for(lambda cfg=cfg: Path(cfg["go_file"]).exists(), 180, "the test's go")
        for view in [*views(pool).values(), *aux_views(metadata)]:
            view.fill_(SENTINEL)
        receiver = get_kv_class(backend, KVClassType.RECEIVER)(mgr=manager, bootstrap_addr=addr,
                                                               bootstrap_room=cfg["room"])
        wait_for(lambda: manager.try_ensure_parallel_info(addr), 60, "prefill parallel info")
        receiver.init(0)
        wait_for(lambda r=receiver: r.poll() != KVPoll.Bootstrapping, 30, "decode bootstrap")
        result = {"room": cfg["room"]}
        if receiver.poll() != KVPoll.Failed:
            dst = cfg["dst_pages"]
            receiver.send_metadata(dst, cfg["dst_aux"], [dst])
            wait_for(lambda r=receiver: r.poll() in (KVPoll.Success, KVPoll.Failed), 60, "decode end")
        result["poll"] = int(receiver.poll())
        if receiver.poll() == KVPoll.Success:
            result.update(compare(cfg, pool, metadata, receiver))
            result["prefill"] = receiver.bootstrap_infos
        else:
            result["reason"] = reason_of(receiver)
        receiver.clear()
        result["nodes"] = len(manager.decode_nodes.nodes)
        result["retired"] = len(manager.decode_nodes.retired_nodes)
        results.append(result)
        print("FINISHED", flush=True)  # this request's end seen: its prefill may go now
    manager.shutdown()
    return results


def main() -> None:
    configs = json.loads(sys.argv[2])
    from sglang.srt.plugins import load_plugins

    load_plugins()
    first = configs[0]
    with shims.published_context(disaggregation_mode="decode",
                                 disaggregation_transfer_backend=first["engine"],
                                 disaggregation_bootstrap_port=first["port"],
                                 host="127.0.0.1") as args:
        results = serve(configs, args)
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
