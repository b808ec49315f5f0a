"""Prefill and decode of different attention-TP widths, DP attention on either side, inside the
real sglang 0.5.23, every rank its own process (``width_rank.py``): sglang's own managers' rank
mapping for MLA pools, byte-exact on every decode rank.

- ``tp2-into-dp2``: a TP-2 prefill into a decode of two DP-attention ranks (attention TP 1 each,
  one request each): prefill rank 0 writes both requests, prefill rank 1 is told it has nothing
  to send and ends them writing nothing; sglang's MIN of the prefill ranks' polls is Success;
- ``tp1-into-tp2``: a TP-1 prefill into a TP-2 decode: the prefill rank writes the request to
  both decode ranks, each receiving every layer's KV and indexer and the aux slot once;
- ``dp2-into-tp2``: a prefill of two DP-attention ranks (attention TP 1) into a TP-2 decode: each
  request goes from its room's DP rank to both decode ranks; each decode rank connects a node
  to each prefill DP group, both over its one engine.

Widths that do not divide each other are refused by name (``pairing_problems``), and the
mapping is sglang's (``tp_targets``).
"""

from __future__ import annotations

import pytest

from tests.conftest import require_engine

from .conftest import SGLANG_MISSING
from .test_sglang_conn import config, free_port, run_ranks

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

from sglang.srt.disaggregation.common.conn import PrefillServerInfo  # noqa: E402

from dsa_bridge.plugin.sglang import bringup  # noqa: E402

MODEL = {"layers": 4, "model_layers": 4, "kv_cache_dim": 656, "pages": 12}
ENGINES = ["mooncake", "nixl"]
PATIENT = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "300", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "300"}
EVEN, ODD = 2**62 + 12344, 2**62 + 12345  # rooms of prefill DP rank 0 and 1 (follow_bootstrap_room)
FIRST = {"room": EVEN, "src_pages": [3, 1, 4, 5, 6], "dst_pages": [2, 7, 5, 6, 8], "src_aux": 3, "dst_aux": 5}
SECOND = {"room": ODD, "src_pages": [9, 2, 6, 10, 11], "dst_pages": [1, 3, 4, 9, 10], "src_aux": 1,
          "dst_aux": 2}
# name: ((tp_size, dp_size) of prefill, of decode, and each rank's requests, by global rank)
SCENARIOS = {
    "tp2-into-dp2": ((2, 1), (2, 2), [[FIRST, SECOND]] * 2, [[FIRST], [SECOND]]),
    "tp1-into-tp2": ((1, 1), (2, 1), [[FIRST]], [[FIRST]] * 2),
    "dp2-into-tp2": ((2, 2), (2, 1), [[FIRST], [SECOND]], [[FIRST, SECOND]] * 2),
}


def ranks_of(role: str, widths: tuple[int, int], requests: list[list[dict]], base: dict,
             port_of_group: dict) -> list[tuple[str, dict]]:
    tp_size, dp_size = widths
    attn_tp = tp_size // dp_size
    out = []
    for rank in range(tp_size):
        group = rank // attn_tp  # its attention-TP group: one gloo world each
        port = port_of_group.setdefault((role, group), free_port())
        out.append((role, {**base, "tp_size": tp_size, "dp_size": dp_size, "tp_rank": rank,
                           "world": attn_tp, "dist_rank": rank % attn_tp, "dist_port": port,
                           "requests": requests[rank]}))
    return out


@pytest.fixture(scope="module")
def widths():
    """(engine, scenario) -> each rank's result, prefill ranks first: one run of every rank's
    process per scenario, on first use."""
    done = {}

    def get(engine: str, scenario: str) -> list[dict]:
        if (engine, scenario) not in done:
            require_engine(engine)
            prefill, decode, prefill_requests, decode_requests = SCENARIOS[scenario]
            base, ports = config(engine, MODEL), {}
            ranks = (ranks_of("width-prefill", prefill, prefill_requests, base, ports)
                     + ranks_of("width-decode", decode, decode_requests, base, ports))
            results = run_ranks([(role, [cfg]) for role, cfg in ranks], env=PATIENT)
            done[(engine, scenario)] = [only for (only,) in results]
        return done[(engine, scenario)]

    return get


