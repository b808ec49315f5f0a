"""One sglang decode rank whose queues are made by sglang's own ``__init__`` (the hooked one), for
``test_sglang_release_bound.py``, in its own process: ``python -m tests.sglang.bound_rank bound
CONFIGS_JSON`` (``prefill``: ``pd_rank``'s prefill rank) runs each scenario in turn and prints one
``RESULT [json, ...]`` line.

Per scenario, as sglang's scheduler makes them (scheduler.py ~1585-1610): its
``DecodeTransferQueue`` (which reads sglang's deferral flag and deadline from its variables, set
from ``env`` first), then its ``DecodePreallocQueue``, whose ``__init__`` makes the manager
(``_init_kv_manager``) and runs dsa-bridge's AFTER hook; the scheduler's other attributes are
stand-ins. What each queue and the manager's fence then hold as their bound, the lines dsa-bridge
logged, and how it would tell a release forced at sglang's deadline. With ``abort`` a request
follows (``release_rank``'s steps, over these queues): sent to the prefill, aborted while its write
is held in flight, then sglang's ``pop_transferred`` / ``resolve_deferred_releases`` until the pages
are released and the prefill's write window is over.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from types import SimpleNamespace

import tests.sglang.conftest as shims  # noqa: F401  (the shims, before sglang)
from tests.sglang import pd_rank, release_rank
from tests.sglang.prealloc_rank import make_req
from tests.transfer.helpers import wait_for


def sglangs_queues(cfg: dict, server_args, pool, metadata, group):
    """sglang's transfer and prefill-allocation queues, by their own ``__init__``, in the
    scheduler's order; sglang's deadline as its transfer queue read it."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeTransferQueue
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator, TransferBackend
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(attn_tp_group=SimpleNamespace(cpu_group=group))
    scheduler = pd_rank.scheduler_stand_in(cfg, server_args, pool, metadata).scheduler
    scheduler.__dict__.update(
        spec_algorithm=None, random_seed=0, enable_decode_hicache=False, kv_checksum_computer=None,
        metrics_reporter=SimpleNamespace(enable_metrics=False),
        output_streamer=SimpleNamespace(stream_output=lambda reqs, logprob: None))
    scheduler.tp_worker.is_hybrid_swa = False
    allocator, tree = ReqToMetadataIdxAllocator(8), SimpleNamespace(unlock=lambda lock: None)
    transfer = DecodeTransferQueue(req_to_metadata_buffer_idx_allocator=allocator,
                                   metadata_buffers=metadata, scheduler=scheduler, tree_cache=tree)
    read = transfer.deferred_kv_release_timeout
    prealloc = DecodePreallocQueue(
        req_to_token_pool=None, token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: pool),
        draft_token_to_kv_pool=None, req_to_metadata_buffer_idx_allocator=allocator,
        metadata_buffers=metadata, scheduler=scheduler, transfer_queue=transfer, tree_cache=tree,
        gpu_id=0, bootstrap_port=cfg["port"], max_total_num_tokens=64 * cfg["pages"],
        num_reserved_decode_tokens=0, transfer_backend=TransferBackend(cfg["engine"]))
    scheduler.disagg_decode_prealloc_queue = prealloc
    return transfer, prealloc, read


