"""Inside sglang, no decode page goes back to the allocator while a prefill write into it can still
land: sglang's own deferred release (``DecodeTransferQueue.pop_transferred`` /
``resolve_deferred_releases``) asks dsa-bridge's manager ``is_abort_release_safe``, answered by
dsa-bridge's fence; and sglang's ``--disaggregation-enable-kv-checksum`` turns dsa-bridge's
checksums on on both sides.

Two processes per engine, as sglang's schedulers: a prefill (``pd_rank.py``) whose every write
lands half, then pauses (``tests/faulty.py``), and a decode (``release_rank.py``: sglang's own
transfer queue over dsa-bridge's manager) that aborts the request while that write is in flight:

- deferral on (sglang's default): sglang holds the pages, ``is_abort_release_safe`` answering
  False until prefill's write is over, then True; released with the write whole, and the pages'
  new owner's bytes stay intact; nothing forced, the request gone from the node;
- the same when sglang's waiting timeout (``SGLANG_DISAGGREGATION_WAITING_TIMEOUT``, 3 s on
  decode, that write held 6 s) fails the request instead, mid-write: sglang's transfer queue
  notifies and holds the pages itself (a failure decode did not initiate);
- and when the prefill is lost mid-write (its process killed by decode, in a process pair of its
  own): the request fails once decode finds the prefill silent, the pages held until it is
  proven gone, then released with nothing more landed, the new owner's bytes intact;
- sglang's deadline shorter than the write, in a sglang whose transfer queue never took the one
  bound (``release_rank`` makes it by its own ``__init__`` without the prefill-allocation queue
  whose hook raises it; ``test_sglang_release_bound.py`` has the queues with it): sglang releases
  the pages anyway; the release is counted (``forced_releases``) and logged with the deadline in
  force, and the request leaves the node once its fence lifts;
- deferral turned off: said once at start-up, the release at once counted as forced;
- the checksum flag: checksums computed by prefill and verified by decode, equal in number; a
  byte flipped on the way fails the request, aborted by sglang with its own words (500).
"""

from __future__ import annotations

import signal
import tempfile

import pytest

from tests.conftest import require_engine

from .conftest import SGLANG_MISSING
from .test_sglang_conn import (
    config,
    free_port,
    result_of,
    run_ranks,
    scenarios_per_engine,
    start_rank,
    stopped_at_end,
)

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

MODEL = {"layers": 4, "model_layers": 4, "kv_cache_dim": 656}
ENGINES = ["mooncake", "nixl"]
DELAY_MS = 3000  # prefill's pause between the two halves of every write
HOLD = {"DSA_BRIDGE_FAULT_WRITE_DELAY_MS": str(DELAY_MS)}
WAITING_S = 3  # decode's SGLANG_DISAGGREGATION_WAITING_TIMEOUT in "timeout", mid-way through...
LONG_HOLD = {"DSA_BRIDGE_FAULT_WRITE_DELAY_MS": str(2 * WAITING_S * 1000)}  # ...this write's pause
SCENARIOS = {  # name: (decode's deferral env, abort mid-write, prefill fault, extra)
    "held": (("true", "30"), True, HOLD, {"write_window_s": 2.0}),
    "timeout": (("true", "30"), False, LONG_HOLD,
                {"waiting_timeout": WAITING_S, "write_window_s": 2.0}),
    "forced": (("true", "0.3"), True, HOLD, {"write_window_s": DELAY_MS / 1000 + 2}),
    "off": (("false", "30"), True, HOLD, {"write_window_s": DELAY_MS / 1000 + 2}),
    "checksum-ok": (("true", "30"), False, None, {"checksum": True, "success": True}),
    "checksum-bad": (("true", "30"), False, {"DSA_BRIDGE_FAULT_FLIP_EVERY": "1"},
                     {"checksum": True, "write_window_s": 0.5}),
}


@pytest.fixture(scope="module")
def releases():
    """engine -> {scenario: (prefill result, decode result)}, one process pair per engine."""

    def run(engine: str) -> dict:
        dist_port = free_port()
        cfgs = [config(engine, MODEL, env=list(env), abort=abort, fault=fault, dist_port=dist_port,
                       **extra) for env, abort, fault, extra in SCENARIOS.values()]
        return run_ranks([("prefill", cfgs), ("release", cfgs)])

    return scenarios_per_engine(run, SCENARIOS)


@pytest.mark.parametrize("engine", ENGINES)
def test_pages_held_until_the_fence_lifts_then_released_whole(releases, engine):
    prefill, decode = releases(engine)["held"]
    assert decode["abort_notified"]
    assert decode["held"] == 1  # sglang's deferred-release list held the request
    assert decode["answers_false"] > 0, decode  # while prefill's write was in flight...
    assert decode["last_answer"] is True  # ...then True, and sglang released the pages
    (release,) = decode["released"]
    assert release["fence"] is True
    assert release["landed"] > decode["landed_at_abort"]  # a write was in flight at the abort
    assert decode["new_owner_intact"] and decode["landed_at_end"] == 0  # nothing landed after release
    assert decode["forced_releases"] == 0 and decode["forced_warnings"] == []
    assert decode["unreleased_after_release"] == 0 and not decode["in_node_after_release"]
    assert "aborted by sglang" in decode["finished"] and decode["status"] == 500
    assert decode["pending"] == 0 and prefill["poll"] == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_a_waiting_timeout_mid_write_holds_the_pages_until_the_write_is_over(releases, engine):
    prefill, decode = releases(engine)["timeout"]
    assert WAITING_S - 0.1 < decode["failed_after_s"] < 2 * WAITING_S, decode  # sglang's bound, mid-write
    assert f"SGLANG_DISAGGREGATION_WAITING_TIMEOUT={WAITING_S}s" in decode["finished"]
    assert decode["status"] == 500
    assert decode["notified"] and decode["held"] == 1  # sglang's queue armed its hold itself
    assert decode["answers_false"] > 0 and decode["last_answer"] is True, decode
    (release,) = decode["released"]
    assert release["fence"] is True
    assert release["landed"] > decode["landed_at_failure"] > 0, decode  # the held write landed while held
    assert decode["new_owner_intact"] and decode["landed_at_end"] == 0
    assert decode["forced_releases"] == 0 and decode["pending"] == 0
    assert not decode["in_node_at_end"] and prefill["poll"] == 0  # told to stop


