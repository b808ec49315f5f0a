"""One sglang PD rank for ``test_sglang_conn.py``, in its own process: ``python -m
tests.sglang.pd_rank ROLE CONFIGS_JSON`` runs each scenario of the list in turn (each with its
own bootstrap port, pools and manager, closed before the next) and prints one ``RESULT [json,
...]`` line.

As a scheduler process would: the shims, sglang's own ``load_plugins()`` (``SGLANG_PLUGINS``
from the environment), a published ``ServerArgs``, sglang's own pool (and, with
``draft_layers``, a draft model's) and ``MetadataBuffers`` on the CPU, and sglang's own
``_init_kv_manager`` of ``PrefillBootstrapQueue`` / ``DecodePreallocQueue`` (the KVArgs fill,
``setup_state_kv_args``, then the manager class from the hooked ``get_kv_class``) over a
stand-in for the scheduler attributes it reads. Then the
calls its queues make, in their order: prefill — bootstrap server, sender, poll to
WaitingForInput (bootstrap queue; with pipeline stages, sglang's own
``poll_and_all_reduce_prefill_pp`` over real torch.distributed (gloo) groups and sglang's
``GroupCoordinator``, stage 0 polling ``poll_pp_consensus``), ``init(num_pages, aux_index)``,
the forward (the pool filled), ``send`` per chunk with the DSA state indices on the last, poll
to the end (inflight queue), ``clear()``; decode — receiver, ``try_ensure_parallel_info``,
``init(prefill_dp_rank)``, poll to WaitingForInput, ``send_metadata(pages, aux_index,
state_indices)`` (prealloc queue), poll to the end (transfer queue), then the bytes compared with
what prefill wrote.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import signal
import sys
import time
from types import SimpleNamespace

import tests.sglang.conftest as shims  # noqa: F401  (the shims, before sglang)
from tests.transfer.helpers import wait_for

SENTINEL = 0xA5


def reason_of(handle) -> str:
    """Why a failed sender or receiver failed, as sglang's queue logs it ("" if not failed)."""
    try:
        handle.failure_exception()
    except Exception as exc:  # what sglang's queue would log and abort the request with
        return str(exc)
    return ""


def pool_kwargs(cfg: dict) -> dict:
    import torch

    return dict(size=64 * cfg["pages"], page_size=64, kv_lora_rank=512, dtype=torch.float8_e4m3fn,
                qk_rope_head_dim=64, layer_num=cfg["layers"], device="cpu", index_head_dim=128,
                enable_memory_saver=False, kv_cache_dim=cfg["kv_cache_dim"],
                start_layer=cfg.get("start_layer", 0), skip_topk_layers=cfg.get("skip"))


def make_pool(cfg: dict, bridge: bool):
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    from dsa_bridge.plugin.sglang.pool import BridgeDSATokenToKVPool

    return (BridgeDSATokenToKVPool if bridge else DSATokenToKVPool)(**pool_kwargs(cfg))