def queued(cfg: dict, pool, transfer, manager) -> SimpleNamespace:
    """The request sent to the prefill and in sglang's transfer queue (``release_rank``'s side)."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.decode import DecodeRequest
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    expected = pd_rank.make_pool(cfg, bridge=False)
    pd_rank.fill_pool(expected, cfg["seed"])
    released: list[dict] = []

    def release_request(decode_req) -> None:  # stands in for sglang's (radix tree) release
        released.append({"at": time.monotonic(), "fence": decode_req.kv_receiver.can_release()})

    transfer._release_request = release_request
    addr, room = f"127.0.0.1:{cfg['port']}", cfg["room"]
    receiver = get_kv_class(TransferBackend(cfg["engine"]), KVClassType.RECEIVER)(
        mgr=manager, bootstrap_addr=addr, bootstrap_room=room)
    wait_for(lambda: manager.try_ensure_parallel_info(addr), 180, "prefill parallel info")
    receiver.init(0)
    wait_for(lambda: receiver.poll() == KVPoll.WaitingForInput, 30, "decode bootstrap")
    idx = transfer.req_to_metadata_buffer_idx_allocator.alloc()
    receiver.send_metadata(cfg["dst_pages"], idx, [cfg["dst_pages"]])
    decode_req = DecodeRequest(req=make_req("r", cfg["port"], room), kv_receiver=receiver,
                               metadata_buffer_index=idx)
    transfer.add(decode_req)
    return SimpleNamespace(cfg=cfg, pool=pool, expected=expected, manager=manager, queue=transfer,
                           released=released, receiver=receiver, decode_req=decode_req, room=room,
                           dst=cfg["dst_pages"], held=0)


def aborted(side: SimpleNamespace) -> dict:
    """Abort mid-write, then sglang's steps until released and the write window is over."""
    cfg, pool, expected = side.cfg, side.pool, side.expected
    wait_for(lambda: release_rank.landed(pool, cfg, expected) > 0, 60, "the first half of the write")
    landed_at_abort = release_rank.landed(pool, cfg, expected)
    side.receiver.abort()  # the scheduler's abort of a transfer-queue request
    answers = release_rank.sglangs_answers(side.manager, side.room)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if release_rank.step(side):
            release_rank.give_to_new_owner(side)
        if side.released and time.monotonic() > side.released[0]["new_owner_at"] + cfg["write_window_s"]:
            break
        time.sleep(0.01)
    return {"released": side.released, "held": side.held, "landed_at_abort": landed_at_abort,
            "landed_at_end": release_rank.landed(pool, cfg, expected),
            "answers_false": answers.count(False), "last_answer": answers[-1] if answers else None,
            "new_owner_intact": release_rank.new_owner_intact(side),
            "forced_releases": side.manager.deferred_release.forced_releases}


def run(cfg: dict, server_args, group, lines: release_rank.LogLines) -> dict:
    for name, value in zip(release_rank.ENV, cfg["env"], strict=True):
        os.environ[name] = value
    lines.messages.clear()
    pool, metadata = pd_rank.make_pool(cfg, bridge=True), pd_rank.metadata_buffers()
    for view in [*pd_rank.views(pool).values(), *pd_rank.aux_views(metadata)]:
        view.fill_(pd_rank.SENTINEL)
    transfer, prealloc, read = sglangs_queues(cfg, server_args, pool, metadata, group)
    manager = prealloc.kv_manager
    result = {"manager": type(manager).__qualname__, "sglang_read": read,
              "sglang_deadline": transfer.deferred_kv_release_timeout,
              "fence_bound": manager.decode_nodes.quarantine_timeout_s,
              "forced_text": manager.deferred_release.at_deadline(),  # a release at the deadline
              "bound_lines": [m for m in lines.messages if "held at most" in m]}
    if cfg.get("abort"):
        side = queued(cfg, pool, transfer, manager)
        result.update(aborted(side), node_bound=side.receiver._node.quarantine_timeout_s)
    manager.shutdown()
    return result


def main() -> None:
    """``bound``: the decode rank above; ``prefill``: ``pd_rank``'s prefill rank."""
    import torch.distributed as dist
    from sglang.srt.plugins import load_plugins

    if sys.argv[1] == "prefill":
        pd_rank.main()
        return
    configs = json.loads(sys.argv[2])
    load_plugins()
    lines = release_rank.LogLines(logging.INFO)
    logging.getLogger("dsa_bridge.plugin.sglang").addHandler(lines)
    logging.getLogger("dsa_bridge.plugin.sglang").setLevel(logging.INFO)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{configs[0]['dist_port']}",
                            world_size=1, rank=0)
    group = dist.new_group([0], backend="gloo")
    results = []
    for cfg in configs:
        with shims.published_context(
                disaggregation_mode="decode", disaggregation_transfer_backend=cfg["engine"],
                host="127.0.0.1", disaggregation_bootstrap_port=cfg["port"]) as args:
            results.append(run(cfg, args, group, lines))
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
