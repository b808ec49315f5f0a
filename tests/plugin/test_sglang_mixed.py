"""A mixed deployment's detection (``plugin/sglang/mixed.py``, pure): which bootstrap queries come
from a decode without dsa-bridge, counted every time and reported once per host. The deployment
itself, with sglang's own classes on one side: ``tests/sglang/test_sglang_mixed.py``."""

from __future__ import annotations

from urllib.parse import parse_qsl

from dsa_bridge.plugin.sglang.mixed import (
    DECODE_POLICY_MARK,
    ForeignDecodes,
    foreign_route_query,
    marked_route_query,
)

PARALLEL_INFO = "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"


def query(text: str) -> dict[str, str]:
    return dict(parse_qsl(text))


def test_sglangs_parallel_info_query_is_foreign_and_dsa_bridges_is_not():
    assert foreign_route_query(query(PARALLEL_INFO))  # what sglang's decode asks first
    assert not foreign_route_query(query(PARALLEL_INFO + marked_route_query()))  # dsa-bridge's
    assert foreign_route_query(query(PARALLEL_INFO + "&client=other"))


def test_a_rank_lookup_is_not_the_parallel_info_query():
    rank = "prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
    assert not foreign_route_query(query(rank))
    assert not foreign_route_query({})


def test_foreign_decodes_are_counted_each_time_and_reported_once_per_host():
    seen = ForeignDecodes()
    first = seen.record("10.0.0.7")
    assert "a decode at 10.0.0.7" in first
    assert "SGLANG_PLUGINS=dsa_bridge is not set on that decode server" in first
    assert seen.record("10.0.0.7") is None  # its other ranks, or a retry: counted, not logged
    assert seen.record("10.0.0.8") is not None
    assert seen.count == 3


def test_the_registered_policy_tells_sglangs_decode_what_to_set():
    # sglang's decode prints it as "...policy mismatch: prefill=<mark>, decode=early..."
    assert DECODE_POLICY_MARK.startswith("dsa-bridge")
    assert "set SGLANG_PLUGINS=dsa_bridge on the decode server too" in DECODE_POLICY_MARK
    assert DECODE_POLICY_MARK not in ("early", "prefill_complete")  # never equal to a real policy
