"""One prefill rank of a DP-attention prefill under sglang's Rust server, for
``test_sglang_rust_registry.py``, in its own process: ``python -m tests.sglang.registry_rank
prefill CONFIGS_JSON`` prints one ``RESULT [json, ...]`` line.

Rank ``dp_rank`` of two DP-attention ranks (``tp_size`` 2, ``dp_size`` 2, one gloo world, sglang's
own ``GroupCoordinator`` as the world group), ``SGLANG_RUST_SERVER`` set. A rank with
``rust_port`` owns a Rust listener there: a bootstrap server (sglang's registry protocol) on that
port stands in for it, and the scheduler's ``rust_server`` names the port, which sglang's
``_init_kv_manager`` hands to the manager's KVArgs (``rust_http_port``). Then the manager, made
by sglang's ``_init_kv_manager``; once both ranks made theirs (a gloo barrier), the rank reports
what its registry holds.
"""

from __future__ import annotations

from types import SimpleNamespace

import tests.sglang.conftest as shims  # noqa: F401  (the shims, before sglang)
from tests.sglang import pd_rank


def world_group(cfg: dict):
    """sglang's ``GroupCoordinator`` over a two-process gloo world, published as the world group."""
    import torch.distributed as dist
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    from sglang.srt.runtime_context import get_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{cfg['dist_port']}", world_size=2,
                            rank=cfg["dp_rank"])
    world = GroupCoordinator([[0, 1]], cfg["dp_rank"], "gloo", group_name="world", **pd_rank.GLOO_GROUP)
    get_parallel().override_permanently(world_group=world, tp_rank=cfg["dp_rank"], attn_tp_rank=0,
                                        attn_dp_rank=cfg["dp_rank"])
    return world


def run(role: str, cfg: dict, server_args) -> dict:
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    world = world_group(cfg)
    registry = (get_kv_class(TransferBackend(cfg["engine"]), KVClassType.BOOTSTRAP_SERVER)(
        host="127.0.0.1", port=cfg["rust_port"]) if cfg.get("rust_port") else None)
    pool, metadata = pd_rank.make_pool(cfg, bridge=False), pd_rank.metadata_buffers()
    stand_in = pd_rank.scheduler_stand_in(cfg, server_args, pool, metadata)
    stand_in.scheduler.rust_server = (SimpleNamespace(http_port=cfg["rust_port"])
                                      if registry is not None else None)
    manager = pd_rank.prefill_manager(stand_in)
    world.barrier()  # both ranks registered
    result = {"endpoint": manager.node.endpoint, "registry": None}
    if registry is not None:
        result["registry"] = sorted(
            [dp, cp, tp, pp, f"{info.rank_ip}:{info.rank_port}"]
            for dp, cps in registry.prefill_port_table.items() for cp, tps in cps.items()
            for tp, pps in tps.items() for pp, info in pps.items())
        result["prefill_http_port"] = registry.prefill_http_port
    world.barrier()  # both ranks read their registries before either closes
    manager.shutdown()
    pd_rank.close(registry)
    return result


def main() -> None:
    pd_rank.run_scenarios(run, lambda role, cfg: {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True})


if __name__ == "__main__":
    main()
