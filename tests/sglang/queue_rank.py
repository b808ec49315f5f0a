"""One sglang PD rank whose prefill side is driven through sglang's own prefill queues, for
``test_sglang_prefill_queues.py``, in its own process: ``python -m tests.sglang.queue_rank ROLE
CONFIGS_JSON`` runs each scenario in turn and prints one ``RESULT [json, ...]`` line.

``queue-prefill``: a real ``PrefillBootstrapQueue`` whose attributes are set as its ``__init__``
sets them (its constructor needs a model runner and a GPU), its manager from its own
``_init_kv_manager`` (the hooked ``get_kv_class``: dsa-bridge's); sglang's own ``Req``,
``ReqToTokenPool``, paged allocator, ``ReqToMetadataIdxAllocator``, ``MetadataBuffers`` and a
(disabled) ``RadixCache`` on the CPU; its scheduler a ``PrefillScheduler``: sglang's own
``SchedulerDisaggregationPrefillMixin`` carrying the attributes its methods read, its TP and CP
groups real one-rank gloo groups. Then, as the prefill event loop runs it: ``add``, then each
step ``pop_bootstrapped`` (the sender made in ``add``, polled over the gloo groups, ``init`` with
the request's metadata slot). A bootstrapped request gets the forward stand-in (``forward``: its
row and pages from sglang's allocators, as ``alloc_for_extend`` gives them, then the pool
written), sglang's own ``send_kv_chunk`` for a first chunk (as ``process_prefill_chunk`` calls it)
and, after the pieces of ``process_batch_result_disagg_prefill`` that concern the transfer (the
first token, ``checkpoint_disagg_prefill``, the inflight queue), for the last one (sglang's
``set_buf`` fills the aux slot, its ``_dsa_pages_payload`` the state indices); then sglang's own
``process_disagg_prefill_inflight_queue`` each step until the request leaves it. A request that
fails in the bootstrap queue goes through sglang's own ``handle_bootstrap_failure``; with
``prefill_abort_after_s`` the client aborts it there first, as the scheduler aborts a
bootstrap-queue request (scheduler.py ~5743: ``disagg_kv_sender.abort()``). With
``aligned`` the prompt is whole pages (a decode radix-cache hit may cover it all). With
``optimistic_attempts`` (sglang's ``--optimistic-prefill-attempts``) ``pop_bootstrapped`` lets
the request prefill while it still bootstraps: sglang's ``check_bootstrap`` holds the first chunk
back and its inflight queue parks the request until decode's pages arrive.

``queue-decode``: ``transfer``, ``full-hit`` and ``prefill-abort``: ``release_rank.queued_request``
(receiver, ``init``, ``send_metadata`` of the pages after ``prefix_tokens``; ``metadata_after_s``
late), polled to the end with
sglang's ``poll_and_all_reduce``, then the bytes compared with what prefill wrote (the aux slot:
the prefill's earlier bytes under sglang's ``set_buf`` of the same request); ``decode-abort``
(first: its queue sets up the process's gloo world): the request in sglang's own
``DecodePreallocQueue`` (``prealloc_rank``) until its handshake is done, then the client's abort
as the scheduler aborts a prealloc-queue request (``kv_receiver.abort()``, scheduler.py ~5765),
then the queue's steps until it removes the request; ``prefill-complete``
(``run_decode_deferred``, sglang's ``prefill_complete`` policy on both sides: the prefill's
forward comes ``forward_after_s`` late and calls ``mark_prefill_complete``): the request in
sglang's own prealloc queue, ready for its pages only once the prefill finished computing it.
"""

from __future__ import annotations

import contextlib
import time
from array import array
from pathlib import Path
from types import SimpleNamespace

import tests.sglang.conftest as shims  # noqa: F401  (the shims, before sglang)
from tests.sglang import pd_rank, prealloc_rank, release_rank
from tests.transfer.helpers import wait_for

PAGE = 64
HOST_COPY_S = 1.0  # how long the host copy of a chunk's page indices takes (``host_copy_stand_in``)
FIRST_TOKEN = 4242  # the token prefill's forward samples: sglang sends it in the aux slot
HELD_PAGES = 2  # pages another request holds: this request's pages come after them
HELD_SLOTS = 3  # metadata slots other requests hold: this request gets the next


