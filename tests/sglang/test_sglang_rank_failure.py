"""Inside sglang, a failure on one TP rank stops every rank's transfer of that request before sglang
frees its pages, and no page is read before the forward writing it finished (early send).

Real sglang 0.5.23, every rank its own process (``tp_rank.py``, on ``pd_rank.py``):

- two prefill TP ranks and two decode TP ranks, one request over both: prefill rank 0's write
  fails (``tests/faulty.py``), prefill rank 1's write is held in flight. sglang's own MIN-reduced
  polls (``poll_and_all_reduce`` on prefill; ``DecodeTransferQueue.pop_transferred`` and
  ``resolve_deferred_releases`` on decode, over gloo groups) fail the request on every rank;
  ``failure_exception`` on the ranks whose own transfer had not failed stops it (prefill rank 1:
  Failed at once, its second chunk never written; decode rank 1: Aborted), and decode rank 1's
  pages are held until no write can land, then given to a new owner whose bytes stay intact;
- an early send (sglang's ``_early_send_wait_event``) while the forward writing its pages still
  runs: nothing read until the event completes, decode gets the forward's bytes, never the
  previous ones, and sglang's ``send`` calls return at once; an event that never completes fails
  the request at the deadline with the reason, decode's pages untouched.
"""

from __future__ import annotations

import pytest

from .conftest import SGLANG_MISSING
from .test_sglang_conn import config, free_port, run_ranks, scenarios_per_engine

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

MODEL = {"layers": 4, "model_layers": 4, "kv_cache_dim": 656}
ENGINES = ["mooncake", "nixl"]
ANOTHER_RANK = "another TP rank's transfer of this request failed"


# a loaded host may take minutes to start a rank: no request times out meanwhile
PATIENT = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "300", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "300"}


HOLD = {"DSA_BRIDGE_FAULT_WRITE_DELAY_MS": "3000"}  # every write: half lands, then 3 s, then the rest
SCENARIOS = {  # name: (prefill rank 0's fault and abort, prefill rank 1's fault)
    # prefill rank 0 aborted by sglang while both ranks' writes are in flight: decode hears of it
    # only when the writes end, so prefill rank 1 is stopped by its own failure_exception
    "prefill": (HOLD, True, HOLD),
    # prefill rank 1's write in flight, then prefill rank 0's write fails (decode rank 0 hears at once)
    "decode": ({"DSA_BRIDGE_FAULT_WRITE_EVERY": "1"}, False, HOLD),
}


def prefill_config(cfg: dict, rank: int, dist_port: int, scenario: str) -> dict:
    first_fault, aborted, second_fault = SCENARIOS[scenario]
    return {**cfg, "tp_rank": rank, "dist_port": dist_port,
            "fault": first_fault if rank == 0 else second_fault,
            "abort": rank == 0 and aborted, "late": rank == 0 and not aborted}


@pytest.fixture(scope="module")
def rank_failure():
    """engine -> {scenario: (prefill rank 0, prefill rank 1, decode rank 0, decode rank 1)}, four
    processes per engine running the scenarios in turn."""

    def run(engine: str) -> dict:
        cfgs = {name: config(engine, MODEL, tp_size=2, grace_s=1.0, write_window_s=2.0, linger_s=1.0)
                for name in SCENARIOS}
        prefill_port, decode_port = free_port(), free_port()
        ranks = [("tp-prefill", [prefill_config(cfg, r, prefill_port, name) for name, cfg in cfgs.items()])
                 for r in (0, 1)]
        ranks += [("tp-decode", [{**cfg, "tp_rank": r, "dist_port": decode_port} for cfg in cfgs.values()])
                  for r in (0, 1)]
        return run_ranks(ranks, env=PATIENT)

    return scenarios_per_engine(run, SCENARIOS)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_failure_on_one_prefill_rank_stops_the_other_ranks_transfer(rank_failure, engine):
    failed, other, _, second = rank_failure(engine)["prefill"]
    assert failed["verdict"] == other["verdict"] == 0, other  # sglang's MIN of the ranks' polls: Failed
    assert failed["reason"] == "aborted by sglang"
    assert other["own_at_verdict"] in (2, 3)  # its own transfer was still running...
    assert ANOTHER_RANK in other["exception"] and other["from_another_rank"]
    assert other["own_after_failure_exception"] == 0, other  # ...and failure_exception stopped it
    assert other["writes"] == 1, other  # the write in flight finished; the second chunk was never written
    page_bytes = 64 * 4 * (656 + 132)
    assert 0 < other["bytes"] < 5 * page_bytes, other  # not the request's 5 pages
    assert ANOTHER_RANK in second["finished"]  # decode rank 1 failed with prefill rank 1's reason
    assert second["new_owner_intact"] and second["released"][0]["fence"] is True


@pytest.mark.parametrize("engine", ENGINES)
def test_the_other_decode_rank_is_stopped_and_its_pages_held_until_no_write_can_land(rank_failure, engine):
    failed, other, first, second = rank_failure(engine)["decode"]
    assert "injected failure" in failed["reason"]
    assert other["verdict"] == 0 and other["own_after_failure_exception"] == 0 and other["writes"] == 1
    for rank in (first, second):
        (release,) = rank["released"]
        assert rank["held"] == 1 and release["fence"] is True  # held by sglang until the fence lifted
        assert rank["new_owner_intact"] and rank["landed_at_end"] == 0  # nothing landed after release
        assert rank["forced_releases"] == 0 and rank["unreleased_at_end"] == 0
    assert "injected failure" in first["finished"]
    assert ANOTHER_RANK in second["finished"]  # stopped: by its own failure_exception or its prefill's
    assert second["answers_false"] > 0 and second["last_answer"] is True, second  # held while the write ran
    assert 0 < second["released"][0]["landed"] < second["total"], second  # the write in flight, no more


@pytest.fixture(scope="module")
def early_sends():
    """engine -> {"ok": (prefill, decode), "never": (prefill, decode)}."""

    def run(engine: str) -> dict:
        cfgs = [config(engine, MODEL, forward_s=1.0),
                config(engine, MODEL, forward_s=0.5, never=True, wait_s=1.5)]
        return run_ranks([("early-prefill", cfgs), ("decode", cfgs)], env=PATIENT)

    return scenarios_per_engine(run, ["ok", "never"])


@pytest.mark.parametrize("engine", ENGINES)
def test_an_early_send_reads_its_pages_only_once_the_forward_wrote_them(early_sends, engine):
    prefill, decode = early_sends(engine)["ok"]
    assert prefill["send_seconds"] < 0.5, prefill  # sglang's scheduler thread never waited
    assert prefill["bytes_before_forward_done"] == 0, prefill
    assert prefill["poll_before_forward_done"] in (2, 3), prefill
    assert prefill["queries"] > 0, prefill  # the event was asked, from dsa-bridge's thread
    assert prefill["poll"] == decode["poll"] == 4
    assert decode["mismatched"] == [] and decode["others_sentinel"] and decode["aux_exact"]


@pytest.mark.parametrize("engine", ENGINES)
def test_an_early_send_whose_forward_never_finishes_fails_at_the_deadline(early_sends, engine):
    prefill, decode = early_sends(engine)["never"]
    assert prefill["poll"] == decode["poll"] == 0
    assert "had not finished 1.5s after sglang's early send" in prefill["reason"]
    assert "_early_send_wait_event" in prefill["reason"]
    assert prefill["bytes"] == 0 and decode["nbytes"] == 0  # nothing was read or written
