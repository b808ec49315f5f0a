"""One sglang PD rank through a memory-saver release and resume (``--enable-memory-saver``), for
``test_sglang_memory_saver.py``, in its own process: ``python -m tests.sglang.saver_rank ROLE
CONFIGS_JSON`` prints one ``RESULT [json, ...]`` line. Built on ``pd_rank.py``.

Prefill (``saver-prefill``) and decode (``saver-decode``), step by step together (a gloo group of
the two, ``dist_port``): a first request moved; then sglang's own ``release_memory_occupation``
of the prefill bootstrap queue and of the decode prealloc queue (each calls the manager's
``deregister_buffer_to_engine``), with a request left running on each side; the cache's memory
taken by something else meanwhile (overwritten); sglang's own ``resume_memory_occupation``
(``register_buffer_to_engine``); then a second request, byte-exact, with the new bytes.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import tests.sglang.conftest as shims  # noqa: F401  (the shims, before sglang)
from tests.sglang import pd_rank
from tests.transfer.helpers import wait_for

GARBAGE = 0x3D  # what the memory holds while released


def together(cfg: dict):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['dist_port']}",
                            world_size=2, rank=cfg["dist_rank"])
    return dist.barrier


def prefill_rank(cfg: dict, server_args) -> dict:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    barrier = together(cfg)
    backend = TransferBackend(cfg["engine"])
    server = get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER)(host="127.0.0.1", port=cfg["port"])
    pool, metadata = pd_rank.make_pool(cfg, bridge=False), pd_rank.metadata_buffers()
    manager = pd_rank.prefill_manager(
        pd_rank.scheduler_stand_in(cfg, server_args, pool, metadata))
    queue = object.__new__(PrefillBootstrapQueue)  # what its memory-saver methods read
    queue.__dict__.update(queue=[], kv_manager=manager)

    def request(room: int, seed: int, send: bool = True):
        sender = get_kv_class(backend, KVClassType.SENDER)(
            mgr=manager, bootstrap_addr=f"127.0.0.1:{cfg['port']}", bootstrap_room=room)
        wait_for(lambda: sender.poll() != KVPoll.Bootstrapping, 120, "bootstrap")
        src = cfg["src_pages"]
        sender.init(len(src), cfg["src_aux"])
        pd_rank.fill_pool(pool, seed)
        pd_rank.fill(pd_rank.aux_views(metadata), seed=seed + 1)
        if send:
            sender.send(src, [src])
            wait_for(lambda: sender.poll() in (KVPoll.Success, KVPoll.Failed), 60, "prefill end")
        return sender

    first = request(cfg["room"], cfg["seed"])
    barrier()  # 1: the first request done on both sides
    running = request(cfg["room"] + 1, cfg["seed"], send=False)  # left running at the release
    endpoint = manager.node.endpoint
    PrefillBootstrapQueue.release_memory_occupation(queue)
    result = {"first": int(first.poll()), "running": int(running.poll()),
              "running_reason": pd_rank.reason_of(running), "engine_closed": manager.node._runtime.closed}
    for view in pd_rank.views(pool).values():  # the memory taken by something else meanwhile
        view.fill_(GARBAGE)
    barrier()  # 2: both released
    PrefillBootstrapQueue.resume_memory_occupation(queue)
    result["same_endpoint"] = manager.node.endpoint == endpoint
    barrier()  # 3: both resumed
    second = request(cfg["room"] + 2, cfg["seed"] + 10)
    result["second"] = int(second.poll())
    barrier()  # 4: the second request done on both sides
    manager.shutdown()
    server.close()
    return result


def decode_rank(cfg: dict, server_args) -> dict:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.decode import DecodePreallocQueue
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    barrier = together(cfg)
    backend = TransferBackend(cfg["engine"])
    pool, metadata = pd_rank.make_pool(cfg, bridge=True), pd_rank.metadata_buffers()
    for view in [*pd_rank.views(pool).values(), *pd_rank.aux_views(metadata)]:
        view.fill_(pd_rank.SENTINEL)
    manager = pd_rank.decode_manager(
        pd_rank.scheduler_stand_in(cfg, server_args, pool, metadata))
    queue = object.__new__(DecodePreallocQueue)  # what its memory-saver methods read
    queue.__dict__.update(queue=[], retracted_queue=[], kv_manager=manager,
                          _prefill_dp_rank_queries={}, tree_cache=SimpleNamespace())
    addr = f"127.0.0.1:{cfg['port']}"
    wait_for(lambda: manager.try_ensure_parallel_info(addr), 180, "prefill parallel info")

    def request(room: int, send: bool = True):
        receiver = get_kv_class(backend, KVClassType.RECEIVER)(mgr=manager, bootstrap_addr=addr,
                                                               bootstrap_room=room)
        receiver.init(0)
        wait_for(lambda: receiver.poll() != KVPoll.Bootstrapping, 60, "decode bootstrap")
        receiver.send_metadata(cfg["dst_pages"], cfg["dst_aux"], [cfg["dst_pages"]])
        if send:
            wait_for(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), 60, "decode end")
        return receiver

    first = request(cfg["room"])
    result = {"first": int(first.poll()), "first_exact": pd_rank.compare(cfg, pool, metadata, first)}
    first.clear()
    barrier()  # 1
    running = request(cfg["room"] + 1, send=False)
    registered = manager.decode_nodes.engine.registered
    DecodePreallocQueue.release_memory_occupation(queue)
    result.update(registered_before=registered, registered_released=manager.decode_nodes.engine.registered,
                  nodes_released=len(manager.decode_nodes.nodes), running=int(running.poll()),
                  running_reason=pd_rank.reason_of(running))
    refused = get_kv_class(backend, KVClassType.RECEIVER)(mgr=manager, bootstrap_addr=addr,
                                                          bootstrap_room=cfg["room"] + 3)
    refused.init(0)  # a request while released fails, naming the release
    result.update(refused=int(refused.poll()), refused_reason=pd_rank.reason_of(refused))
    for view in [*pd_rank.views(pool).values(), *pd_rank.aux_views(metadata)]:
        view.fill_(pd_rank.SENTINEL)  # the memory taken by something else, then handed back
    barrier()  # 2
    DecodePreallocQueue.resume_memory_occupation(queue)
    result["registered_resumed"] = manager.decode_nodes.engine.registered
    barrier()  # 3
    time.sleep(0.2)
    second = request(cfg["room"] + 2)
    result.update(second=int(second.poll()), second_reason=pd_rank.reason_of(second),
                  second_exact=pd_rank.compare({**cfg, "seed": cfg["seed"] + 10}, pool, metadata,
                                               second))
    barrier()  # 4
    manager.shutdown()
    return result


ROLES = {"saver-prefill": prefill_rank, "saver-decode": decode_rank}


def main() -> None:
    pd_rank.run_scenarios(lambda role, cfg, args: ROLES[role](cfg, args), lambda role, cfg: {
        "disaggregation_mode": "decode" if role == "saver-decode" else "prefill",
        "enable_memory_saver": True})


if __name__ == "__main__":
    main()