def prompt(cfg: dict) -> array:
    """The request's input (sglang's token array): its last page partial, or with ``aligned``
    whole pages (what a decode radix-cache hit covers entirely)."""
    pages = len(cfg["src_pages"])
    return array("q", range(1, pages * PAGE + 1 if cfg.get("aligned") else (pages - 1) * PAGE + 11))


def prefill_req(cfg: dict):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(rid=f"queued-{cfg['room']}", origin_input_text="", origin_input_ids=prompt(cfg),
               sampling_params=SamplingParams(max_new_tokens=16), bootstrap_host="127.0.0.1",
               bootstrap_port=cfg["port"], bootstrap_room=cfg["room"])


def one_rank_groups(cfg: dict):
    """This rank's attention TP and CP groups: real one-rank gloo groups."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['dist_port']}",
                                world_size=1, rank=0)
    return dist.new_group([0], backend="gloo"), dist.new_group([0], backend="gloo")


def prefill_scheduler_class():
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

    class PrefillScheduler(SchedulerDisaggregationPrefillMixin):
        """sglang's own prefill scheduler methods over the attributes they read."""

    return PrefillScheduler


def bootstrap_queue(cfg: dict, server_args):
    """A real ``PrefillBootstrapQueue`` and its scheduler, with the attributes their
    ``__init__`` would set."""
    import torch
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue, max_bootstrap_input_len
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache

    pool, metadata = pd_rank.make_pool(cfg, bridge=False), pd_rank.metadata_buffers()
    stand_in = pd_rank.scheduler_stand_in(cfg, server_args, pool, metadata)
    allocator = PagedTokenToKVPoolAllocator(PAGE * cfg["pages"], PAGE, torch.float8_e4m3fn, "cpu",
                                            pool, need_sort=False)
    req_to_token_pool = ReqToTokenPool(4, 16 * PAGE, "cpu", False)
    tp_group, cp_group = one_rank_groups(cfg)
    streamed: list = []
    slots, capacity = ReqToMetadataIdxAllocator(8), PAGE * cfg["pages"]
    tree_cache = RadixCache(CacheInitParams(disable=True, req_to_token_pool=req_to_token_pool,
                                            token_to_kv_pool_allocator=allocator, page_size=PAGE))
    scheduler = prefill_scheduler_class()()
    scheduler.__dict__.update(
        vars(stand_in.scheduler), token_to_kv_pool_allocator=allocator, tree_cache=tree_cache,
        req_to_token_pool=req_to_token_pool, req_to_metadata_buffer_idx_allocator=slots,
        attn_tp_cpu_group=tp_group, attn_cp_cpu_group=cp_group, disagg_metadata_buffers=metadata,
        disagg_prefill_inflight_queue=[], disagg_prefill_pending_chunk_rids=set(), waiting_queue=[],
        processed_tokens_counter=0, kv_checksum_computer=None, enable_staging=False,
        scheduler_stage_metrics=None, metrics_reporter=SimpleNamespace(enable_metrics=False),
        output_streamer=SimpleNamespace(stream_output=lambda reqs, *args: streamed.extend(reqs)))
    queue = object.__new__(PrefillBootstrapQueue)
    queue.__dict__.update(
        token_to_kv_pool=pool, draft_token_to_kv_pool=None, is_mla_backend=stand_in.is_mla_backend,
        metadata_buffers=metadata, req_to_metadata_buffer_idx_allocator=slots, tp_rank=0,
        pp_rank=0, pp_size=1, gpu_id=0, bootstrap_port=cfg["port"], queue=[], scheduler=scheduler,
        scheduler_stage_metrics=None, max_total_num_tokens=capacity,
        max_input_len=max_bootstrap_input_len(capacity=capacity, page_size=PAGE, shard_size=1),
        transfer_backend=stand_in.transfer_backend, pp_poll_sync_work_list=[])
    queue.kv_manager = queue._init_kv_manager()
    queue.kv_checksum_signature = 0
    scheduler.disagg_prefill_bootstrap_queue = queue
    return queue, scheduler, streamed