def make_draft_pool(cfg: dict):
    """The draft model's (MTP) pool of ``draft_layers`` layers, sglang's own DSA pool as its
    draft worker builds one beside the target's; None without ``draft_layers``."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    if not cfg.get("draft_layers"):
        return None
    return DSATokenToKVPool(**{**pool_kwargs(cfg), "layer_num": cfg["draft_layers"],
                               "start_layer": 0, "skip_topk_layers": None})


def views(pool, first_layer: int | None = None) -> dict[str, object]:
    """Every non-empty buffer as uint8 pages: ``kv:L`` and ``index:L`` by global layer id (the
    pool's from ``first_layer``, by default its ``start_layer``)."""
    import torch

    first = pool.start_layer if first_layer is None else first_layer
    out = {}
    for i, buf in enumerate(pool.kv_buffer):
        out[f"kv:{first + i}"] = buf.view(torch.uint8).reshape(-1, 64 * buf.shape[-1])
    for i, buf in enumerate(pool.index_k_with_scale_buffer):
        if buf.numel():
            out[f"index:{first + i}"] = buf.view(torch.uint8)
    return out


def draft_views(draft, cfg: dict) -> dict[str, object]:
    """The draft pool's buffers by the ids sglang's KVArgs give them: after the model's layers."""
    return {} if draft is None else views(draft, cfg["model_layers"])


def aux_views(metadata) -> list:
    import torch

    ptrs = metadata.get_buf_infos()[0]
    bufs = [b for b in vars(metadata).values() if isinstance(b, torch.Tensor)]
    by_ptr = {b.data_ptr(): b for b in bufs}
    return [by_ptr[p].view(torch.uint8).reshape(by_ptr[p].shape[0], -1) for p in ptrs]


def fill(tensors, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    for t in tensors:
        t.copy_(torch.randint(0, 256, t.shape, generator=g, dtype=torch.uint8))


def fill_pool(pool, seed: int, extra_views: dict | None = None) -> None:
    """Each buffer's bytes a function of (seed, layer id, kind) only, so a pipeline stage's pool
    and a whole-model pool hold the same bytes for the same layer (and ``extra_views``: a draft
    pool's)."""
    for key, view in {**views(pool), **(extra_views or {})}.items():
        kind, layer = key.split(":")
        fill([view], seed * 1000 + int(layer) * 2 + (kind == "index"))


def metadata_buffers():
    import torch
    from sglang.srt.disaggregation.utils import MetadataBuffers

    return MetadataBuffers(size=8, hidden_size=64, hidden_states_dtype=torch.bfloat16,
                           max_sampling_mask_tokens=16)


def scheduler_stand_in(cfg: dict, server_args, pool, metadata, draft=None):
    """The scheduler attributes sglang's ``_init_kv_manager`` reads, around sglang's own objects."""
    from sglang.srt.disaggregation.utils import TransferBackend, is_mla_backend

    scheduler = SimpleNamespace(
        rust_server=None, server_args=server_args, req_to_token_pool=None, enable_hisparse=False,
        tp_worker=SimpleNamespace(model_runner=SimpleNamespace(kv_cache_dtype_str="fp8_e4m3")),
        model_config=SimpleNamespace(num_hidden_layers=cfg["model_layers"], hf_text_config=None))
    return SimpleNamespace(
        transfer_backend=TransferBackend(cfg["engine"]), tp_rank=0, pp_rank=0, scheduler=scheduler,
        token_to_kv_pool=pool, draft_token_to_kv_pool=draft, is_mla_backend=is_mla_backend(pool),
        metadata_buffers=metadata, enable_staging=False)


# sglang's ``GroupCoordinator`` over gloo alone: none of its device communicators
GLOO_GROUP = dict(use_pynccl=False, use_mscclpp=False, use_custom_allreduce=False,
                  use_torch_symm_mem_all_reduce=False, use_hpu_communicator=False,
                  use_xpu_communicator=False)


def stage_groups(cfg: dict):
    """sglang's ``GroupCoordinator`` for the pipeline stages (one process each, gloo over
    ``dist_port``) and size-1 attention TP and CP groups, published as sglang's scheduler
    publishes its pipeline group; returns (pp, attn_tp, attn_cp)."""
    import torch.distributed as dist
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    from sglang.srt.runtime_context import get_parallel

    rank, size = cfg["pp_rank"], cfg["pp_size"]
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['dist_port']}",
                                world_size=size, rank=rank)
    pp = GroupCoordinator([list(range(size))], rank, "gloo", group_name="pp", **GLOO_GROUP)
    tp, cp = (GroupCoordinator([[r] for r in range(size)], rank, "gloo", group_name=n, **GLOO_GROUP)
              for n in ("attn_tp", "attn_cp"))
    get_parallel().override_permanently(pp_group=pp)
    return pp, tp, cp