def exact(decode: dict) -> bool:
    """Every request of a decode rank Success, byte-exact on KV, indexer and aux slot, the rest of
    its pool untouched."""
    return (all(v == 4 for v in decode["verdicts"]) and decode["untouched"]
            and all(c["mismatched"] == [] and c["aux_exact"] for c in decode["compared"]))


@pytest.mark.parametrize("engine", ENGINES)
def test_a_tp2_prefill_into_two_dp_attention_decode_ranks(widths, engine):
    writer, idle, first, second = widths(engine, "tp2-into-dp2")
    assert exact(first) and exact(second), (first, second)
    assert first["groups"] == second["groups"] == [[1, 1, 1]]  # reads rank 0, tells rank 1
    assert writer["verdicts"] == idle["verdicts"] == [4, 4]  # sglang's MIN over both ranks
    assert idle["own"] == [4, 4] and idle["bytes"] == 0  # ended, writing nothing
    assert writer["bytes"] == first["compared"][0]["nbytes"] + second["compared"][0]["nbytes"]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_tp1_prefill_into_a_tp2_decode(widths, engine):
    prefill, first, second = widths(engine, "tp1-into-tp2")
    assert exact(first) and exact(second), (first, second)
    assert first["groups"] == second["groups"] == [[1, 0, 2]]  # one writer, two copies
    assert prefill["verdicts"] == [4]
    # each page once to each decode rank
    assert first["compared"][0]["nbytes"] == second["compared"][0]["nbytes"]
    assert prefill["bytes"] == 2 * first["compared"][0]["nbytes"]


@pytest.mark.parametrize("engine", ENGINES)
def test_two_dp_attention_prefill_ranks_into_a_tp2_decode(widths, engine):
    even, odd, first, second = widths(engine, "dp2-into-tp2")
    assert exact(first) and exact(second), (first, second)
    assert first["groups"] == second["groups"] == [[1, 0, 2], [1, 0, 2]]
    assert first["nodes"] == second["nodes"] == 2  # a node per prefill DP group...
    assert first["engines"] == second["engines"] == 1  # ...over the rank's one engine
    assert even["verdicts"] == odd["verdicts"] == [4]
    assert even["bytes"] == 2 * first["compared"][0]["nbytes"]  # its room to both decode ranks
    assert odd["bytes"] == 2 * first["compared"][1]["nbytes"]


@pytest.mark.parametrize(("decode_rank", "decode_tp", "prefill_tp", "expected"), [
    (0, 2, 2, (0, (), 1)),  # equal widths: rank r reads rank r
    (1, 2, 2, (1, (), 1)),
    (3, 4, 2, (1, (), 2)),  # decode wider: ranks 2 and 3 read prefill rank 1, which writes twice
    (0, 1, 4, (0, (1, 2, 3), 1)),  # prefill wider: rank 0 writes, 1..3 have nothing to send
    (1, 2, 8, (4, (5, 6, 7), 1)),
])
def test_tp_targets_are_sglangs_mapping_for_mla(decode_rank, decode_tp, prefill_tp, expected):
    targets = bringup.tp_targets(decode_rank, decode_tp, prefill_tp)
    assert (targets.source, targets.idle, targets.copies) == expected


def test_widths_that_do_not_divide_are_refused_by_name():
    info = PrefillServerInfo(attn_tp_size=3, attn_cp_size=1, dp_size=1, pp_size=1, page_size=64,
                             kv_cache_dtype="fp8_e4m3", follow_bootstrap_room=True,
                             kv_layout=bringup.KV_LAYOUT_MARK)
    (problem,) = bringup.pairing_problems(info, page_size=64, kv_cache_dtype="fp8_e4m3",
                                          attn_tp_size=2)
    assert "attention-TP widths: prefill 3, decode 2, neither a multiple of the other" in problem
    assert "--tp-size" in problem
    assert bringup.pairing_problems(info, page_size=64, kv_cache_dtype="fp8_e4m3",
                                    attn_tp_size=1) == []
