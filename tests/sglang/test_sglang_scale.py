"""Past two ranks a side, inside the real sglang 0.5.23: four prefill and four decode processes,
each an sglang scheduler rank through sglang's own queues (``scale_rank.py``), serve in turn, on
both engines, byte-exact on every layer's KV and indexer and the aux slot on every decode rank:

- ``tp4-into-dp4``: a TP-4 prefill into a decode of four DP-attention ranks (attention TP 1
  each, one request each): prefill rank 0 writes all four requests, ranks 1-3 (other bytes in
  their pools) are told they have nothing to send; sglang's MIN over the four prefill ranks;
- ``tp2pp2-into-tp4``: a prefill of two pipeline stages of TP 2 into a TP-4 decode: decode
  ranks ``2k`` and ``2k+1`` read prefill TP rank ``k`` of both stages, each stage writing its
  two layers, the last stage the aux slot; the stages' bootstrap through sglang's
  ``poll_and_all_reduce_prefill_pp`` over its pipeline ``GroupCoordinator``;
- ``two-prefills-into-tp1``: two prefill servers (each its own bootstrap server and bytes) into
  one decode rank, a request from each, over the rank's one engine.

The process set is made once for the module (sglang's import is most of a rank's start): the
three deployments and two engines are its six scenarios. Every serving rank also reports its
cost (threads and sockets it added, its manager's start), which the last test bounds and prints
(the per-rank figures of docs/sglang.md).
"""

from __future__ import annotations

import pytest

from tests.conftest import require_engine

from .conftest import SGLANG_MISSING
from .test_sglang_conn import free_port, run_ranks

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

ENGINES = ["mooncake", "nixl"]
SIDE = 4  # processes a side
MODEL = {"layers": 4, "model_layers": 4, "kv_cache_dim": 656, "pages": 12, "seed": 7}
PAGE = 64 * (656 + 132)  # one page of one layer: KV and indexer
ROOM = 2**62 + 4096
REQUESTS = [  # a request of each decode DP rank in tp4-into-dp4; the first two elsewhere too
    {"room": ROOM, "src_pages": [3, 1, 4, 5, 6], "dst_pages": [2, 7, 5, 6, 8], "src_aux": 3, "dst_aux": 5},
    {"room": ROOM + 1, "src_pages": [9, 2, 6, 10, 11], "dst_pages": [1, 3, 4, 9, 10], "src_aux": 1,
     "dst_aux": 2},
    {"room": ROOM + 2, "src_pages": [12, 8, 7, 1, 2], "dst_pages": [11, 12, 1, 2, 3], "src_aux": 6,
     "dst_aux": 7},
    {"room": ROOM + 3, "src_pages": [5, 6, 7, 8, 9], "dst_pages": [4, 5, 6, 7, 8], "src_aux": 0,
     "dst_aux": 1},
]
SINGLES = [[r] for r in range(SIDE)]
TOPOLOGIES = ["tp4-into-dp4", "tp2pp2-into-tp4", "two-prefills-into-tp1"]


