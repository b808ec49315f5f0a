"""A rank's engine as sglang's own connectors set theirs (``plugin/sglang/engines.py``), against the
real sglang 0.5.23 on the CPU:

- the pure choice: Mooncake's transport and devices; NIXL's UCX backend parameters from
  ``SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS`` with the GPU's ``--disaggregation-ib-device``
  as UCX's ``device_list``; each bad setting refused naming it (another NIXL backend, params
  that are not a JSON object of strings, a device_list that disagrees, port suffixes);
- on both engines, a device this machine does not have (it has no RDMA device) is refused at
  start-up by name, by a real manager, never left to fall back to TCP;
- a real NIXL prefill manager creates its UCX backend with sglang's parameters (read back from
  the agent), and the core backend refuses a ``device_list`` naming a missing device.
"""

from __future__ import annotations

import pytest

from tests.conftest import require_engine

from .conftest import SGLANG_MISSING, published_context

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402

from dsa_bridge.plugin.sglang import conn  # noqa: E402
from dsa_bridge.plugin.sglang.engines import engine_options  # noqa: E402
from dsa_bridge.plugin.sglang.pool import BridgeDSATokenToKVPool  # noqa: E402
from dsa_bridge.transfer.backends import create_backend  # noqa: E402
from dsa_bridge.transfer.backends.base import BackendUnavailable  # noqa: E402

from .test_sglang_conn import DSV32  # noqa: E402
from .test_sglang_conn_bringup import bootstrap_server, kv_args, prefill_manager  # noqa: E402

HERE = ["mlx5_0", "mlx5_1"]  # the RDMA devices of a machine that has some


@pytest.mark.parametrize(("protocol", "devices", "forced", "present", "expected"), [
    ("rdma", "mlx5_0,mlx5_1", False, HERE, {"protocol": "rdma", "device_name": "mlx5_0,mlx5_1"}),
    ("rdma", None, False, HERE, {"protocol": "rdma", "device_name": ""}),  # every device
    ("rdma", "mlx5_0", True, HERE, {"protocol": "tcp", "device_name": ""}),  # MC_FORCE_TCP=1
    ("rdma", "mlx5_9", True, [], {"protocol": "tcp", "device_name": ""}),  # TCP asked: not used
    ("rdma", None, False, [], {"protocol": "tcp", "device_name": ""}),  # no device here
    ("tcp", "mlx5_0", False, HERE, {"protocol": "tcp", "device_name": "mlx5_0"}),
])
def test_mooncake_options_are_sglangs_choice(protocol, devices, forced, present, expected):
    assert engine_options("mooncake", protocol=protocol, ib_devices=devices, forced_tcp=forced,
                          present=present) == expected


@pytest.mark.parametrize(("devices", "params", "ucx_set", "expected"), [
    (None, "{}", False, {}),
    (None, '{"num_workers": "4"}', False, {"num_workers": "4"}),
    ("mlx5_0,mlx5_1", "{}", False, {"device_list": "mlx5_0, mlx5_1"}),  # NIXL's ", " separator
    ("mlx5_0", '{"device_list": "mlx5_0"}', False, {"device_list": "mlx5_0"}),  # they agree
    ("mlx5_0", "{}", True, {}),  # UCX_NET_DEVICES set: the flag ignored, as sglang does
])
def test_nixl_ucx_params_are_sglangs(devices, params, ucx_set, expected):
    assert engine_options("nixl", protocol="rdma", ib_devices=devices, forced_tcp=False,
                          present=HERE, nixl_params_json=params, ucx_net_devices=ucx_set) == {
        "backend_params": expected}


@pytest.mark.parametrize(("backend", "devices", "params", "nixl_backend", "message"), [
    ("mooncake", "mlx5_0,mlx5_7", "{}", "UCX",
     "--disaggregation-ib-device names mlx5_7 for this rank's GPU, which this machine does not have"),
    ("nixl", "mlx5_7", "{}", "UCX", "names mlx5_7 for this rank's GPU"),
    ("nixl", None, "{}", "LIBFABRIC", "SGLANG_DISAGGREGATION_NIXL_BACKEND='LIBFABRIC': dsa-bridge's "
                                      "NIXL transfer drives the UCX backend only"),
    ("nixl", None, '{"num_workers": 4}', "UCX", "must be a JSON object with string keys and string"),
    ("nixl", None, "[1]", "UCX", "must be a JSON object"),
    ("nixl", None, "{nope", "UCX", "must be a JSON object"),
    ("nixl", "mlx5_0:1", "{}", "UCX", "HCA names without port suffixes"),
    ("nixl", "mlx5_0", '{"device_list": "mlx5_1"}', "UCX", "device_list 'mlx5_1' and "
                                                          "--disaggregation-ib-device (mlx5_0) disagree"),
])
def test_bad_engine_settings_are_refused_by_name(backend, devices, params, nixl_backend, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        engine_options(backend, protocol="rdma", ib_devices=devices, forced_tcp=False, present=HERE,
                       nixl_backend=nixl_backend, nixl_params_json=params)


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_a_missing_device_is_refused_at_start_up_on_both_engines(engine, monkeypatch):
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    with published_context(disaggregation_mode="decode", disaggregation_transfer_backend=engine) as sa:
        args = kv_args(BridgeDSATokenToKVPool(**DSV32))
        args.ib_device, args.gpu_id = "mlx5_7", 0  # what sglang's --disaggregation-ib-device fills
        with pytest.raises(ValueError, match="names mlx5_7 for this rank's GPU, which this machine "
                                             r"does not have \(its RDMA devices: none\)"):
            conn.DSABridgeKVManager(args, DisaggregationMode.DECODE, sa, True)


def test_a_nixl_rank_creates_ucx_with_sglangs_params(monkeypatch):
    require_engine("nixl")
    monkeypatch.setenv("SGLANG_HOST_IP", "127.0.0.1")
    monkeypatch.setenv("SGLANG_DISAGGREGATION_NIXL_BACKEND_PARAMS", '{"num_workers": "3"}')
    with (bootstrap_server() as port,
          published_context(disaggregation_mode="prefill", disaggregation_transfer_backend="nixl",
                            disaggregation_bootstrap_port=port, host="127.0.0.1") as sa):
        manager = prefill_manager(sa)
        try:
            assert manager.engine_options == {"backend_params": {"num_workers": "3"}}
            assert manager.node.backend._agent.get_backend_params("UCX")["num_workers"] == "3"
        finally:
            manager.shutdown()


def test_the_nixl_backend_refuses_a_device_list_naming_a_missing_device():
    require_engine("nixl")
    with pytest.raises(BackendUnavailable, match="UCX device_list names mlx5_7, which this machine "
                                                 r"does not have \(its RDMA devices: none\)"):
        create_backend("nixl", backend_params={"device_list": "mlx5_7"})
