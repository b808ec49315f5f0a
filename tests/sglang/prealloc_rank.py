"""One sglang decode rank driven through sglang's own ``DecodePreallocQueue`` code, for
``test_sglang_conn_bringup.py``, in its own process: ``python -m tests.sglang.prealloc_rank
prealloc CONFIG_JSON`` prints one ``RESULT {json}`` line.

The queue is a real ``DecodePreallocQueue`` whose attributes are set as its ``__init__`` sets them
(its constructor needs a model runner and a GPU): sglang's own pool, ``MetadataBuffers``, paged
allocator and ``ReqToMetadataIdxAllocator`` on the CPU, its gloo group a real (one-rank)
torch.distributed group, and its manager from its own ``_init_kv_manager`` (the hooked
``get_kv_class``: dsa-bridge's). Requests are sglang's own ``Req``. Then sglang's own methods, in
the order the scheduler calls them: ``add`` per request; per scheduling step the first part of
``pop_preallocated`` (``_resolve_pending_reqs``, which calls ``try_ensure_parallel_info`` —
decode.py ~1200 — and ``init``; ``_update_handshake_waiters``, which polls and aborts) and its
removal of aborted requests (re-stated here: the rest of ``pop_preallocated`` allocates through
the radix tree); for a request ready for its pages, ``_send_kv_metadata``; then the transfer
queue's ``poll_and_all_reduce`` to the end.

Scenario: three requests to a prefill dsa-bridge cannot pair with (registered with another
page size), then one more after sglang's one-second retry interval, then one to a good
prefill (``pd_rank.py prefill``, another process): the refused ones abort with the reason, the
refusal logged once, and the same queue and manager then move the good one byte-exact.
Scenario ``dp_query`` (``run_dp_query``): sglang's prefill DP-rank query, as its event loop
prefetches it.
"""

from __future__ import annotations

import json
import logging
import sys
import time

import tests.sglang.conftest as shims  # noqa: F401  (the shims, before sglang)
from tests.sglang import pd_rank
from tests.transfer.helpers import wait_for

PAGE = 64


