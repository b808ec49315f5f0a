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
    from tests.ports import candidate_ports, free_port, own_share, port_share

    ports = candidate_ports(32768, [])
    shares = [port_share(ports, f"gw{i}", 4) for i in range(4)]
    assert all(set(a).isdisjoint(b) for i, a in enumerate(shares) for b in shares[i + 1:])
    assert sum(len(s) for s in shares) == 16384 and port_share(ports, "", 1) == list(range(16384, 32768))
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw2")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    mine = own_share()  # gw2's share of the ports below this machine's ephemeral range
    chosen = [free_port() for _ in range(50)]
    assert all(port in mine for port in chosen) and len(set(chosen)) == 50


def test_no_test_chooses_a_port_a_mooncake_engine_may_take(monkeypatch):
    """A Mooncake engine listens on random ports of 15000-17000 (or the range its environment
    sets); a port a test chose there could be taken by another test's engine in the moment it is
    free (the likely cause of a CI failure of the restart test). No share holds one of them."""
    from tests.ports import candidate_ports, mooncake_ports, own_share, port_share

    monkeypatch.setenv("MC_MIN_RPC_PORT", "17500")
    monkeypatch.setenv("MC_MAX_RPC_PORT", "17599")
    avoided = mooncake_ports()
    assert avoided == [range(15000, 17001), range(17500, 17600)]
    ports = candidate_ports(32768, avoided)
    assert ports[0] == 17001 and 17499 in ports and 17500 not in ports and 17600 in ports
    for workers in (1, 2, 4):
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(workers))
        for index in range(workers):
            monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{index}")
            share = own_share()
            assert share and not any(port in each for port in share for each in avoided)
    assert port_share(candidate_ports(32768, avoided), "gw0", 2)[0] == 17001
