"""One sglang PD rank for ``test_sglang_rank_failure.py``, in its own process: ``python -m
tests.sglang.tp_rank ROLE CONFIGS_JSON`` runs each scenario in turn and prints one ``RESULT
[json, ...]`` line. Built on ``pd_rank.py`` (pools, ``MetadataBuffers``, sglang's own
``_init_kv_manager``) and ``release_rank.py`` (a real ``DecodeTransferQueue``).

Roles:

- ``tp-prefill``: one of two prefill TP ranks (``tp_size`` 2, this rank's ``tp_rank``; rank 0 runs
  the bootstrap server), its engine wrapped by ``tests/faulty.py`` (``fault``). The bootstrap queue
  (sender polled to WaitingForInput), ``init``, the forward, ``send`` in two chunks, each a write
  of its own (``late``: this rank's first once the other rank's first write is in flight;
  ``abort``: then sglang's abort of this rank's sender), then the
  inflight queue as sglang runs it: each step sglang's ``poll_and_all_reduce`` over the two ranks'
  gloo group; once the verdict is Failed, ``failure_exception()`` as
  ``handle_inflight_transfer_failure`` calls it (sglang's page release after it is a stand-in).
- ``tp-decode``: one of two decode TP ranks: sglang's own ``DecodeTransferQueue.pop_transferred``
  and ``resolve_deferred_releases`` over the two ranks' gloo group (polls MIN-all-reduced, holds
  and releases agreed), until the request's pages are released and given to a new owner, and
  the prefill's write window is over (the ranks end together: an all-reduced flag).
- ``early-prefill``: one prefill rank whose first chunk is an early send (sglang's
  ``maybe_send_cached_prefix_chunk``) while the forward writing its pages still runs: the
  sender gets ``_early_send_wait_event`` (a ``HeldEvent``, what ``torch.cuda.Event`` offers:
  ``query``), the pages hold a previous request's bytes until the forward's bytes replace them,
  then the event completes — or never, for the deadline case.

The decode rank's fence grace after a failed prefill write (``IN_FLIGHT_GRACE_S``, 35 s) is
shortened here to ``grace_s`` so that a test waits seconds, not half a minute.
"""

from __future__ import annotations

import threading
import time

import tests.sglang.conftest as shims  # noqa: F401  (the shims, before sglang)
from tests.sglang import pd_rank, release_rank
from tests.transfer.helpers import wait_for


class HeldEvent:
    """sglang's early-send event as the sender sees it (``torch.cuda.Event``): ``query()`` is True
    once the forward completed; ``synchronize()`` waits for it."""

    def __init__(self):
        self._done = threading.Event()
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()

    def record_done(self) -> None:
        self._done.set()


def as_tp_rank(cfg: dict) -> None:
    """This process is TP rank ``cfg["tp_rank"]`` of two (the published context gives rank 0)."""
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(tp_rank=cfg["tp_rank"], attn_tp_rank=cfg["tp_rank"])


def gloo_world(cfg: dict):
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['dist_port']}",
                                world_size=2, rank=cfg["tp_rank"])
    return dist.group.WORLD


def start_prefill_rank(cfg: dict, server_args, pool=None, draft=None):
    """A prefill rank's bootstrap server (TP rank 0's only), pool (sglang's ``DSATokenToKVPool``
    unless given; ``draft``: a draft model's beside it), metadata buffers and manager (sglang's
    ``_init_kv_manager``; its engine faulty by ``fault``)."""
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    server = (get_kv_class(TransferBackend(cfg["engine"]), KVClassType.BOOTSTRAP_SERVER)(
        host="127.0.0.1", port=cfg["port"]) if cfg.get("tp_rank", 0) == 0 else None)
    pool = pool if pool is not None else pd_rank.make_pool(cfg, bridge=False)
    metadata = pd_rank.metadata_buffers()
    with pd_rank.faulty_engine(cfg.get("fault")):
        manager = pd_rank.prefill_manager(
            pd_rank.scheduler_stand_in(cfg, server_args, pool, metadata, draft))
    return server, pool, metadata, manager