@contextlib.contextmanager
def host_copy_stand_in(manager, sender, result: dict):
    """sglang's host page indices (``supports_host_tensor_indices``) on the CPU: the manager
    declares them as it does over a GPU pool; sglang's ``torch.cuda.Event`` after the copy is a
    stand-in that completes ``HOST_COPY_S`` after its ``record`` (the copy in flight), and
    ``pin_memory`` is dropped (no pinned allocator without a GPU). Recorded: what each of
    sglang's ``send`` calls gave (``sends``: the indices' type and device, whether an event came,
    the node's pages handed on when ``send`` returned), and how often sglang's blocking
    ``kv_to_page_indices`` ran (``blocking_copies``)."""
    import sglang.srt.disaggregation.prefill as sglang_prefill
    import torch

    class CopyEvent:
        def record(self, stream=None) -> None:
            self.done_at = time.monotonic() + HOST_COPY_S

        def query(self) -> bool:
            return time.monotonic() >= self.done_at

    saved = torch.cuda.Event, torch.cuda.current_stream, torch.empty, sglang_prefill.kv_to_page_indices
    empty, blocking, send = torch.empty, saved[3], sender.send
    result.update(sends=[], blocking_copies=0)

    def copied(*args, **kwargs):
        result["blocking_copies"] += 1
        return blocking(*args, **kwargs)

    def recorded(kv_indices, *args, indices_event=None, **kwargs):
        send(kv_indices, *args, indices_event=indices_event, **kwargs)
        result["sends"].append([type(kv_indices).__name__, str(getattr(kv_indices, "device", "")),
                                indices_event is not None, sender._sender.pages_sent])

    manager.host_tensor_indices = True
    torch.cuda.Event, torch.cuda.current_stream = CopyEvent, lambda device=None: None
    torch.empty = lambda *args, pin_memory=False, **kwargs: empty(*args, **kwargs)
    sglang_prefill.kv_to_page_indices, sender.send = copied, recorded
    try:
        yield
    finally:
        torch.cuda.Event, torch.cuda.current_stream, torch.empty = saved[:3]
        sglang_prefill.kv_to_page_indices = blocking