def stage_bootstrap(cfg: dict, make_sender, groups, incoming) -> tuple[object, dict]:
    """sglang's prefill bootstrap queue with pipeline stages (``pop_bootstrapped``, prefill.py
    ~506): each step ``poll_and_all_reduce_prefill_pp`` over the queue's senders — stage 0 polls
    ``poll_pp_consensus`` and passes its verdict down the stages — until the verdict leaves
    Bootstrapping. A later stage makes its sender ``late_sender_s`` after decode's pages reached
    its node (``incoming``), as a request reaches it after stage 0. Returns the sender and what
    the stage saw."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import poll_and_all_reduce_prefill_pp

    pp, tp, cp = groups
    rank, work, arrived = pp.rank_in_group, [], None
    sender = make_sender() if rank == 0 else None
    held = 0  # stage 0's steps whose own status was ready while another stage's was not
    while True:
        if arrived is None and not incoming.empty():
            arrived = time.monotonic()
        if sender is None and arrived is not None and time.monotonic() - arrived >= cfg["late_sender_s"]:
            sender = make_sender()
        (verdict,) = poll_and_all_reduce_prefill_pp([sender], cp.cpu_group, tp.cpu_group, pp, rank,
                                                    pp.world_size, work)
        if rank == 0 and verdict == KVPoll.Bootstrapping and sender.poll() == KVPoll.WaitingForInput:
            held += 1
        if verdict != KVPoll.Bootstrapping:
            break
        time.sleep(0.005)
    for p2p in work:
        p2p.work.wait()
    while sender is None:  # the verdict came before this stage's request did
        sender = make_sender()
    return sender, {"verdict": int(verdict), "held": held, "own_at_verdict": int(sender.poll())}


def run_prefill(cfg: dict, server_args, groups=None) -> dict:
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    server = (get_kv_class(TransferBackend(cfg["engine"]), KVClassType.BOOTSTRAP_SERVER)(
        host="127.0.0.1", port=cfg["port"])
              if cfg.get("pp_rank", 0) == 0 else None)  # one server per prefill (sglang's main process)
    pool, metadata = make_pool(cfg, bridge=cfg.get("bridge_pool", False)), metadata_buffers()
    draft = make_draft_pool(cfg)
    stand_in = scheduler_stand_in(cfg, server_args, pool, metadata, draft)
    stand_in.pp_rank = cfg.get("pp_rank", 0)
    with faulty_engine(cfg.get("fault")):
        manager = prefill_manager(stand_in)
    try:
        return {"server": type(server).__qualname__,
                **prefill_request(cfg, manager, pool, metadata, groups, draft=draft)}
    finally:
        manager.shutdown()
        close(server)


def prefill_manager(stand_in):
    """The prefill rank's manager, from sglang's own ``PrefillBootstrapQueue._init_kv_manager``."""
    from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue

    return PrefillBootstrapQueue._init_kv_manager(stand_in)


def prefill_request(cfg: dict, manager, pool, metadata, groups=None, draft=None) -> dict:
    """One request through ``manager``, as sglang's prefill queues make their calls (module
    docstring); what prefill saw. ``draft``: the draft model's pool, filled by the forward too."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    result = {"manager": type(manager).__qualname__, "layers": manager.bridge.kv_layer_ids,
              "state_layer_ids": manager.kv_args.state_layer_ids,
              "kv_layer_ids": manager.kv_args.kv_layer_ids}
    print("READY", flush=True)

    def make_sender():
        return get_kv_class(TransferBackend(cfg["engine"]), KVClassType.SENDER)(
            mgr=manager, bootstrap_addr=f"127.0.0.1:{cfg['port']}", bootstrap_room=cfg["room"])

    if groups is not None:
        sender, result["stages"] = stage_bootstrap(cfg, make_sender, groups, manager.node.incoming)
    else:
        sender = make_sender()
        try:  # the bootstrap queue; a refused handshake ends the wait (the request would time out)
            wait_for(lambda: sender.poll() != KVPoll.Bootstrapping or manager.node.refusals,
                     cfg["bootstrap_wait_s"], "bootstrap", error=TimeoutError)
        except TimeoutError:
            pass
    result["sender"] = type(sender).__qualname__
    if sender.poll() == KVPoll.Failed:  # decode gave the request up before it sent its pages
        result["reason"] = reason_of(sender)
    if sender.poll() in (KVPoll.Bootstrapping, KVPoll.Failed):
        result.update(poll=int(sender.poll()), refused=list(manager.node.refusals))
        return result
    assert sender.poll() == KVPoll.WaitingForInput, sender.poll()
    prefix = sender.pop_decode_prefix_len()  # sglang's finalize_bootstrap: start_send_idx
    result["decode_prefix_len"] = prefix
    src = cfg["src_pages"][prefix // 64:]  # the pages after decode's radix-cache prefix
    sender.init(len(src), cfg["src_aux"])
    fill_pool(pool, cfg["seed"], draft_views(draft, cfg))  # the forward pass writes the cache...
    fill(aux_views(metadata), seed=cfg["seed"] + 1)  # ...and the first token's metadata
    half = len(src) // 2
    sender.send(src[:half], None)
    sender.send(src[half:], [src])  # sglang's DSA state indices: the request's pages, last chunk
    wait_for(lambda: sender.poll() in (KVPoll.Success, KVPoll.Failed), 60, "prefill end")
    counters = manager.node.counters.snapshot()
    result.update(poll=int(sender.poll()), bytes=counters["bytes"],
                  checksums_computed=counters.get("checksums_computed", 0),
                  node_checksums=manager.node.checksums)
    if sender.poll() == KVPoll.Success:
        sender.clear()  # sglang's inflight queue, on Success
    if cfg.get("killed_after"):  # served: now it waits, connected, until the test kills it
        print("SERVED", flush=True)
        time.sleep(600)
    return result


@contextlib.contextmanager
def faulty_engine(fault: dict | None):
    """The manager's engine wrapped in ``tests/faulty.py``'s fault injection (``fault``: its
    environment variables), while the manager is made (prefill's in ``manager``, decode's in
    ``decode_nodes``)."""
    if not fault:
        yield
        return
    from dsa_bridge.plugin.sglang import decode_nodes
    from dsa_bridge.plugin.sglang import manager as bridge_manager
    from tests.faulty import wrap_from_env

    real = bridge_manager.create_backend
    assert decode_nodes.create_backend is real
    for module in (bridge_manager, decode_nodes):
        module.create_backend = lambda *args, **kwargs: wrap_from_env(real(*args, **kwargs),
                                                                      environ=fault)
    try:
        yield
    finally:
        for module in (bridge_manager, decode_nodes):
            module.create_backend = real


def close(server) -> None:
    if server is not None:
        server.close()


def run_decode(cfg: dict, server_args) -> dict:
    pool, metadata = make_pool(cfg, bridge=cfg.get("bridge_pool", True)), metadata_buffers()
    draft = make_draft_pool(cfg)
    stand_in = scheduler_stand_in(cfg, server_args, pool, metadata, draft)
    stand_in.pp_rank = cfg.get("pp_rank", 0)
    manager = decode_manager(stand_in)
    try:
        return decode_request(cfg, manager, pool, metadata, draft)
    finally:
        manager.shutdown()


def decode_manager(stand_in):
    """The decode rank's manager, from sglang's own ``DecodePreallocQueue._init_kv_manager``."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    return DecodePreallocQueue._init_kv_manager(stand_in)


def decode_request(cfg: dict, manager, pool, metadata, draft=None) -> dict:
    """One request through ``manager`` into a pool (and ``draft``, the draft model's) at the
    sentinel, as sglang's decode queues make their calls (module docstring); what decode saw and
    holds."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    for view in [*views(pool).values(), *draft_views(draft, cfg).values(), *aux_views(metadata)]:
        view.fill_(SENTINEL)
    addr = f"127.0.0.1:{cfg['port']}"
    receiver = get_kv_class(TransferBackend(cfg["engine"]), KVClassType.RECEIVER)(
        mgr=manager, bootstrap_addr=addr, bootstrap_room=cfg["room"])
    result = {"manager": type(manager).__qualname__, "receiver": type(receiver).__qualname__,
              "layers": manager.bridge.kv_layer_ids}
    wait_for(lambda: manager.try_ensure_parallel_info(addr), 180, "prefill parallel info")  # a loaded host
    info = manager.prefill_info_table[addr]
    receiver.init(0 if info.dp_size == 1 else cfg["room"] % info.dp_size)
    wait_for(lambda: receiver.poll() != KVPoll.Bootstrapping, 30, "decode bootstrap")
    if receiver.poll() == KVPoll.Failed:
        result["reason"] = reason_of(receiver)
        result.update(poll=int(receiver.poll()),
                      untouched=all(bool((v == SENTINEL).all()) for v in views(pool).values()))
        return result
    prefix = cfg.get("prefix_tokens", 0)  # decode's radix cache holds the first pages
    dst = cfg["dst_pages"][-(-prefix // 64):]
    receiver.send_metadata(dst, cfg["dst_aux"], [dst], decode_prefix_len=prefix)
    wait_for(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), 60, "decode end")
    result["poll"] = int(receiver.poll())
    if receiver.poll() == KVPoll.Failed:
        result["reason"] = reason_of(receiver)
    result.update(compare(cfg, pool, metadata, receiver, draft))
    receiver.clear()
    return result


def compare(cfg: dict, pool, metadata, receiver, draft=None) -> dict:
    """Decode's pool (and draft pool) and aux buffers against what prefill wrote (the same
    seeds), and the request's byte count."""
    result = {}
    skip = cfg.get("prefix_tokens", 0) // 64  # decode's radix-cache prefix: not sent, untouched
    dst, src = cfg["dst_pages"][skip:], cfg["src_pages"][skip:]
    expected_pool, expected_meta = make_pool(cfg, bridge=False), metadata_buffers()
    expected_draft = make_draft_pool(cfg)
    fill_pool(expected_pool, cfg["seed"], draft_views(expected_draft, cfg))
    fill(aux_views(expected_meta), seed=cfg["seed"] + 1)
    got = {**views(pool), **draft_views(draft, cfg)}
    want = {**views(expected_pool), **draft_views(expected_draft, cfg)}
    others = [p for p in range(1, cfg["pages"] + 1) if p not in dst]
    result["buffers"] = sorted(got)
    result["mismatched"] = [k for k in got if not bool((got[k][dst] == want[k][src]).all())]
    result["others_sentinel"] = all(bool((got[k][others] == SENTINEL).all()) for k in got)
    held = cfg["dst_pages"][:skip]  # decode's prefix pages: never written
    result["prefix_sentinel"] = all(bool((got[k][held] == SENTINEL).all()) for k in got)
    aux_got, aux_want = aux_views(metadata), aux_views(expected_meta)
    result["aux_exact"] = all(bool((g[cfg["dst_aux"]] == w[cfg["src_aux"]]).all())
                              for g, w in zip(aux_got, aux_want, strict=True))
    result["aux_others_sentinel"] = all(
        bool((g[[i for i in range(g.shape[0]) if i != cfg["dst_aux"]]] == SENTINEL).all()) for g in aux_got)
    result["aux_bytes"] = sum(g.shape[1] for g in aux_got)
    result["nbytes"] = receiver._receiver.nbytes
    result["stages"] = len(receiver._receiver.peers)
    return result


def run_scenarios(run, server_fields=lambda role, cfg: {}) -> None:
    """A rank script's main (``python -m MODULE ROLE CONFIGS_JSON``): sglang's own
    ``load_plugins()``, then ``run(role, cfg, server_args)`` for each scenario in turn, inside a
    published ``ServerArgs`` (the role's disaggregation mode, the scenario's engine and bootstrap
    port, and ``server_fields(role, cfg)`` over them); one ``RESULT [json, ...]`` line."""
    from sglang.srt.plugins import load_plugins

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # run_ranks' stacks of a hung rank
    role, configs = sys.argv[1], json.loads(sys.argv[2])
    load_plugins()
    results = []
    for cfg in configs:
        fields = {"disaggregation_mode": role, "disaggregation_transfer_backend": cfg["engine"],
                  "disaggregation_bootstrap_port": cfg["port"], "host": "127.0.0.1",
                  **server_fields(role, cfg)}
        with shims.published_context(**fields) as args:
            results.append(run(role, cfg, args))
    print("RESULT " + json.dumps(results), flush=True)


def run_role(role: str, cfg: dict, server_args) -> dict:
    if role == "prefill":
        return run_prefill(cfg, server_args, stage_groups(cfg) if cfg.get("pp_size", 1) > 1 else None)
    return run_decode(cfg, server_args)


def main() -> None:
    run_scenarios(run_role, lambda role, cfg: {
        "pp_size": cfg.get("pp_size", 1), "disaggregation_enable_kv_checksum": cfg.get("checksum", False)})


if __name__ == "__main__":
    main()