class Refusals(logging.Handler):
    """The conn module's log records that refuse a prefill."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "cannot pair" in record.getMessage():
            self.messages.append(record.getMessage())


def register_refused_prefill(port: int) -> object:
    """A bootstrap server holding a dsa-bridge prefill of page size 32 (decode has 64)."""
    import requests
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    server = get_kv_class(TransferBackend.NIXL, KVClassType.BOOTSTRAP_SERVER)(host="127.0.0.1", port=port)
    for tp_rank in range(2):
        payload = {"attn_tp_size": 2, "attn_tp_rank": tp_rank, "attn_cp_size": 1, "attn_cp_rank": 0,
                   "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1,
                   "system_dp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": 1, "page_size": PAGE // 2,
                   "kv_cache_dtype": "fp8_e4m3", "kv_layout": "dsa-bridge",
                   "load_balance_method": "follow_bootstrap_room"}
        wait_for(lambda p=payload: _put(requests, port, p), 10, "bootstrap server")
    return server


def _registered(requests, addr: str) -> bool:
    """Whether the prefill at ``addr`` is fully registered (its server may not listen yet)."""
    try:
        return requests.get(f"http://{addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
                            "&target_tp_rank=-1&target_pp_rank=-1", timeout=5).status_code == 200
    except requests.ConnectionError:
        return False


def _put(requests, port: int, payload: dict) -> bool:
    try:
        return requests.put(f"http://127.0.0.1:{port}/route", json=payload, timeout=5).status_code == 200
    except requests.ConnectionError:
        return False


def prealloc_queue(cfg: dict, server_args, pool, metadata):
    """A real ``DecodePreallocQueue`` with the attributes its ``__init__`` would set."""
    import torch
    import torch.distributed as dist
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    if not dist.is_initialized():  # (a process's later scenarios reuse its world)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['dist_port']}", world_size=1,
                                rank=0)
    stand_in = pd_rank.scheduler_stand_in(cfg, server_args, pool, metadata)
    stand_in.scheduler.metrics_reporter = type("Metrics", (), {"enable_metrics": False})()
    queue = object.__new__(DecodePreallocQueue)
    queue.__dict__.update(vars(stand_in))
    queue.__dict__.update(
        token_to_kv_pool_allocator=PagedTokenToKVPoolAllocator(
            PAGE * cfg["pages"], PAGE, torch.float8_e4m3fn, "cpu", pool, need_sort=False),
        req_to_metadata_buffer_idx_allocator=ReqToMetadataIdxAllocator(8),
        transfer_queue=type("TransferQueue", (), {"enable_staging": False})(),
        gloo_group=dist.new_group([0], backend="gloo"), pp_size=1, pp_rank=0, tp_rank=0,
        max_total_num_tokens=PAGE * cfg["pages"], num_reserved_decode_tokens=0, queue=[],
        retracted_queue=[], pending_reqs=[], held_rebootstrap_reqs=[], _prefill_dp_rank_queries={},
        _ensure_retry_count={}, _max_ensure_retries=15, _ensure_last_attempt_time={},
        _ensure_retry_interval=1.0, _num_published_destinations=0)
    queue.kv_manager = queue._init_kv_manager()
    return queue


def make_req(rid: str, port: int, room: int):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(rid=rid, origin_input_text="", origin_input_ids=list(range(1, 5 * PAGE)),
               sampling_params=SamplingParams(max_new_tokens=4), bootstrap_host="127.0.0.1",
               bootstrap_port=port, bootstrap_room=room)


def step(queue) -> list:
    """One scheduling step of ``pop_preallocated`` up to its removal of aborted requests
    (decode.py ~1346-1409); returns the removed requests."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    queue._resolve_pending_reqs()
    queue._update_handshake_waiters()
    failed = [d for d in queue.queue if isinstance(d.req.finished_reason, FINISH_ABORT)]
    for decode_req in failed:
        decode_req.kv_receiver.clear()
        decode_req.kv_receiver = None
    queue.queue = [d for d in queue.queue if d not in failed]
    queue.pending_reqs = [d for d in queue.pending_reqs if d not in failed]
    return failed


def run(cfg: dict) -> dict:
    import requests
    import torch
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import poll_and_all_reduce

    refusals = Refusals()
    logging.getLogger("dsa_bridge.plugin.sglang").addHandler(refusals)
    result, refused_port = {}, cfg["refused_port"]
    server = register_refused_prefill(refused_port)
    with shims.published_context(disaggregation_mode="decode", disaggregation_transfer_backend=cfg["engine"],
                                 host="127.0.0.1") as server_args:
        pool, metadata = pd_rank.make_pool(cfg, bridge=True), pd_rank.metadata_buffers()
        for view in [*pd_rank.views(pool).values(), *pd_rank.aux_views(metadata)]:
            view.fill_(pd_rank.SENTINEL)
        queue = prealloc_queue(cfg, server_args, pool, metadata)
        manager = queue.kv_manager
        result["manager"] = type(manager).__qualname__

        # a prefill dsa-bridge cannot pair with: every request aborts with the reason
        for i in range(3):
            queue.add(make_req(f"refused-{i}", refused_port, 1000 + i))
        failed = []
        deadline = time.monotonic() + 30
        while len(failed) < 3 and time.monotonic() < deadline:
            failed += step(queue)
        time.sleep(1.1)  # past sglang's retry interval: the prefill's info is fetched again
        queue.add(make_req("refused-late", refused_port, 1003))
        while len(failed) < 4 and time.monotonic() < deadline:
            failed += step(queue)
        result["refused"] = [d.req.finished_reason.message for d in failed]
        result["refused_status"] = [d.req.finished_reason.status_code for d in failed]
        refused = f"127.0.0.1:{refused_port}"
        result["ensure_attempts"] = queue._ensure_retry_count.get(refused)  # sglang's own count
        result["ensure_refused"] = manager.try_ensure_parallel_info(refused)
        result["refusals_logged"] = list(refusals.messages)

        # a good prefill afterwards, through the same queue and manager
        good = f"127.0.0.1:{cfg['port']}"
        wait_for(lambda: _registered(requests, good), 240, "the good prefill's registration")
        queue.add(make_req("good", cfg["port"], cfg["room"]))
        (decode_req,) = [d for d in queue.queue if d.req.rid == "good"]
        wait_for(lambda: step(queue) or decode_req.waiting_for_input, 60, "the good prefill's handshake")
        assert decode_req.waiting_for_input, decode_req.req.finished_reason
        dst = cfg["dst_pages"]
        tokens = torch.tensor([p * PAGE + t for p in dst for t in range(PAGE)], dtype=torch.int64)
        queue._send_kv_metadata(decode_req, tokens, PAGE, state_indices=[dst])
        receiver = decode_req.kv_receiver

        def done():
            (poll,) = poll_and_all_reduce([receiver], queue.gloo_group)
            return poll in (KVPoll.Success, KVPoll.Failed)

        wait_for(done, 60, "the good request's transfer")
        result["poll"] = int(receiver.poll())
        result.update(pd_rank.compare({**cfg, "dst_aux": decode_req.metadata_buffer_index}, pool, metadata,
                                      receiver))
        receiver.clear()
        manager.shutdown()
    server.close()
    return result