def forward(scheduler, req, cfg: dict) -> list[int]:
    """The forward stand-in: the request's row and pages from sglang's own allocators (what
    ``alloc_for_extend`` does for a batch, which needs a model's ``ScheduleBatch``), then the
    forward's writes into the pool. Returns the request's pages."""
    import torch
    from sglang.srt.mem_cache.allocation import alloc_req_slots

    tokens = len(req.origin_input_ids)
    alloc_req_slots(scheduler.req_to_token_pool, [req], scheduler.tree_cache)
    locs = scheduler.token_to_kv_pool_allocator.alloc(-(-tokens // PAGE) * PAGE)
    scheduler.req_to_token_pool.write((req.kv.req_pool_idx, slice(0, tokens)), locs[:tokens].to(torch.int32))
    req.kv.kv_allocated_len = req.kv.kv_committed_len = tokens
    pd_rank.fill_pool(scheduler.disagg_prefill_bootstrap_queue.token_to_kv_pool, cfg["seed"])
    return sorted(set((locs // PAGE).tolist()), key=(locs // PAGE).tolist().index)


def run_prefill(cfg: dict, server_args) -> dict:
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    server = get_kv_class(TransferBackend(cfg["engine"]), KVClassType.BOOTSTRAP_SERVER)(
        host="127.0.0.1", port=cfg["port"])
    queue, scheduler, streamed = bootstrap_queue(cfg, server_args)
    manager, allocator = queue.kv_manager, scheduler.token_to_kv_pool_allocator
    metadata_slots = scheduler.req_to_metadata_buffer_idx_allocator
    allocator.alloc(HELD_PAGES * PAGE)  # another request's pages
    for _ in range(HELD_SLOTS):
        metadata_slots.alloc()  # other requests' aux slots
    pd_rank.fill(pd_rank.aux_views(queue.metadata_buffers), seed=cfg["seed"] + 1)  # earlier bytes
    free_pages, free_slots = allocator.available_size(), metadata_slots.available_size()
    req = prefill_req(cfg)
    queue.add(req, num_kv_heads=1)
    result = {"manager": type(manager).__qualname__, "sender": type(req.disagg_kv_sender).__qualname__,
              "in_bootstrap_queue": len(queue.queue), "bootstrapping_steps": 0}
    popped, added = [], time.monotonic()
    abort_at = added + cfg.get("prefill_abort_after_s", cfg["bootstrap_wait_s"])
    while not popped and req in queue.queue and time.monotonic() < added + cfg["bootstrap_wait_s"]:
        if time.monotonic() > abort_at:  # the client's abort of a bootstrap-queue request
            req.disagg_kv_sender.abort()  # (scheduler.py ~5743; its cache-side release: nothing here)
            abort_at = float("inf")
        popped = queue.pop_bootstrapped()  # the event loop's step
        result["bootstrapping_steps"] += req in queue.queue
        time.sleep(0.005)
    result.update(left_bootstrap_queue=req not in queue.queue, popped=len(popped),
                  poll_after_bootstrap=int(req.disagg_kv_sender.poll()))
    if not popped:  # failed there (sglang's handle_bootstrap_failure), or still bootstrapping
        finished = req.finished_reason
        result.update(finished=finished.message if finished else None,
                      status=getattr(finished, "status_code", None), streamed=[r.rid for r in streamed],
                      slots_free=metadata_slots.available_size() == free_slots,
                      pages_free=allocator.available_size() == free_pages)
        time.sleep(cfg.get("linger_s", 0))
        manager.shutdown()
        server.close()
        return result
    result.update(metadata_slot=req.metadata_buffer_index, start_send_idx=req.start_send_idx)
    with (host_copy_stand_in(manager, req.disagg_kv_sender, result) if cfg.get("host_indices")
          else contextlib.nullcontext()):
        transfer(scheduler, req, cfg, result)
    counters = manager.node.counters.snapshot()
    finished = req.finished_reason
    result.update(
        inflight=len(scheduler.disagg_prefill_inflight_queue), poll=int(req.disagg_kv_sender.poll()),
        finished=type(finished).__name__ if finished else None, streamed=[r.rid for r in streamed],
        bytes=counters["bytes"], pages_released=allocator.available_size() == free_pages,
        slot_released=metadata_slots.available_size() == free_slots and req.metadata_buffer_index == -1,
        row_released=not req.kv.holds_kv, pending_chunks=sorted(scheduler.disagg_prefill_pending_chunk_rids),
        # what sglang's inflight queue observed of get_transfer_metric (its Prometheus series)
        observed_mb=getattr(req.time_stats, "transfer_total_mb", None),
        observed_gb_s=getattr(scheduler.metrics_reporter, "kv_transfer_speed_gb_s", None),
        observed_latency_ms=getattr(scheduler.metrics_reporter, "kv_transfer_latency_ms", None))
    manager.shutdown()
    server.close()
    return result


def transfer(scheduler, req, cfg: dict, result: dict) -> None:
    """The request after its bootstrap: the forward, sglang's ``send_kv_chunk`` for a first and
    the last chunk, then sglang's inflight queue until the request leaves it."""
    if cfg.get("added_file"):  # decode's request is in its queue before this prefill computes it
        wait_for(lambda: Path(cfg["added_file"]).exists(), 120, "decode's request")
    time.sleep(cfg.get("forward_after_s", 0))  # the prefill's queue and its computation take time
    pages = forward(scheduler, req, cfg)
    result["pages"] = pages
    req.extend_end = 2 * PAGE + 30  # a first chunk ending mid-page: its whole pages go first
    if scheduler.check_bootstrap(req):  # process_prefill_chunk (no overlap)
        scheduler.send_kv_chunk(req)
    result["start_send_idx_after_chunk"] = req.start_send_idx
    req.extend_end = len(req.origin_input_ids)  # the last chunk's forward
    req.output_ids.append(FIRST_TOKEN)  # process_batch_result_disagg_prefill, for the transfer:
    scheduler.checkpoint_disagg_prefill(req)
    scheduler.disagg_prefill_inflight_queue.append(req)
    if cfg.get("policy") == "prefill_complete":
        result["marked_at"] = time.time()  # before: decode may see the mark before the call returns
        req.disagg_kv_sender.mark_prefill_complete()  # decode may allocate now
    if not req.pending_bootstrap:
        scheduler.send_kv_chunk(req, last_chunk=True)
    done, parked_steps = [], 0  # parked: prefilled before decode's pages arrived
    deadline = time.monotonic() + 60
    while not done and time.monotonic() < deadline:
        parked_steps += req.pending_bootstrap
        done = scheduler.process_disagg_prefill_inflight_queue()  # the event loop's step
        time.sleep(0.005)
    result.update(parked_steps=parked_steps, init_pages=req.disagg_kv_sender._num_pages,
                  chunks_sent=len(req.disagg_kv_sender._sent), done=[r.rid for r in done])


def expected_aux(cfg: dict):
    """The aux slot prefill sent: its earlier bytes under sglang's own ``set_buf`` of the
    request (its first token, its room)."""
    expected = pd_rank.metadata_buffers()
    pd_rank.fill(pd_rank.aux_views(expected), seed=cfg["seed"] + 1)
    req = prefill_req(cfg)
    req.output_ids.append(FIRST_TOKEN)
    req.metadata_buffer_index = cfg["src_aux"]
    expected.set_buf(req)
    return expected


def run_decode_transfer(cfg: dict, server_args) -> dict:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import poll_and_all_reduce

    group, _ = one_rank_groups(cfg)
    time.sleep(cfg.get("metadata_after_s", 0))  # decode's request comes late
    side = release_rank.queued_request(cfg, server_args, group, bootstrap_wait_s=60)
    receiver, metadata = side.receiver, side.queue.metadata_buffers
    slot = side.decode_req.metadata_buffer_index

    def done() -> bool:
        (poll,) = poll_and_all_reduce([receiver], group)
        return poll in (KVPoll.Success, KVPoll.Failed)

    sent = time.monotonic()
    wait_for(done, 60, "the transfer queue's end")
    result = {"poll": int(receiver.poll()), "ended_after_s": time.monotonic() - sent,
              "receiver_pages": int(receiver._receiver.page_ids.size)}
    if receiver.poll() == KVPoll.Failed:
        result["reason"] = pd_rank.reason_of(receiver)
        side.manager.shutdown()
        return result
    result.update(pd_rank.compare({**cfg, "dst_aux": slot}, side.pool, metadata, receiver))
    want = pd_rank.aux_views(expected_aux(cfg))  # the aux slot: under sglang's set_buf, not as filled
    result["aux_exact"] = all(bool((g[slot] == w[cfg["src_aux"]]).all())
                              for g, w in zip(pd_rank.aux_views(metadata), want, strict=True))
    output_ids, *_, room = metadata.get_buf(slot)  # what sglang's decode commits: the first token
    result.update(first_token=int(output_ids[0]), room=int(room[0]))  # and the room it checks
    receiver.clear()
    side.manager.shutdown()
    return result


def run_decode_abort(cfg: dict, server_args) -> dict:
    """The client aborts the request while decode's prealloc queue holds it (module docstring)."""
    queue = prealloc_rank.prealloc_queue(cfg, server_args, pd_rank.make_pool(cfg, bridge=True),
                                         pd_rank.metadata_buffers())
    addr = f"127.0.0.1:{cfg['port']}"
    wait_for(lambda: queue.kv_manager.try_ensure_parallel_info(addr), 180, "prefill parallel info")
    queue.add(prealloc_rank.make_req("aborted", cfg["port"], cfg["room"]))
    (decode_req,) = queue.queue
    wait_for(lambda: prealloc_rank.step(queue) or decode_req.waiting_for_input, 60, "decode handshake")
    time.sleep(cfg["abort_after_s"])  # the prefill's request waits in its bootstrap queue meanwhile
    receiver = decode_req.kv_receiver
    receiver.abort()  # the scheduler's abort of a prealloc-queue request (scheduler.py ~5765)
    removed = []
    wait_for(lambda: removed.extend(prealloc_rank.step(queue)) or removed, 30, "the prealloc queue's abort")
    finished = decode_req.req.finished_reason
    result = {"finished": finished.message if finished else None, "notified": receiver.abort_notified,
              "removed": [d.req.rid for d in removed]}
    time.sleep(cfg["linger_s"])  # the abort reaches the prefill
    queue.kv_manager.shutdown()
    return result


def run_decode_deferred(cfg: dict, server_args) -> dict:
    """sglang's ``prefill_complete`` policy on decode: the request in sglang's own
    ``DecodePreallocQueue`` (``prealloc_rank``), its steps until the queue marks it
    ``waiting_for_input`` (only once the prefill finished computing it), then sglang's own
    ``_send_kv_metadata`` and its ``poll_and_all_reduce`` to the end, the bytes compared."""
    import torch
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import poll_and_all_reduce

    pool, metadata = pd_rank.make_pool(cfg, bridge=True), pd_rank.metadata_buffers()
    for view in [*pd_rank.views(pool).values(), *pd_rank.aux_views(metadata)]:
        view.fill_(pd_rank.SENTINEL)
    queue = prealloc_rank.prealloc_queue(cfg, server_args, pool, metadata)
    addr = f"127.0.0.1:{cfg['port']}"
    wait_for(lambda: queue.kv_manager.try_ensure_parallel_info(addr), 180, "prefill parallel info")
    queue.add(prealloc_rank.make_req("deferred", cfg["port"], cfg["room"]))
    (decode_req,) = queue.queue
    Path(cfg["added_file"]).touch()  # the prefill computes the request only now
    added, steps, polls, first_ready = time.monotonic(), 0, set(), 0.0
    while not decode_req.waiting_for_input and time.monotonic() < added + 60:
        if prealloc_rank.step(queue):
            break  # removed: failed
        steps += 1
        if decode_req.kv_receiver is not None:
            polls.add(int(decode_req.kv_receiver.poll()))
            first_ready = first_ready or (KVPoll.WaitingForInput in polls and time.time())
        time.sleep(0.005)
    result = {"waiting_steps": steps, "ready_after_s": time.monotonic() - added,
              "ready_at": first_ready or time.time(), "polls_before_ready": sorted(polls)}
    if not decode_req.waiting_for_input:
        finished = decode_req.req.finished_reason
        result["reason"] = finished.message if finished else "never ready"
        queue.kv_manager.shutdown()
        return result
    dst = cfg["dst_pages"]
    tokens = torch.tensor([p * PAGE + t for p in dst for t in range(PAGE)], dtype=torch.int64)
    queue._send_kv_metadata(decode_req, tokens, PAGE, state_indices=[dst])
    receiver = decode_req.kv_receiver

    def done() -> bool:
        (poll,) = poll_and_all_reduce([receiver], queue.gloo_group)
        return poll in (KVPoll.Success, KVPoll.Failed)

    wait_for(done, 60, "the transfer's end")
    result["poll"] = int(receiver.poll())
    if receiver.poll() == KVPoll.Failed:
        result["reason"] = pd_rank.reason_of(receiver)
    else:
        slot = decode_req.metadata_buffer_index
        result.update(pd_rank.compare({**cfg, "dst_aux": slot}, pool, metadata, receiver))
        want = pd_rank.aux_views(expected_aux(cfg))
        result["aux_exact"] = all(bool((g[slot] == w[cfg["src_aux"]]).all())
                                  for g, w in zip(pd_rank.aux_views(metadata), want, strict=True))
    receiver.clear()
    queue.kv_manager.shutdown()
    return result


def run(role: str, cfg: dict, server_args) -> dict:
    if role == "queue-prefill":
        return run_prefill(cfg, server_args)
    if cfg["scenario"] == "decode-abort":
        return run_decode_abort(cfg, server_args)
    if cfg["scenario"] == "prefill-complete":
        return run_decode_deferred(cfg, server_args)
    return run_decode_transfer(cfg, server_args)


def main() -> None:
    pd_rank.run_scenarios(run, lambda role, cfg: {
        "disaggregation_mode": "prefill" if role == "queue-prefill" else "decode",
        "optimistic_prefill_attempts": cfg.get("optimistic_attempts", 0) if role == "queue-prefill" else 0,
        "disaggregation_decode_allocation_policy": cfg.get("policy", "early")})


if __name__ == "__main__":
    main()
