"""A decode rank with sglang's HiSparse (``--enable-hisparse``) for ``test_sglang_hisparse.py``, in
its own process: ``python -m tests.sglang.hisparse_rank ROLE CONFIGS_JSON`` (``prefill`` is
``pd_rank``'s). As sglang's HiSparse decode for a DSA model: its device pool sglang's own
``HiSparseDSATokenToKVPool`` (the indexer's pages), its host pool sglang's own
``MLATokenToKVPoolHost`` (unpinned: no CUDA here) in the scheduler's ``hisparse_coordinator``, the
manager from sglang's own ``DecodePreallocQueue._init_kv_manager`` (which registers the host pool's
KV and the device pool's indexer), then the receiver's calls: ``init``, ``send_metadata`` with the
host pool's pages as the KV pages (host page 0 among them: that pool has no padding page) and the
indexer's own pages as the DSA state indices (with ``draft_layers``, a draft model's pool, sglang's
own DSA pool on the device, and its pages as ``device_kv_indices``: the indexer's, or
``device_pages``). The KV and the indexer are compared with what prefill wrote, each at its own
pages, and the rest of every pool with the sentinel.
"""

from __future__ import annotations

from types import SimpleNamespace

import tests.sglang.conftest as shims  # noqa: F401  (the shims, before sglang)
from tests.sglang import pd_rank
from tests.transfer.helpers import wait_for

HOST_TO_DEVICE_RATIO = 2


def pools(cfg: dict):
    """sglang's HiSparse device pool and its host pool, as sglang's coordinator builds them."""
    from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseDSATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    kwargs = {key: value for key, value in pd_rank.pool_kwargs(cfg).items() if key != "start_layer"}
    device = HiSparseDSATokenToKVPool(**kwargs, host_to_device_ratio=HOST_TO_DEVICE_RATIO)
    capacity = device.size if device.host_capacity_tokens is None else device.host_capacity_tokens
    host = MLATokenToKVPoolHost(
        buffer_info=device.get_device_pool_infos()[0].buffer_info, device_capacity_tokens=capacity,
        start_layer=device.start_layer, end_layer=device.end_layer,
        target_layer_num=device.layer_num, host_to_device_ratio=HOST_TO_DEVICE_RATIO, host_size=0,
        page_size=device.page_size, layout="layer_first", override_kv_cache_dim=device.kv_cache_dim,
        pin_memory=False)
    return device, host


def views(device, host) -> dict[str, object]:
    """The host pool's KV (``kv:L``) and the device pool's indexer (``index:L``) as uint8 pages."""
    import torch

    out = {f"kv:{i}": host.kv_buffer[i].view(torch.uint8).reshape(-1, 64 * host.kv_buffer.shape[-1])
           for i in range(host.kv_buffer.shape[0])}
    out.update({key: view for key, view in pd_rank.views(device).items() if key.startswith("index:")})
    return out


def run_decode(cfg: dict, server_args) -> dict:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    device, host = pools(cfg)
    draft = pd_rank.make_draft_pool(cfg)  # a draft model's pool: on the device, logical pages
    metadata = pd_rank.metadata_buffers()
    got = {**views(device, host), **pd_rank.draft_views(draft, cfg)}
    for view in [*got.values(), *pd_rank.aux_views(metadata)]:
        view.fill_(pd_rank.SENTINEL)
    stand_in = pd_rank.scheduler_stand_in(cfg, server_args, device, metadata, draft)
    stand_in.scheduler.enable_hisparse = True
    stand_in.scheduler.hisparse_coordinator = SimpleNamespace(mem_pool_host=host)
    manager = pd_rank.decode_manager(stand_in)
    addr = f"127.0.0.1:{cfg['port']}"
    receiver = get_kv_class(TransferBackend(cfg["engine"]), KVClassType.RECEIVER)(
        mgr=manager, bootstrap_addr=addr, bootstrap_room=cfg["room"])
    kv_pages, index_pages = cfg["host_pages"], cfg["dst_pages"]

    def pages_of(key: str) -> list[int]:  # the target's KV in the host pool, the rest on device
        kind, layer = key.split(":")
        return kv_pages if kind == "kv" and int(layer) < cfg["model_layers"] else index_pages

    try:
        wait_for(lambda: manager.try_ensure_parallel_info(addr), 180, "prefill parallel info")
        receiver.init(0)
        wait_for(lambda: receiver.poll() != KVPoll.Bootstrapping, 30, "decode bootstrap")
        # sglang's prealloc queue: with a draft model, the draft KV's device pages beside
        device_pages = cfg.get("device_pages", index_pages) if draft is not None else None
        receiver.send_metadata(kv_pages, cfg["dst_aux"], [index_pages], decode_prefix_len=0,
                               device_kv_indices=device_pages)
        wait_for(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), 60, "decode end")
        result = {"poll": int(receiver.poll()), "reason": pd_rank.reason_of(receiver),
                  "nbytes": receiver._receiver.nbytes, "buffers": sorted(got),
                  "aux_bytes": sum(view.shape[1] for view in pd_rank.aux_views(metadata))}
        want_pool, want_meta = pd_rank.make_pool(cfg, bridge=False), pd_rank.metadata_buffers()
        want_draft = pd_rank.make_draft_pool(cfg)
        pd_rank.fill_pool(want_pool, cfg["seed"], pd_rank.draft_views(want_draft, cfg))
        pd_rank.fill(pd_rank.aux_views(want_meta), seed=cfg["seed"] + 1)
        want, src = {**pd_rank.views(want_pool), **pd_rank.draft_views(want_draft, cfg)}, cfg["src_pages"]
        result["mismatched"] = [key for key, view in got.items()
                                if not bool((view[pages_of(key)] == want[key][src]).all())]
        result["others_sentinel"] = all(
            bool((view[[p for p in range(view.shape[0]) if p not in pages_of(key)]]
                  == pd_rank.SENTINEL).all()) for key, view in got.items())
        result["untouched"] = all(bool((view == pd_rank.SENTINEL).all()) for view in got.values())
        result["aux_exact"] = all(bool((g[cfg["dst_aux"]] == w[cfg["src_aux"]]).all())
                                  for g, w in zip(pd_rank.aux_views(metadata),
                                                  pd_rank.aux_views(want_meta), strict=True))
        receiver.clear()
        return result
    finally:
        manager.shutdown()


def run_role(role: str, cfg: dict, server_args) -> dict:
    return run_decode(cfg, server_args) if role == "hisparse-decode" else pd_rank.run_role(
        role, cfg, server_args)


def main() -> None:
    pd_rank.run_scenarios(run_role, lambda role, cfg: {
        "disaggregation_mode": "decode" if role == "hisparse-decode" else role,
        "enable_hisparse": role == "hisparse-decode",
        "disaggregation_enable_kv_checksum": cfg.get("checksum", False)})


if __name__ == "__main__":
    main()
