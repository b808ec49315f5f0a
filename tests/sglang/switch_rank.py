"""One sglang PD instance that switches roles between requests, for
``test_sglang_role_switch.py``, in its own process: ``python -m tests.sglang.switch_rank ROLE
CONFIGS_JSON`` (ROLE its first role) prints one ``RESULT [json, ...]`` line.

As an instance started with ``--enable-pd-role-switch``: its bootstrap server runs whatever the
role (sglang's ``start_disagg_service``), one pool and ``MetadataBuffers`` serve every role, and
the scheduler (``SwitchingScheduler``, the attributes sglang's role switch reads) makes the
role's manager in ``init_disaggregation`` from sglang's own ``_init_kv_manager``. Each request of
the scenario's ``requests`` goes through ``pd_rank``'s prefill or decode calls, whichever the
instance's role is; between two requests the instance switches through sglang's own
``handle_pd_role_switch`` (its checks, ``teardown_disaggregation`` calling the manager's
``teardown``, the role flipped in sglang's runtime context, ``init_disaggregation``). As a router
sends requests only to instances whose switch succeeded, an instance starts its next request once
every instance of the scenario switched (``switched``: a file each in ``barrier_dir``).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import tests.sglang.conftest as shims  # noqa: F401  (the shims, before sglang)
from tests.sglang import pd_rank
from tests.transfer.helpers import wait_for


class SwitchingScheduler:
    """The scheduler attributes sglang's ``handle_pd_role_switch`` reads, over one pool; the
    role's manager made as sglang's scheduler makes it (``init_disaggregation``)."""

    def __init__(self, cfg: dict, server_args, pool, metadata):
        self.server_args = server_args
        self._pd_role_switch_unhealthy = False
        self._pd_role_switch_in_progress = False
        self._event_loop_should_restart = False
        self.idle = True  # no request in any queue (the rank switches only between requests)
        self.disable_radix_cache = True  # sglang then has no prefix cache to release
        # decode's CUDA graphs already captured: sglang then asks no GPU for their memory
        self.tp_worker = SimpleNamespace(get_decode_cuda_graph_bs=lambda: [1],
                                         ensure_decode_cuda_graphs=lambda bs: None)
        self.stand_in = pd_rank.scheduler_stand_in(cfg, server_args, pool, metadata)
        self.init_disaggregation()

    def is_fully_idle(self) -> bool:
        return self.idle

    def init_disaggregation(self) -> None:
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.runtime_context import get_disagg

        self.disaggregation_mode = DisaggregationMode(get_disagg().disaggregation_mode)
        self.disagg_metadata_buffers = self.stand_in.metadata_buffers
        if self.disaggregation_mode == DisaggregationMode.PREFILL:
            self.disagg_prefill_bootstrap_queue = SimpleNamespace(
                kv_manager=pd_rank.prefill_manager(self.stand_in))
            self.disagg_prefill_inflight_queue = []
        else:
            self.disagg_decode_prealloc_queue = SimpleNamespace(
                kv_manager=pd_rank.decode_manager(self.stand_in))
            self.disagg_decode_transfer_queue = SimpleNamespace()

    def _sync_disaggregation_mode_to_subcomponents(self) -> None:
        pass  # no subcomponents here

    @property
    def kv_manager(self):
        """The role's manager; None once sglang's teardown dropped it, or before the role's queue
        exists (a failed switch)."""
        from sglang.srt.disaggregation.utils import DisaggregationMode

        queue = getattr(self, "disagg_prefill_bootstrap_queue"
                        if self.disaggregation_mode == DisaggregationMode.PREFILL
                        else "disagg_decode_prealloc_queue", None)
        return None if queue is None else queue.kv_manager


def run(role: str, cfg: dict, server_args) -> dict:
    from sglang.srt.disaggregation.role_switch import handle_pd_role_switch
    from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend, get_kv_class
    from sglang.srt.managers.io_struct import PdRoleSwitchReqInput

    server = get_kv_class(TransferBackend(cfg["engine"]), KVClassType.BOOTSTRAP_SERVER)(
        host="127.0.0.1", port=cfg["port"])
    pool, metadata = pd_rank.make_pool(cfg, bridge=True), pd_rank.metadata_buffers()
    scheduler = SwitchingScheduler(cfg, server_args, pool, metadata)
    served = []
    try:
        for i, request in enumerate(cfg["requests"]):
            request_cfg = {**cfg, **request}
            prefill = scheduler.disaggregation_mode == DisaggregationMode.PREFILL
            scheduler.idle = False
            served.append({"role": scheduler.disaggregation_mode.value, **(
                pd_rank.prefill_request(request_cfg, scheduler.kv_manager, pool, metadata) if prefill
                else pd_rank.decode_request(request_cfg, scheduler.kv_manager, pool, metadata))})
            scheduler.idle = True
            if i + 1 < len(cfg["requests"]):
                switched = handle_pd_role_switch(scheduler, PdRoleSwitchReqInput(
                    new_role="decode" if prefill else "prefill"))
                served[-1]["switch"] = {"success": switched.success, "message": switched.message,
                                        "new_role": switched.new_role}
                if not switched.success:
                    break
                switched_everywhere(cfg, role, i)
    finally:
        if scheduler.kv_manager is not None:
            scheduler.kv_manager.shutdown()
        pd_rank.close(server)
    return {"served": served}


def switched_everywhere(cfg: dict, first_role: str, step: int) -> None:
    """This instance's ``step``-th switch done; returns once every instance's is (a router's view)."""
    barrier = Path(cfg["barrier_dir"])
    (barrier / f"{first_role}-{step}").touch()
    wait_for(lambda: all((barrier / f"{r}-{step}").exists() for r in ("prefill", "decode")), 60,
             f"the other instance's switch {step}")


def main() -> None:
    pd_rank.run_scenarios(run, lambda role, cfg: {"enable_pd_role_switch": True})


if __name__ == "__main__":
    main()