@pytest.fixture(scope="module")
def lost():
    """engine -> the decode's result of a request whose prefill's process decode killed mid-write
    (a process pair of its own: the prefill ends killed)."""
    done = {}

    def run(engine: str) -> dict:
        if engine in done:
            return done[engine]
        require_engine(engine)
        cfg = config(engine, MODEL, env=["true", "30"], abort=False, fault=HOLD,
                     dist_port=free_port(), write_window_s=2.0)
        files = [tempfile.TemporaryFile("w+") for _ in range(4)]
        procs: list = []
        with stopped_at_end(procs, files):
            procs.append(start_rank("prefill", [cfg], stdout=files[0], stderr=files[1]))
            procs.append(start_rank("release", [{**cfg, "kill_prefill": procs[0].pid}],
                                    stdout=files[2], stderr=files[3]))
            procs[1].wait(timeout=420)
            procs[0].wait(timeout=30)
            files[3].seek(0)
            assert procs[1].returncode == 0, files[3].read()[-4000:]
            assert procs[0].returncode == -signal.SIGKILL  # the prefill was lost, not finished
            files[2].seek(0)
            done[engine] = result_of(files[2].read())[0]
            return done[engine]

    return run


@pytest.mark.parametrize("engine", ENGINES)
def test_a_prefill_lost_mid_write_fails_the_request_and_its_pages_go_once_it_is_gone(lost, engine):
    decode = lost(engine)
    assert decode["landed_at_abort"] > 0, decode  # killed with its write half landed
    assert decode["failed_after_s"] < 20 and decode["status"] == 500, decode
    assert "unreachable (no heartbeat for 5.0s)" in decode["finished"]
    (release,) = decode["released"]
    assert release["fence"] is True, decode  # proven gone: no write of it can land
    assert decode["notified"] and decode["held"] == 1 and decode["last_answer"] is True
    # what was on its way at the kill may land; the write's second half never comes
    assert decode["landed_at_abort"] <= release["landed"] < decode["pairs"], decode
    assert decode["new_owner_intact"] and decode["landed_at_end"] == 0
    assert decode["forced_releases"] == 0 and decode["pending"] == 0
    assert not decode["in_node_at_end"]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_release_forced_by_sglangs_deadline_is_counted_and_the_receiver_leaves_later(releases, engine):
    _, decode = releases(engine)["forced"]
    (release,) = decode["released"]
    assert release["fence"] is False  # sglang's 0.3 s deadline, while prefill's write was in flight
    assert not decode["new_owner_intact"]  # what forcing gives up: the late write landed in them
    assert decode["forced_releases"] == 1
    (warning,) = decode["forced_warnings"]
    assert "at sglang's deferred-release deadline of 0.3s (" in warning and "TIMEOUT=0.3s)" in warning
    assert decode["unreleased_after_release"] == 1 and decode["in_node_after_release"]
    assert decode["unreleased_at_end"] == 0 and not decode["in_node_at_end"]  # once the fence lifted


@pytest.mark.parametrize("engine", ENGINES)
def test_deferral_turned_off_is_said_at_start_up_and_each_early_release_counted(releases, engine):
    _, decode = releases(engine)["off"]
    (startup,) = decode["startup_warnings"]
    assert "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE is off" in startup
    assert decode["held"] == 0
    (release,) = decode["released"]
    assert release["fence"] is False and decode["forced_releases"] == 1
    (warning,) = decode["forced_warnings"]
    assert "at once" in warning
    assert decode["unreleased_at_end"] == 0 and not decode["in_node_at_end"]


@pytest.mark.parametrize("engine", ENGINES)
def test_sglangs_checksum_flag_turns_on_dsa_bridges_checksums_on_both_sides(releases, engine):
    prefill, decode = releases(engine)["checksum-ok"]
    assert prefill["node_checksums"] and decode["manager_checksums"] and decode["node_checksums"]
    assert decode["poll"] == prefill["poll"] == 4
    assert decode["checksums_verified"] == prefill["checksums_computed"] > 0
    assert decode["forced_releases"] == 0 and not decode["in_node_at_end"]
    for other in ("held", "forced", "off"):  # without the flag: off on both sides
        prefill, decode = releases(engine)[other]
        assert not prefill["node_checksums"] and not decode["node_checksums"]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_corrupted_page_fails_the_request_as_sglangs_own_mismatch_does(releases, engine):
    prefill, decode = releases(engine)["checksum-bad"]
    assert "KV checksum mismatch" in decode["finished"] and "checksum mismatch: layer" in decode["finished"]
    assert decode["status"] == 500  # sglang's prepare_abort, INTERNAL_SERVER_ERROR
    (release,) = decode["released"]
    assert release["fence"] is True and decode["forced_releases"] == 0
    assert not decode["in_node_at_end"]  # prefill may have finished before decode verified
