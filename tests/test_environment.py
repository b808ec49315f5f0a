"""Always runs: says which engines, devices and namespaces this machine offers, and on CI
insists that both engines really run (so an install step that went missing cannot turn the
engine suites into skips)."""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch

from dsa_bridge.transfer.backends import BACKENDS

from .conftest import engine_problem


def test_report_what_this_machine_offers(record_property):
    offers = {name: engine_problem(name) or "available" for name in BACKENDS}
    offers["cuda"] = "available" if torch.cuda.is_available() else "absent: gpu tests skip"
    offers["netns"] = ("available" if os.geteuid() == 0 and shutil.which("ip")
                       else "absent: multi-node tests run on loopback")
    for key, value in offers.items():
        record_property(key, value)
        print(f"{key}: {value}")
    if os.environ.get("CI") == "true":
        missing = {name: offers[name] for name in BACKENDS if offers[name] != "available"}
        assert not missing, f"CI must run both engines: {missing}"


# an engine's modules, and the package its explanation must tell the user to install
MISSING = {"mooncake": (("mooncake.engine",), "install mooncake-transfer-engine-non-cuda"),
           "nixl": (("nixl_cu12._api", "nixl_cu13._api", "nixl._api"), "install nixl-cu12")}


@pytest.mark.parametrize("name", BACKENDS)
def test_a_missing_engine_is_explained_with_what_to_install(name, monkeypatch):
    modules, hint = MISSING[name]
    for module in modules:  # a None entry makes importing the module fail
        monkeypatch.setitem(sys.modules, module, None)
    problem = engine_problem.__wrapped__(name)  # not the cached answer of the real engine
    assert problem is not None and problem.startswith(f"{name} import failed")
    assert hint in problem


def test_parallel_test_processes_choose_ports_from_disjoint_shares(monkeypatch):
    """Two test processes of one run cannot both choose a port before either binds it (their
    shares are disjoint), and one process never hands out a port twice in a row."""
    from tests.ports import free_port, own_share, port_share

    shares = [port_share(16384, 32768, f"gw{i}", 4) for i in range(4)]
    assert all(set(a).isdisjoint(b) for i, a in enumerate(shares) for b in shares[i + 1:])
    assert sum(len(s) for s in shares) == 16384 and port_share(16384, 32768, "", 1) == range(16384, 32768)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw2")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    mine = own_share()  # gw2's share of the ports below this machine's ephemeral range
    chosen = [free_port() for _ in range(50)]
    assert all(port in mine for port in chosen) and len(set(chosen)) == 50
