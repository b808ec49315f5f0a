"""Per-phase deadlines inside sglang (``plugin/sglang/phases.py``, pure): each phase timed from its
own start with sglang's own variable, the reason naming the phase and the variable, and the node's
own deadline never before a phase's. The same deadlines inside real sglang processes:
``tests/sglang/test_sglang_phases.py``."""

from __future__ import annotations

import pytest

from dsa_bridge.plugin.sglang.phases import (
    BOOTSTRAP_ENV,
    BOOTSTRAPPING,
    DONE,
    PREFILLING,
    WAITING,
    WAITING_ENV,
    PhaseClock,
    PhaseLimits,
)

LIMITS = PhaseLimits(bootstrap_s=300.0, waiting_s=300.0)


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_bootstrapping_is_timed_from_creation_with_the_bootstrap_variable(side):
    clock = PhaseClock(side, LIMITS, now=1000.0)
    assert clock.phase == BOOTSTRAPPING and clock.expired(1299.9) is None
    reason = clock.expired(1300.0)
    assert reason.startswith(f"timed out after 300.0s bootstrapping ({side})")
    assert f"{BOOTSTRAP_ENV}=300s: raise it" in reason


@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_a_long_queue_wait_keeps_the_whole_waiting_bound(side):
    """290 s in sglang's queue, then 299 s of waiting: within both phases (a single deadline from
    creation, the old one, would have fired at 300 s)."""
    clock = PhaseClock(side, LIMITS, now=0.0)
    clock.advance(290.0)
    assert clock.phase == WAITING
    assert clock.expired(589.0) is None
    reason = clock.expired(590.0)
    assert f"300.0s waiting ({side})" in reason and f"{WAITING_ENV}=300s" in reason
    assert BOOTSTRAP_ENV not in reason


def test_advance_starts_the_waiting_phase_once():
    clock = PhaseClock("prefill", LIMITS, now=0.0)
    clock.advance(10.0)
    clock.advance(200.0)  # a later poll seeing the same phase: no new start
    assert clock.started == 10.0 and clock.expired(310.0) is not None


def test_a_finished_request_has_no_deadline():
    clock = PhaseClock("decode", LIMITS, now=0.0)
    clock.finish()
    assert clock.phase == DONE and clock.expired(1e9) is None
    clock.advance(5.0)  # nothing restarts a finished request
    assert clock.phase == DONE


def test_each_side_says_what_it_waited_for():
    prefill, decode = PhaseClock("prefill", LIMITS, 0.0), PhaseClock("decode", LIMITS, 0.0)
    assert "decode's pages did not arrive" in prefill.expired(300.0)
    assert "decode prealloc queue" in decode.expired(300.0)
    with pytest.raises(ValueError, match="side must be"):
        PhaseClock("router", LIMITS, 0.0)


@pytest.mark.parametrize(("bootstrap", "waiting"), [(300.0, 300.0), (2.0, 600.0), (600.0, 1.0)])
def test_the_node_deadline_comes_after_every_phase_deadline(bootstrap, waiting):
    """The node's request is made no earlier than the phases' clock starts; whatever the split
    between the phases, the last phase deadline is before the node's."""
    limits = PhaseLimits(bootstrap, waiting)
    node_deadline = 0.0 + limits.node_timeout_s
    for switch in (0.0, bootstrap / 2, bootstrap - 1e-3):
        clock = PhaseClock("decode", limits, now=0.0)
        clock.advance(switch)
        last = switch + waiting
        assert clock.expired(last) is not None and last < node_deadline


def test_prefill_complete_prefill_is_untimed_until_complete_then_bootstraps_from_there():
    """sglang's ``prefill_complete`` policy: the prefill times nothing before
    ``mark_prefill_complete`` (its queues and aborts end the request), then its bootstrap
    variable runs from the mark."""
    clock = PhaseClock("prefill", LIMITS, now=0.0, deferred=True)
    assert clock.phase == PREFILLING and clock.expired(10_000.0) is None
    clock.prefilled(10_000.0)
    assert clock.phase == BOOTSTRAPPING and clock.expired(10_299.9) is None
    assert "bootstrapping (prefill)" in clock.expired(10_300.0)
    clock.prefilled(10_200.0)  # once: a second call changes nothing
    assert clock.started == 10_000.0


def test_prefill_complete_decode_waits_for_the_prefill_within_the_waiting_variable():
    clock = PhaseClock("decode", LIMITS, now=0.0, deferred=True)
    assert clock.phase == PREFILLING and clock.expired(299.9) is None
    reason = clock.expired(300.0)
    assert reason.startswith("timed out after 300.0s prefilling (decode): the prefill did not "
                             "finish computing it")
    assert f"{WAITING_ENV}=300s" in reason
    clock.prefilled(250.0)  # the prefill was ready: its pages may be allocated from here
    assert clock.phase == BOOTSTRAPPING and clock.expired(549.9) is None
    clock.advance(260.0)
    assert clock.phase == WAITING and clock.expired(559.9) is None