def initialised_sender(cfg: dict, manager):
    """The request's sender through sglang's bootstrap queue (to WaitingForInput), then ``init``."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    sender = get_kv_class(TransferBackend(cfg["engine"]), KVClassType.SENDER)(
        mgr=manager, bootstrap_addr=f"127.0.0.1:{cfg['port']}", bootstrap_room=cfg["room"])
    wait_for(lambda: sender.poll() != KVPoll.Bootstrapping, 240, "bootstrap")
    assert sender.poll() == KVPoll.WaitingForInput, sender.failure_exception()
    sender.init(len(cfg["src_pages"]), cfg["src_aux"])
    return sender


def prefill_rank(cfg: dict, server_args) -> dict:
    import torch.distributed as dist
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import poll_and_all_reduce

    as_tp_rank(cfg)
    group = gloo_world(cfg)
    server, pool, metadata, manager = start_prefill_rank(cfg, server_args)
    sender = initialised_sender(cfg, manager)
    src = cfg["src_pages"]
    pd_rank.fill_pool(pool, cfg["seed"])
    pd_rank.fill(pd_rank.aux_views(metadata), seed=cfg["seed"] + 1)
    half = len(src) // 2
    if cfg.get("late"):  # this rank sends once the other rank's first write is in flight
        dist.barrier(group)
    sender.send(src[:half], None)
    # the second chunk a write of its own: sent once the first one's write began
    wait_for(lambda: manager.node.backend.writes >= 1 or sender.poll() == KVPoll.Failed, 30,
             "the first chunk's write")
    if not cfg.get("late"):
        dist.barrier(group)
    sender.send(src[half:], [src])
    if cfg.get("abort"):  # this rank's own failure: sglang aborts its sender (an AbortReq)
        time.sleep(0.2)
        sender.abort()
    result = {}
    deadline = time.monotonic() + 60
    while True:  # the inflight queue: every rank takes the MIN of the ranks' polls
        own = int(sender.poll())
        (verdict,) = poll_and_all_reduce([sender], group)
        if verdict in (KVPoll.Success, KVPoll.Failed) or time.monotonic() > deadline:
            break
        time.sleep(0.005)
    result.update(verdict=int(verdict), own_at_verdict=own)
    if verdict == KVPoll.Failed:  # sglang's handle_inflight_transfer_failure
        try:
            sender.failure_exception()
        except Exception as exc:
            result.update(exception=str(exc),
                          from_another_rank=getattr(exc, "is_from_another_rank", False))
        result["own_after_failure_exception"] = int(sender.poll())
    node_sender = sender._sender
    wait_for(lambda: node_sender.can_release(), 60, "the rank's writes to end")  # then reported
    time.sleep(cfg["linger_s"])  # the report reaches decode; decode's abort, if any, is answered
    counters = manager.node.counters.snapshot()
    result.update(bytes=counters["bytes"], writes=manager.node.backend.writes,
                  reason=node_sender.state.reason)
    manager.shutdown()
    pd_rank.close(server)
    return result


def decode_rank(cfg: dict, server_args) -> dict:
    import torch
    import torch.distributed as dist

    from dsa_bridge.plugin.sglang import decode_nodes

    decode_nodes.IN_FLIGHT_GRACE_S = cfg["grace_s"]
    as_tp_rank(cfg)
    group = gloo_world(cfg)
    side = release_rank.queued_request(cfg, server_args, group, info_wait_s=240, bootstrap_wait_s=60)
    pool, expected, manager, released = side.pool, side.expected, side.manager, side.released
    decode_req, room = side.decode_req, side.room
    answers, deadline = release_rank.sglangs_answers(manager, room), time.monotonic() + 90
    while True:
        if release_rank.step(side):
            release_rank.give_to_new_owner(side)
        over = bool(released) and time.monotonic() > released[0]["new_owner_at"] + cfg["write_window_s"]
        flag = torch.tensor([int(over or time.monotonic() > deadline)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)  # both ranks end together
        if flag.item():
            break
        time.sleep(0.01)
    finished = decode_req.req.finished_reason
    result = {
        "released": released, "held": side.held, "answers_false": answers.count(False),
        "last_answer": answers[-1] if answers else None,
        "landed_at_end": release_rank.landed(pool, cfg, expected),
        "new_owner_intact": release_rank.new_owner_intact(side),
        "finished": finished.message if finished else None,
        "forced_releases": manager.deferred_release.forced_releases,
        "unreleased_at_end": manager.deferred_release.unreleased_receivers,
        "total": len(side.dst) * len(pd_rank.views(pool))}
    manager.shutdown()
    return result


def early_prefill(cfg: dict, server_args) -> dict:
    """The early send racing the forward (module docstring)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    server, pool, metadata, manager = start_prefill_rank(cfg, server_args)
    if cfg.get("wait_s"):
        manager.early_sends.wait_s = cfg["wait_s"]
    sender = initialised_sender(cfg, manager)
    src = cfg["src_pages"]
    pd_rank.fill_pool(pool, cfg["seed"] + 100)  # the pages still hold a previous request's bytes
    pd_rank.fill(pd_rank.aux_views(metadata), seed=cfg["seed"] + 1)
    event, half = HeldEvent(), len(src) // 2
    started = time.monotonic()
    sender._early_send_wait_event = event  # sglang's maybe_send_cached_prefix_chunk, overlap on
    sender.send(src[:half], None)
    sender.send(src[half:], [src])  # the regular send follows while the forward still runs
    result = {"send_seconds": time.monotonic() - started}
    time.sleep(cfg["forward_s"])  # the forward still writing the early-sent pages
    result.update(bytes_before_forward_done=manager.node.counters.snapshot()["bytes"],
                  poll_before_forward_done=int(sender.poll()))
    if not cfg.get("never"):
        pd_rank.fill_pool(pool, cfg["seed"])  # the forward's bytes...
        event.record_done()  # ...then its event completes
    wait_for(lambda: sender.poll() in (KVPoll.Success, KVPoll.Failed), 60, "prefill end")
    result.update(poll=int(sender.poll()), bytes=manager.node.counters.snapshot()["bytes"],
                  queries=event.queries, reason=sender._sender.state.reason)
    wait_for(lambda: sender._sender.can_release(), 30, "the request's writes to end")
    time.sleep(0.5)  # the report reaches decode
    manager.shutdown()
    pd_rank.close(server)
    return result


ROLES = {"tp-prefill": prefill_rank, "tp-decode": decode_rank, "early-prefill": early_prefill}


def main() -> None:
    pd_rank.run_scenarios(lambda role, cfg, args: ROLES[role](cfg, args), lambda role, cfg: {
        "disaggregation_mode": "decode" if role == "tp-decode" else "prefill",
        "tp_size": cfg.get("tp_size", 1)})


if __name__ == "__main__":
    main()
