"""One sglang decode rank whose failed requests go through sglang's own deferred-release code, for
``test_sglang_release.py``, in its own process: ``python -m tests.sglang.release_rank release
CONFIGS_JSON`` runs each scenario in turn and prints one ``RESULT [json, ...]`` line.

The queue is a real ``DecodeTransferQueue`` made by its own ``__init__`` (the deferral flag and
deadline from sglang's own environment variables), without the prefill-allocation queue, so without
dsa-bridge's hook that raises that deadline to the one bound (``transfer_queue``; the forced case is
a sglang that never took the bound): its gloo group a real one-rank torch.distributed group, its
metadata buffers and index allocator sglang's own. Its manager comes from sglang's own
``DecodePreallocQueue._init_kv_manager`` (the hooked ``get_kv_class``: dsa-bridge's), its requests
are sglang's ``Req``. Stand-ins: ``_release_request`` (sglang's frees the pages through the radix
tree) records when sglang releases a request's pages, what dsa-bridge's fence said then, and gives
the pages to a "new owner" (refilled with another sentinel); the scheduler's output streamer and
tree cache are no-ops.

Per scenario, as sglang's queues call it: receiver, ``try_ensure_parallel_info``, ``init``,
``send_metadata`` (prealloc queue); ``add`` to the transfer queue; then, once prefill's write is
half landed (the prefill holds every write in flight ``DSA_BRIDGE_FAULT_WRITE_DELAY_MS``), the
request's end: the scheduler's abort of a transfer-queue request (``kv_receiver.abort()``,
scheduler.py ~5780; ``abort``), or the prefill's process killed (``kill_prefill``: its pid; decode
finds it silent, then gone), or nothing: sglang's waiting timeout (``waiting_timeout``, set as
``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` for the manager) or a corrupted page fails it; then each
step ``pop_transferred`` and ``resolve_deferred_releases`` (decode.py ~2835-2975, ~3046-3110),
asking sglang's question ``is_abort_release_safe`` beside them, until the pages are released and the
prefill's write window is over. When the request first polls Failed, how long after it was queued
and how much of prefill's write had landed.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from types import SimpleNamespace

import tests.sglang.conftest as shims  # noqa: F401  (the shims, before sglang)
from tests.sglang import pd_rank
from tests.sglang.prealloc_rank import make_req
from tests.transfer.helpers import wait_for

NEW_OWNER = 0x3C  # the bytes a new request writes into pages sglang released
ENV = ("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE",
       "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT")
WAITING_ENV = "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"


class LogLines(logging.Handler):
    """The messages logged at ``level`` or above, in order."""

    def __init__(self, level: int = logging.WARNING):
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def transfer_queue(manager, metadata, group, released: list):
    """sglang's ``DecodeTransferQueue``, made by its own ``__init__`` (which reads the deferral
    flag and deadline from sglang's variables), its releases recorded in ``released``. Only the
    transfer queue: the manager is made by ``_init_kv_manager`` alone, so dsa-bridge's hook on
    the prefill-allocation queue's ``__init__`` does not run and sglang's own deadline stays in
    force, as in a sglang whose queue never took the one bound (``bound_rank`` makes both queues,
    hook included)."""
    from sglang.srt.disaggregation.decode import DecodeTransferQueue
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(attn_tp_group=SimpleNamespace(cpu_group=group))
    scheduler = SimpleNamespace(
        enable_decode_hicache=False, spec_algorithm=None, kv_checksum_computer=None,
        metrics_reporter=SimpleNamespace(enable_metrics=False), disagg_decode_prealloc_queue=None,
        output_streamer=SimpleNamespace(stream_output=lambda reqs, logprob: None))
    queue = DecodeTransferQueue(req_to_metadata_buffer_idx_allocator=ReqToMetadataIdxAllocator(8),
                                metadata_buffers=metadata, scheduler=scheduler,
                                tree_cache=SimpleNamespace(unlock=lambda lock: None))
    assert queue.gloo_group is group and queue.enable_staging is False

    def release_request(decode_req) -> None:  # stands in for sglang's (radix tree) release
        released.append({"at": time.monotonic(), "fence": decode_req.kv_receiver.can_release()})

    queue._release_request = release_request
    return queue


def landed(pool, cfg: dict, expected) -> int:
    """How many (buffer, page) pairs of the request's destination hold prefill's bytes."""
    got, want = pd_rank.views(pool), pd_rank.views(expected)
    return sum(bool((got[k][d] == want[k][s]).all()) for k in got
               for d, s in zip(cfg["dst_pages"], cfg["src_pages"], strict=True))


def queued_request(cfg: dict, server_args, group, info_wait_s: float = 180,
                   bootstrap_wait_s: float = 30) -> SimpleNamespace:
    """The decode side up to the request in sglang's transfer queue: pool and aux at the sentinel,
    the pool prefill writes (``expected``), the manager (sglang's ``_init_kv_manager``), the queue
    (``transfer_queue``, its releases in ``released``), the receiver bootstrapped and its
    ``send_metadata`` sent, its ``DecodeRequest`` added to the queue."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.decode import DecodeRequest
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    pool, metadata = pd_rank.make_pool(cfg, bridge=True), pd_rank.metadata_buffers()
    for view in [*pd_rank.views(pool).values(), *pd_rank.aux_views(metadata)]:
        view.fill_(pd_rank.SENTINEL)
    expected = pd_rank.make_pool(cfg, bridge=False)
    pd_rank.fill_pool(expected, cfg["seed"])
    manager = pd_rank.decode_manager(
        pd_rank.scheduler_stand_in(cfg, server_args, pool, metadata))
    released: list[dict] = []
    queue = transfer_queue(manager, metadata, group, released)
    addr, room = f"127.0.0.1:{cfg['port']}", cfg["room"]
    receiver = get_kv_class(TransferBackend(cfg["engine"]), KVClassType.RECEIVER)(
        mgr=manager, bootstrap_addr=addr, bootstrap_room=room)
    wait_for(lambda: manager.try_ensure_parallel_info(addr), info_wait_s, "prefill parallel info")
    receiver.init(0)
    wait_for(lambda: receiver.poll() == KVPoll.WaitingForInput, bootstrap_wait_s, "decode bootstrap")
    prefix = cfg.get("prefix_tokens", 0)  # decode's radix cache: its pages are not asked for
    dst = cfg["dst_pages"][prefix // 64:]
    idx = queue.req_to_metadata_buffer_idx_allocator.alloc()
    receiver.send_metadata(dst, idx, [dst], decode_prefix_len=prefix)
    decode_req = DecodeRequest(req=make_req("r", cfg["port"], room), kv_receiver=receiver,
                               metadata_buffer_index=idx)
    queue.add(decode_req)
    return SimpleNamespace(cfg=cfg, pool=pool, expected=expected, manager=manager, queue=queue,
                           released=released, receiver=receiver, decode_req=decode_req, room=room,
                           dst=dst, held=0)


def step(side: SimpleNamespace) -> bool:
    """One step of sglang's transfer queue (``pop_transferred``, ``resolve_deferred_releases``),
    the most deferred releases it held counted in ``side.held``; True at the step sglang first
    released the request's pages."""
    side.queue.pop_transferred()
    side.held = max(side.held, side.queue.num_pending_deferred_releases())
    side.queue.resolve_deferred_releases()
    return bool(side.released) and "landed" not in side.released[0]


def sglangs_answers(manager, room: int) -> list[bool]:
    """Every answer sglang's own ``resolve_deferred_releases`` gets for ``room`` from
    ``is_abort_release_safe``, in order (the manager's method, recorded). Not a probe of the
    test's own: the fence may lift between a probe and sglang's question, so a probe's last
    answer is not the one sglang released on."""
    answers, ask = [], manager.is_abort_release_safe

    def recorded(bootstrap_room: int, required_acks: int) -> bool:
        answer = ask(bootstrap_room, required_acks)
        if bootstrap_room == room:
            answers.append(answer)
        return answer

    manager.is_abort_release_safe = recorded
    return answers


def give_to_new_owner(side: SimpleNamespace) -> None:
    """What had landed when sglang released the pages, then the pages' new owner writes them."""
    release = side.released[0]
    release["landed"] = landed(side.pool, side.cfg, side.expected)
    for view in pd_rank.views(side.pool).values():
        view[side.dst] = NEW_OWNER
    release["new_owner_at"] = time.monotonic()


def new_owner_intact(side: SimpleNamespace) -> bool:
    return all(bool((v[side.dst] == NEW_OWNER).all()) for v in pd_rank.views(side.pool).values())


def run(cfg: dict, server_args, group, warnings: LogLines) -> dict:
    from sglang.srt.disaggregation.base.conn import KVPoll

    for name, value in zip(ENV, cfg["env"], strict=True):
        os.environ[name] = value
    if "waiting_timeout" in cfg:
        os.environ[WAITING_ENV] = str(cfg["waiting_timeout"])
    else:
        os.environ.pop(WAITING_ENV, None)  # sglang's default
    warnings.messages.clear()
    side = queued_request(cfg, server_args, group)
    pool, expected, manager, released = side.pool, side.expected, side.manager, side.released
    receiver, decode_req, room, queue = side.receiver, side.decode_req, side.room, side.queue
    node = receiver._node
    result = {"startup_warnings": [m for m in warnings.messages if "is off" in m],
              "manager_checksums": manager.checksums, "node_checksums": node.checksums}

    if cfg.get("success"):  # a clean transfer: polled to the end, as the transfer queue polls it
        wait_for(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), 60, "decode end")
        result.update(poll=int(receiver.poll()),
                      checksums_verified=node.counters.snapshot().get("checksums_verified", 0))
        receiver.clear()
        result.update(in_node_at_end=room in node._receivers,
                      forced_releases=manager.deferred_release.forced_releases)
        manager.shutdown()
        return result
    queued_at = time.monotonic()
    if cfg["abort"] or cfg.get("kill_prefill"):
        wait_for(lambda: landed(pool, cfg, expected) > 0, 60, "the first half of prefill's write")
        result["landed_at_abort"] = landed(pool, cfg, expected)
    if cfg["abort"]:
        receiver.abort()  # the scheduler's abort of a transfer-queue request (scheduler.py ~5780)
        result["abort_notified"] = receiver.abort_notified
    elif cfg.get("kill_prefill"):
        os.kill(cfg["kill_prefill"], signal.SIGKILL)  # a lost prefill, its write in flight
    answers = sglangs_answers(manager, room)
    unreleased_after_release, in_node_after_release = None, None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if (decode_req.kv_receiver is not None and decode_req.kv_receiver.poll() == KVPoll.Failed
                and "failed_after_s" not in result):
            result.update(failed_after_s=time.monotonic() - queued_at,
                          landed_at_failure=landed(pool, cfg, expected))
        if step(side):
            unreleased_after_release = manager.deferred_release.unreleased_receivers
            in_node_after_release = room in node._receivers
            give_to_new_owner(side)
        if released and time.monotonic() > released[0]["new_owner_at"] + cfg["write_window_s"]:
            break
        time.sleep(0.01)
    manager.is_abort_release_safe(room + 1, 0)  # sglang's next call into the manager
    result.update(
        released=released, held=side.held, landed_at_end=landed(pool, cfg, expected),
        answers_false=answers.count(False), answers_true=answers.count(True),
        last_answer=answers[-1] if answers else None, new_owner_intact=new_owner_intact(side),
        notified=receiver.abort_notified, pairs=len(pd_rank.views(pool)) * len(cfg["dst_pages"]),
        forced_releases=manager.deferred_release.forced_releases,
        unreleased_after_release=unreleased_after_release, in_node_after_release=in_node_after_release,
        unreleased_at_end=manager.deferred_release.unreleased_receivers,
        in_node_at_end=room in node._receivers, pending=queue.num_pending_deferred_releases(),
        finished=decode_req.req.finished_reason.message if decode_req.req.finished_reason else None,
        status=getattr(decode_req.req.finished_reason, "status_code", None),
        checksums_verified=node.counters.snapshot().get("checksums_verified", 0),
        forced_warnings=[m for m in warnings.messages if "fence still held" in m])
    manager.shutdown()
    return result


def main() -> None:
    import torch.distributed as dist
    from sglang.srt.plugins import load_plugins

    configs = json.loads(sys.argv[2])
    load_plugins()
    warnings = LogLines()
    logging.getLogger("dsa_bridge.plugin.sglang").addHandler(warnings)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{configs[0]['dist_port']}",
                            world_size=1, rank=0)
    group = dist.new_group([0], backend="gloo")
    results = []
    for cfg in configs:
        with shims.published_context(
                disaggregation_mode="decode", disaggregation_transfer_backend=cfg["engine"],
                host="127.0.0.1", disaggregation_enable_kv_checksum=cfg.get("checksum", False)) as args:
            results.append(run(cfg, args, group, warnings))
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