def scenario(topology: str, engine: str) -> tuple[list[dict], list[dict]]:
    """Each prefill process's and each decode process's configuration of one scenario."""
    port = free_port()
    if topology == "tp4-into-dp4":
        requests = [{**r, "port": port, "seed": MODEL["seed"]} for r in REQUESTS]
        prefill = [{"serves": True, "tp_size": 4, "tp_rank": i, "writes": i == 0, "port": port,
                    "tp_groups": [list(range(SIDE))], "requests": requests} for i in range(SIDE)]
        decode = [{"serves": True, "tp_size": 4, "dp_size": 4, "tp_rank": j, "tp_groups": SINGLES,
                   "requests": [requests[j]]} for j in range(SIDE)]
    elif topology == "tp2pp2-into-tp4":
        request = {**REQUESTS[0], "port": port, "seed": MODEL["seed"]}
        prefill = [{"serves": True, "tp_size": 2, "tp_rank": i % 2, "pp_size": 2, "pp_rank": i // 2,
                    "layers": 2, "start_layer": 2 * (i // 2), "writes": True, "port": port,
                    "tp_groups": [[0, 1], [2, 3]], "pp_groups": [[0, 2], [1, 3]],
                    "requests": [request]} for i in range(SIDE)]
        decode = [{"serves": True, "tp_size": 4, "tp_rank": j, "tp_groups": [list(range(SIDE))],
                   "requests": [request]} for j in range(SIDE)]
    else:  # two prefill servers, each with its own port and bytes
        ports = [port, free_port()]
        requests = [{**REQUESTS[k], "port": ports[k], "seed": MODEL["seed"] + 2 * k} for k in (0, 1)]
        prefill = [{"serves": i < 2, "tp_size": 1, "tp_rank": 0, "writes": True,
                    "port": ports[min(i, 1)], "seed": MODEL["seed"] + 2 * min(i, 1),
                    "tp_groups": SINGLES, "requests": [requests[min(i, 1)]]} for i in range(SIDE)]
        decode = [{"serves": j == 0, "tp_size": 1, "tp_rank": 0, "tp_groups": SINGLES,
                   "requests": requests} for j in range(SIDE)]
    return prefill, decode


@pytest.fixture(scope="module")
def scaled():
    """(topology, engine) -> (prefill results, decode results), each by process: the module's
    one process set, on first use."""
    done: dict = {}

    def get(topology: str, engine: str) -> tuple[list[dict], list[dict]]:
        if not done:
            for name in ENGINES:
                require_engine(name)
            runs = [(t, e) for e in ENGINES for t in TOPOLOGIES]
            ports = {"scale-prefill": free_port(), "scale-decode": free_port()}
            per_process = {role: [[] for _ in range(SIDE)] for role in ports}
            for t, e in runs:
                for role, cfgs in zip(ports, scenario(t, e), strict=True):
                    for i, cfg in enumerate(cfgs):
                        per_process[role][i].append(
                            {**MODEL, "engine": e, "port": 0, **cfg, "side_port": ports[role],
                             "side_rank": i, "side_size": SIDE})
            results = run_ranks([(role, cfgs) for role in ports for cfgs in per_process[role]],
                                module="tests.sglang.scale_rank", timeout_s=560)
            prefills, decodes = results[:SIDE], results[SIDE:]
            for k, run in enumerate(runs):
                done[run] = ([p[k] for p in prefills], [d[k] for d in decodes])
        return done[(topology, engine)]

    return get


def exact(decode: dict) -> bool:
    return (all(v == 4 for v in decode["verdicts"]) and decode["untouched"]
            and all(c["mismatched"] == [] and c["aux_exact"] for c in decode["compared"]))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine", ENGINES)
def test_a_tp4_prefill_into_four_dp_attention_decode_ranks(scaled, engine):
    prefills, decodes = scaled("tp4-into-dp4", engine)
    for decode in decodes:
        assert exact(decode), (decode["reasons"], decode["compared"])
        assert decode["groups"] == [[1, 3, 1]]  # reads prefill rank 0, tells ranks 1-3
        assert decode["peers"] == [[prefills[0]["endpoint"]]]
    assert all(p["verdicts"] == [4, 4, 4, 4] for p in prefills)  # sglang's MIN over the four
    nbytes = [d["compared"][0]["nbytes"] for d in decodes]
    assert nbytes[0] == 5 * 4 * PAGE + decodes[0]["compared"][0]["aux_bytes"]
    assert prefills[0]["bytes"] == sum(nbytes)
    assert [p["bytes"] for p in prefills[1:]] == [0, 0, 0]  # told, writing nothing


@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine", ENGINES)
def test_a_tp2_pp2_prefill_into_a_tp4_decode(scaled, engine):
    prefills, decodes = scaled("tp2pp2-into-tp4", engine)
    for j, decode in enumerate(decodes):
        assert exact(decode), (decode["reasons"], decode["compared"])
        # prefill TP rank j // 2 of both stages (processes j // 2 and 2 + j // 2)
        assert decode["peers"] == [[prefills[j // 2]["endpoint"], prefills[2 + j // 2]["endpoint"]]]
        assert decode["compared"][0]["stages"] == 2
    assert [p["layers"] for p in prefills] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert all(p["verdicts"] == [4] for p in prefills)
    aux = decodes[0]["compared"][0]["aux_bytes"]
    # each its stage's two layers, twice (two decode ranks); the last stage the aux slot too
    assert [p["bytes"] for p in prefills] == [2 * 5 * 2 * PAGE] * 2 + [2 * (5 * 2 * PAGE + aux)] * 2
    assert decodes[0]["compared"][0]["nbytes"] == 5 * 4 * PAGE + aux


@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine", ENGINES)
def test_two_prefill_servers_into_one_decode_rank(scaled, engine):
    prefills, decodes = scaled("two-prefills-into-tp1", engine)
    decode = decodes[0]
    assert exact(decode), (decode["reasons"], decode["compared"])  # each from its own prefill's bytes
    assert decode["peers"] == [[prefills[0]["endpoint"]], [prefills[1]["endpoint"]]]
    assert decode["nodes"] == 2  # a node per prefill server, over the rank's one engine
    assert [p["bytes"] for p in prefills[:2]] == [c["nbytes"] for c in decode["compared"]]
    assert [p.get("idle") for p in prefills[2:] + decodes[1:]] == [True] * 5


@pytest.mark.timeout(600)
def test_per_rank_cost_does_not_grow_with_the_width(scaled):
    """What a rank adds (threads, sockets, its manager's start) at 1, 2 and 4 ranks a side: a
    rank's threads stay few whatever the width, ranks of one role cost the same, and a writing
    prefill rank's sockets grow by a few per decode rank it writes to. Printed with ``-s``, the
    per-rank figures of docs/sglang.md."""
    cost = {(t, e, side, i): r["cost"] for e in ENGINES for t in TOPOLOGIES
            for side, results in zip(("prefill", "decode"), scaled(t, e), strict=True)
            for i, r in enumerate(results) if not r.get("idle")}
    print("\nengine    deployment             side     rank  start_s  threads  sockets")
    for (t, e, side, i), c in sorted(cost.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"{e:9} {t:22} {side:8} {i:4}  {c['start_s']:7.3f}  {c['threads']:7}  {c['sockets']:7}")
    for (t, e, side, i), c in cost.items():
        assert c["threads"] <= 24 and c["start_s"] < 30, (t, e, side, i, c)
    for e in ENGINES:
        same = [[("tp4-into-dp4", e, "decode", j) for j in range(SIDE)],  # one request each
                [("tp4-into-dp4", e, "prefill", i) for i in (1, 2, 3)],  # told, writing nothing
                [("tp2pp2-into-tp4", e, "decode", j) for j in range(SIDE)]]
        for ranks in same:
            threads = {cost[k]["threads"] for k in ranks}
            sockets = {cost[k]["sockets"] for k in ranks}
            assert max(threads) - min(threads) <= 2 and max(sockets) - min(sockets) <= 2, (ranks, cost)
        # a writer to four decode ranks against one to a single decode rank
        grown = cost[("tp4-into-dp4", e, "prefill", 0)]["sockets"] - cost[
            ("two-prefills-into-tp1", e, "prefill", 0)]["sockets"]
        assert grown <= 3 * 10, (e, grown)
