"""sglang's transfer tuning variables (``plugin/sglang/tuning.py``): its heartbeat honoured as the
nodes' peer timeout (sglang's floors and product), the variables dsa-bridge has no use for named
at start-up as ignored, once per rank, each with why; the pure reader alone, then a real
prefill manager over the real Mooncake engine: its node's liveness uses sglang's heartbeat.
"""

from __future__ import annotations

import logging

import pytest

from tests.conftest import require_engine

from .conftest import SGLANG_MISSING, published_context

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

from dsa_bridge.plugin.sglang.tuning import (  # noqa: E402
    PEER_TIMEOUT_S,
    heartbeat_line,
    ignored_lines,
    read_tuning,
)

from .test_sglang_conn_bringup import bootstrap_server, prefill_manager  # noqa: E402

INTERVAL, FAILURES = "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL", "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE"


@pytest.mark.parametrize("settings, timeout", [
    ({}, PEER_TIMEOUT_S),  # none set: dsa-bridge's own
    ({INTERVAL: 3.0}, 6.0),  # sglang's default failures (2)
    ({FAILURES: 4}, 20.0),  # sglang's default interval (5 s)
    ({INTERVAL: 0.5, FAILURES: 0}, 2.0),  # sglang's floors: 2 s, 1 failure
])
def test_sglangs_heartbeat_is_the_peer_timeout_as_sglang_counts_it(settings, timeout):
    tuning = read_tuning(settings)
    assert tuning.peer_timeout_s == timeout and tuning.heartbeat_s == 0.5
    assert tuning.heartbeat_from_sglang == bool(settings) and tuning.ignored == ()
    assert f"dead after {timeout:g}s" in heartbeat_line(tuning)


def test_the_variables_without_meaning_here_are_named_with_why():
    tuning = read_tuning({"SGLANG_DISAGGREGATION_THREAD_POOL_SIZE": 8,
                          "SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES": 64})
    lines = ignored_lines(tuning)
    assert len(lines) == 2 and tuning.peer_timeout_s == PEER_TIMEOUT_S
    assert lines[0].startswith("SGLANG_DISAGGREGATION_THREAD_POOL_SIZE=8 is ignored: ")
    assert lines[1].startswith("SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES=64 is ignored: ")


def test_a_prefill_rank_honours_the_heartbeat_and_names_the_ignored_once(monkeypatch, caplog):
    require_engine("mooncake")
    monkeypatch.setenv("SGLANG_HOST_IP", "127.0.0.1")
    monkeypatch.setenv(INTERVAL, "3")
    monkeypatch.setenv(FAILURES, "3")
    monkeypatch.setenv("SGLANG_DISAGGREGATION_QUEUE_SIZE", "2")
    with (bootstrap_server() as port,
          published_context(disaggregation_mode="prefill", disaggregation_transfer_backend="mooncake",
                            disaggregation_bootstrap_port=port, host="127.0.0.1") as sa):
        with caplog.at_level(logging.INFO, logger="dsa_bridge.plugin.sglang"):
            manager = prefill_manager(sa)
        try:
            assert manager.node._liveness.peer_timeout_s == 9.0  # the node's own liveness
            assert manager.decode_nodes.peer_timeout_s == 9.0
            said = [r.getMessage() for r in caplog.records]
            ignored = [line for line in said if "is ignored" in line]
            assert ignored == [next(line for line in said if "QUEUE_SIZE=2" in line)]
            assert sum("a silent peer is dead after 9s (sglang's heartbeat" in line for line in said) == 1
        finally:
            manager.shutdown()
