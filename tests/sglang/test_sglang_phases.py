"""Per-phase deadlines inside the real sglang 0.5.23 (``plugin/sglang/phases.py``): prefill and
decode as two processes (``phases_rank.py``), sglang's own pools and ``_init_kv_manager``, with
sglang's variables set small (``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` and ``..._WAITING_TIMEOUT``
= 6 s).

- a request that waits 4 s in decode's prealloc queue and 4.5 s in prefill's waiting queue
  succeeds, byte-exact, although it ends more than 6 s after its sender and its receiver were
  made (the deadline dsa-bridge's nodes used to run from creation: 6 s);
- a phase past its bound fails the request on both sides with a reason naming the phase and the
  variable: the waiting phase (prefill held 9 s before sending), the bootstrapping phase (decode
  never sent its pages).
"""

from __future__ import annotations

import re

import pytest

from .conftest import SGLANG_MISSING

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

from .test_sglang_conn import MODELS, config, run_ranks, scenarios_per_engine  # noqa: E402

ENGINES = ["mooncake", "nixl"]
BOUND_S = 6
# the nodes' own deadline, after both phases: a phase's end before it is the phase's deadline (the
# margin up to it is what a loaded machine may add to a poll)
BACKSTOP_S = 2 * BOUND_S + 5
BOOTSTRAP_ENV = "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"
WAITING_ENV = "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"
SCENARIOS = {
    "queued": {"decode_hold_s": 4.0, "prefill_hold_s": 4.5},
    "waiting-expires": {"decode_hold_s": 0.0, "prefill_hold_s": BOUND_S + 3.0},
    "bootstrap-expires": {"decode_hold_s": BOUND_S + 2.0, "prefill_hold_s": 0.0, "skip_metadata": True},
}


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    """engine -> {scenario: (prefill result, decode result)}, one process pair per engine."""

    def run(engine: str) -> dict:
        sync = tmp_path_factory.mktemp(f"phases-{engine}")
        cfgs = [{**config(engine, MODELS["deepseek-v3.2"]), **scenario, "sync": str(sync / name)}
                for name, scenario in SCENARIOS.items()]
        return run_ranks([("prefill", cfgs), ("decode", cfgs)], "tests.sglang.phases_rank",
                         {BOOTSTRAP_ENV: str(BOUND_S), WAITING_ENV: str(BOUND_S)}, timeout_s=240)

    return scenarios_per_engine(run, SCENARIOS)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_request_queued_longer_than_one_bound_succeeds(phases, engine):
    prefill, decode = phases(engine)["queued"]
    assert (prefill["poll"], decode["poll"]) == (4, 4), (prefill["reason"], decode["reason"])
    assert decode["mismatched"] == [] and decode["others_sentinel"] and decode["aux_exact"]
    # longer than one bound from its start on both sides: a single deadline from creation fails it
    assert prefill["ended_s"] > BOUND_S and decode["ended_s"] > BOUND_S, (prefill, decode)
    # decode's pages came within the bootstrap bound
    assert prefill["bootstrapped_s"] < BOUND_S, (prefill, decode)
    # the nodes' own deadline is a backstop after both phases: 6 + 6 + 5 s
    assert prefill["node_timeout_s"] == decode["node_timeout_s"] == BACKSTOP_S


@pytest.mark.parametrize("engine", ENGINES)
def test_the_waiting_phase_times_out_naming_its_variable(phases, engine):
    prefill, decode = phases(engine)["waiting-expires"]
    assert (prefill["poll"], decode["poll"]) == (0, 0)
    assert "timed out after" in decode["reason"] and "waiting (decode)" in decode["reason"]
    assert f"{WAITING_ENV}={BOUND_S}s: raise it" in decode["reason"]
    # at the bound, not at the node's backstop
    assert BOUND_S <= decode["ended_s"] < BACKSTOP_S, (prefill, decode)
    assert f"{WAITING_ENV}={BOUND_S}s" in prefill["reason"]  # decode's Abort, with its reason


@pytest.mark.parametrize("engine", ENGINES)
def test_the_bootstrapping_phase_times_out_naming_its_variable(phases, engine):
    prefill, decode = phases(engine)["bootstrap-expires"]
    assert (prefill["poll"], decode["poll"]) == (0, 0)
    assert "bootstrapping (decode)" in decode["reason"]
    # the request's first phase clock: decode's receiver, made before prefill's sender (one host's
    # monotonic clock, shared by both processes)
    first_start = min(prefill["started_at"], decode["started_at"])
    for result in (prefill, decode):  # prefill's own phase ends, or decode's Abort says it first
        assert re.search(r"bootstrapping \((prefill|decode)\)", result["reason"]), result["reason"]
        assert f"{BOOTSTRAP_ENV}={BOUND_S}s: raise it" in result["reason"]
        ended_at = result["started_at"] + result["ended_s"]
        # at the bound, not at the backstop
        assert BOUND_S <= ended_at - first_start and result["ended_s"] < BACKSTOP_S, (first_start, result)
