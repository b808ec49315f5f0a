"""Always runs: says which engines, devices and namespaces this machine offers, and on CI
insists that both engines really run (so an install step that went missing cannot turn the
engine suites into skips)."""

from __future__ import annotations

import os
import shutil

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


@pytest.mark.parametrize("name", BACKENDS)
def test_engines_start_here_or_explain_why_not(name):
    problem = engine_problem(name)
    assert problem is None or name in problem
