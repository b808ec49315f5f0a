"""One bound for how long a failed request's decode pages are held, by sglang and by dsa-bridge's
fence (``plugin/sglang/release_bound.py``): sglang's deferred-release deadline
(``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT``, 30 s by default) raised to the
fence's bound (600 s) where it is shorter, the fence's bound raised to sglang's where that is
longer, stated in one line at start-up.

Through sglang's own queues, made by their own ``__init__`` in the scheduler's order
(``bound_rank.py``): the transfer queue reads sglang's variable, the prefill-allocation queue makes
dsa-bridge's manager and the hook sets the transfer queue's deadline to the manager's bound. With
sglang's deadline at 0.3 s, which forces a release mid-write where sglang keeps its own
(``test_sglang_release.py``'s forced case), a request aborted while prefill's write is held in
flight keeps its pages until the fence lifts: released whole, nothing forced, the new owner's
bytes intact. With deferral off nothing is changed (each release at once counted, as before).
A release forced at sglang's deadline would be told with the deadline in force (the bound where
it was raised), and sglang's setting it came from.
"""

from __future__ import annotations

import math

import pytest

from .conftest import SGLANG_MISSING
from .test_sglang_conn import config, free_port, run_ranks

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

from dsa_bridge.plugin.sglang.release_bound import FENCE_BOUND_S, release_bound  # noqa: E402

MODEL = {"layers": 4, "model_layers": 4, "kv_cache_dim": 656}
HOLD = {"DSA_BRIDGE_FAULT_WRITE_DELAY_MS": "3000"}  # prefill's pause mid-write
VARIABLE = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT"


@pytest.mark.parametrize(("sglang_s", "bound_s", "raised"), [
    (30.0, FENCE_BOUND_S, True), (0.0, FENCE_BOUND_S, True), ("0.3", FENCE_BOUND_S, True),
    (FENCE_BOUND_S, FENCE_BOUND_S, False), (900.0, 900.0, False),
])
def test_the_bound_is_the_larger_of_sglangs_deadline_and_the_fences(sglang_s, bound_s, raised):
    bound = release_bound(sglang_s)
    assert (bound.bound_s, bound.sglang_s, bound.raised) == (bound_s, float(sglang_s), raised)
    line = bound.line()
    assert f"held at most {bound_s:g}s, by sglang and by the fence alike" in line
    assert f"{VARIABLE}={float(sglang_s):g}s" in line
    assert ("raised to dsa-bridge's fence bound" in line) == raised


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, "soon", None])
def test_a_deadline_that_is_not_seconds_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=f"^{VARIABLE} must be a number of seconds >= 0, got"):
        release_bound(bad)


@pytest.fixture(scope="module")
def bounds() -> dict:
    """scenario -> the decode rank's result: one prefill and one decode process for all."""
    dist_port = free_port()
    aborted = {engine: config(engine, MODEL, env=["true", "0.3"], abort=True, fault=HOLD,
                              dist_port=dist_port, write_window_s=2.0)
               for engine in ("nixl", "mooncake")}
    longer = config("nixl", MODEL, env=["true", "900"], dist_port=dist_port)
    off = config("nixl", MODEL, env=["false", "0.3"], dist_port=dist_port)
    _, results = run_ranks([("prefill", list(aborted.values())),
                            ("bound", [aborted["nixl"], longer, off, aborted["mooncake"]])],
                           module="tests.sglang.bound_rank")
    return dict(zip(["nixl", "longer", "off", "mooncake"], results, strict=True))


@pytest.mark.parametrize("engine", ["nixl", "mooncake"])
def test_sglangs_shorter_deadline_is_raised_and_the_pages_wait_for_the_fence(bounds, engine):
    decode = bounds[engine]
    assert decode["manager"] == "DSABridgeKVManager"
    assert decode["sglang_read"] == 0.3  # what sglang's transfer queue read from its variable...
    assert decode["sglang_deadline"] == FENCE_BOUND_S  # ...raised to the fence's bound
    assert decode["fence_bound"] == decode["node_bound"] == FENCE_BOUND_S
    (line,) = decode["bound_lines"]
    assert f"{VARIABLE}=0.3s raised to dsa-bridge's fence bound" in line
    assert decode["held"] == 1 and decode["answers_false"] > 0 and decode["last_answer"] is True
    (release,) = decode["released"]
    assert release["fence"] is True  # not at sglang's 0.3 s: once prefill's write was over
    assert release["landed"] > decode["landed_at_abort"]  # the write landed while held
    assert decode["new_owner_intact"] and decode["landed_at_end"] == 0
    assert decode["forced_releases"] == 0
    assert decode["forced_text"] == (  # the deadline in force, not sglang's 0.3 s
        f"at sglang's deferred-release deadline of 600s ({VARIABLE}=0.3s raised to the one bound)")


def test_sglangs_longer_deadline_becomes_the_fences_bound_too(bounds):
    decode = bounds["longer"]
    assert decode["sglang_read"] == decode["sglang_deadline"] == 900
    assert decode["fence_bound"] == 900  # the fence holds a silent prefill's pages as long
    (line,) = decode["bound_lines"]
    assert "held at most 900s" in line and f"{VARIABLE}=900s, the fence's bound too" in line
    assert decode["forced_text"] == f"at sglang's deferred-release deadline of 900s ({VARIABLE}=900s)"


def test_with_deferral_off_sglangs_queue_is_left_as_it_is(bounds):
    decode = bounds["off"]
    assert decode["sglang_read"] == decode["sglang_deadline"] == 0.3
    assert decode["bound_lines"] == [] and decode["fence_bound"] == FENCE_BOUND_S
    assert decode["forced_text"] == f"at sglang's deferred-release deadline of 0.3s ({VARIABLE}=0.3s)"