def run_dp_query(cfg: dict) -> dict:
    """Scenario ``dp_query`` (``test_sglang_decode_http.py``): a prefill of two DP groups under
    round-robin load balancing (decode must ask for each request's DP rank), registered on a
    bootstrap server, its ranks not listening; room 500 registered on DP rank 1, room 501 never.
    Each step as sglang's decode event loop makes it: ``prefetch_prefill_dp_rank_queries``, then
    the first part of ``pop_preallocated``."""
    import requests
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    port, silent_port = cfg["port"], cfg["silent_port"]
    server = get_kv_class(TransferBackend.NIXL, KVClassType.BOOTSTRAP_SERVER)(host="127.0.0.1", port=port)
    for dp_rank in range(2):
        payload = {"attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
                   "attn_dp_size": 2, "attn_dp_rank": dp_rank, "pp_size": 1, "pp_rank": 0,
                   "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "127.0.0.1",
                   "rank_port": silent_port, "page_size": PAGE, "kv_cache_dtype": "fp8_e4m3",
                   "kv_layout": "dsa-bridge", "load_balance_method": "round_robin"}
        wait_for(lambda p=payload: _put(requests, port, p), 10, "bootstrap server")
    response = requests.post(f"http://127.0.0.1:{port}/register_dp_rank",
                             json={"bootstrap_room": 500, "dp_rank": 1}, timeout=5)
    assert response.status_code == 200, response.text
    result = {"prefetched": False}
    with shims.published_context(disaggregation_mode="decode", disaggregation_transfer_backend="nixl",
                                 host="127.0.0.1") as server_args:
        pool, metadata = pd_rank.make_pool(cfg, bridge=True), pd_rank.metadata_buffers()
        queue = prealloc_queue(cfg, server_args, pool, metadata)
        queue.add(make_req("queried", port, 500))
        queue.add(make_req("unregistered", port, 501))
        failed, deadline = [], time.monotonic() + 60
        while not failed and time.monotonic() < deadline:
            queue.prefetch_prefill_dp_rank_queries()  # the event loop's first call of a step
            result["prefetched"] |= bool(queue._prefill_dp_rank_queries)
            failed += step(queue)
            time.sleep(0.05)
        result["queried_reason"] = failed[0].req.finished_reason.message if failed else None
        result["pending"] = [d.req.rid for d in [*queue.pending_reqs, *queue.queue]]
        queue.kv_manager.shutdown()
    server.close()
    return result


def main() -> None:
    cfg = json.loads(sys.argv[2])
    from sglang.srt.plugins import load_plugins

    load_plugins()
    scenario = run_dp_query if cfg.get("scenario") == "dp_query" else run
    print("RESULT " + json.dumps(scenario(cfg)), flush=True)


if __name__ == "__main__":
    main()
