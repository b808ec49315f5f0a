"""A rank's engine options, pure, as sglang's own connectors choose them (``manager.py`` reads the
flags and the machine and passes them in).

``engine_options(backend, ...)``: the keyword options of dsa-bridge's engine backend
(``transfer.backends.create_backend``), or ValueError naming the setting to change:

- every backend: the RDMA devices sglang assigns this rank's GPU from
  ``--disaggregation-ib-device`` (``ib_devices``, already resolved per GPU by sglang's
  ``get_ib_devices_for_gpu``) must be devices this machine has (``present``): a name it lacks is
  refused by name, never left to fall back to TCP;
- Mooncake: ``protocol`` (sglang's ``MOONCAKE_PROTOCOL``: "rdma" by default; "tcp" under
  ``MC_FORCE_TCP=1``, where the devices are not used, or where the machine has no RDMA device and
  none is named) and ``device_name`` (those devices; "" lets the engine take every device);
- NIXL: sglang's ``SGLANG_DISAGGREGATION_NIXL_BACKEND`` (dsa-bridge's NIXL transfer drives the
  UCX backend only: another is refused) and ``..._BACKEND_PARAMS`` (a JSON object of strings,
  passed to NIXL's ``create_backend``), with the GPU's devices as UCX's ``device_list`` (NIXL
  appends port 1), as sglang's nixl connector sets it; not where the operator set
  ``UCX_NET_DEVICES`` (sglang then ignores the flag, and so does dsa-bridge: the manager warns).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

NIXL_BACKEND_ENV = "SGLANG_DISAGGREGATION_NIXL_BACKEND"
NIXL_PARAMS_ENV = "SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS"


def device_names(ib_devices: str | None) -> list[str]:
    """The device names of a comma-separated list (sglang's per-GPU devices), in order."""
    return [name.strip() for name in (ib_devices or "").split(",") if name.strip()]


def missing_devices_problem(named: Sequence[str], present: Sequence[str]) -> str | None:
    """Why the devices named cannot be used: those this machine does not have; None when all are
    here."""
    missing = [name for name in named if name.split(":")[0] not in present]
    if not missing:
        return None
    return (f"--disaggregation-ib-device names {', '.join(missing)} for this rank's GPU, which "
            f"this machine does not have (its RDMA devices: {', '.join(present) or 'none'}); "
            "dsa-bridge does not fall back to TCP for a device it cannot find: name devices "
            "this machine has, or leave the flag out")


def nixl_params(raw: str) -> dict[str, str]:
    """sglang's ``SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS``: a JSON object of strings."""
    try:
        params = json.loads(raw)
    except ValueError:
        params = None
    if not isinstance(params, dict) or not all(
            isinstance(key, str) and isinstance(value, str) for key, value in params.items()):
        raise ValueError(f"{NIXL_PARAMS_ENV} must be a JSON object with string keys and string "
                         f"values, got {raw!r}")
    return params


def engine_options(backend: str, *, protocol: str, ib_devices: str | None, forced_tcp: bool,
                   present: Sequence[str], nixl_backend: str = "UCX", nixl_params_json: str = "{}",
                   ucx_net_devices: bool = False) -> dict:
    """The options of this rank's engine (module docstring); ValueError naming what to change."""
    named = device_names(ib_devices)
    if backend == "mooncake":
        if protocol not in ("rdma", "tcp"):
            raise ValueError(f"MOONCAKE_PROTOCOL={protocol!r}: dsa-bridge's Mooncake transfer "
                             "serves 'rdma' and 'tcp' (unset it, or set one of those)")
        if forced_tcp:
            return {"protocol": "tcp", "device_name": ""}
        problem = missing_devices_problem(named, present)
        if problem:
            raise ValueError(problem)
        if not named and not present:
            return {"protocol": "tcp", "device_name": ""}
        return {"protocol": protocol, "device_name": ",".join(named)}
    if nixl_backend != "UCX":
        raise ValueError(f"{NIXL_BACKEND_ENV}={nixl_backend!r}: dsa-bridge's NIXL transfer drives "
                         "the UCX backend only (unset it, or set UCX)")
    params = nixl_params(nixl_params_json)
    if not named or ucx_net_devices:
        return {"backend_params": params}
    if any(":" in name for name in named):
        raise ValueError("NIXL UCX --disaggregation-ib-device requires HCA names without port "
                         "suffixes (e.g. mlx5_0); NIXL appends port 1")
    problem = missing_devices_problem(named, present)
    if problem:
        raise ValueError(problem)
    device_list = ", ".join(named)  # NIXL's UCX parser splits on ", "
    given = params.get("device_list")
    if given is not None and ", ".join(device_names(given)) != device_list:
        raise ValueError(f"{NIXL_PARAMS_ENV}'s device_list {given!r} and --disaggregation-ib-device "
                         f"({device_list}) disagree: configure one, or make them agree")
    return {"backend_params": {**params, "device_list": device_list}}
