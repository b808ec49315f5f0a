"""What a rank's engine is made with, read from sglang (``manager.py``).

``rank_engine_options(backend, kv_args)``: the GPU's RDMA devices as sglang assigns them
(``get_ib_devices_for_gpu`` from ``--disaggregation-ib-device``), sglang's Mooncake protocol and
NIXL backend variables, ``MC_FORCE_TCP``, ``UCX_NET_DEVICES`` and the devices this machine has,
made into the engine's options by the pure ``engines.engine_options``. ``sglang_mooncake_engine``
starts sglang's shared Mooncake engine for sglang's own manager of a pool dsa-bridge does not
move; ``cuda_available`` says whether the rank's buffers may be on a GPU.
"""

from __future__ import annotations

import logging
import os

from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import get_ib_devices_for_gpu
from sglang.srt.environ import envs

from ...transfer.backends.environment import rdma_devices
from .engines import engine_options

log = logging.getLogger(__name__)


def rank_engine_options(backend: str, kv_args) -> dict:
    """The options of the rank's ``backend`` engine (module docstring)."""
    ib_devices = get_ib_devices_for_gpu(getattr(kv_args, "ib_device", None),
                                        getattr(kv_args, "gpu_id", 0) or 0)
    ucx_net_devices = bool(os.environ.get("UCX_NET_DEVICES"))
    if backend == "nixl" and ib_devices and ucx_net_devices:
        log.warning("dsa-bridge: UCX_NET_DEVICES is set; ignoring --disaggregation-ib-device "
                    "for NIXL UCX, as sglang does")
    return engine_options(
        backend, protocol=envs.MOONCAKE_PROTOCOL.get(), ib_devices=ib_devices,
        forced_tcp=os.environ.get("MC_FORCE_TCP") == "1", present=rdma_devices(),
        nixl_backend=envs.SGLANG_DISAGGREGATION_NIXL_BACKEND.get(),
        nixl_params_json=envs.SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS.get(),
        ucx_net_devices=ucx_net_devices)


def sglang_mooncake_engine(gpu_id: int) -> None:
    """Start sglang's shared Mooncake engine, as sglang would have at start-up, for sglang's own
    Mooncake manager of a pool dsa-bridge does not move (a no-op where it runs already)."""
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        init_mooncake_transfer_engine,
    )
    from sglang.srt.runtime_context import get_disagg, get_exec
    from sglang.srt.utils.network import get_local_ip_auto

    init_mooncake_transfer_engine(hostname=get_local_ip_auto(), gpu_id=gpu_id,
                                  ib_device=get_disagg().disaggregation_ib_device
                                  or get_exec().moe.mooncake_ib_device)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
