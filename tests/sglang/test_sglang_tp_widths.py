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
  to each prefill DP group, both over its one engine;
- ``cp2-into-tp1``: a prefill of two attention-CP ranks (``--tp 2 --attn-cp-size 2``: attention
  TP 1) into one decode rank: CP rank 0 writes the request, CP rank 1 is sglang's dummy sender
  (Success at its last chunk, writing nothing), which decode never connects to; both CP ranks
  registered with the bootstrap server;
- ``cp2-layer-split-into-tp1``: the same with ``--enable-dsa-cache-layer-split`` (sglang's own
  ``LayerSplitDSATokenToKVPool``, Mooncake only, as sglang allows it): each CP rank writes its own
  layers, the one with the last layer the aux slot, as pipeline stages do.

- ``cp2-sharded-into-tp1``: a KV-sharded prefill (``--enable-kv-cache-sharding``, sglang's own
  ``PageInterleaveDSATokenToKVPool`` on each rank) of two attention-CP ranks, the shard group
  sglang allows for DSA pools, into one decode rank: decode reads both CP ranks, each writing
  its shard of the pages (one rank's last chunk empty); ``cp2-sharded-mtp-into-tp1`` the same
  with a draft model, whose pool sglang shards alike;
- ``tp2-sharded-into-tp2``: the same sharded over attention TP (sglang's shard group without CP,
  which sglang refuses for DSA pools but serves for other MLA pools) into a TP-2 decode;
- ``cp2-page-split-into-tp1``: ``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1`` on the prefill
  (decode follows its registration): each prefill CP rank writes its contiguous share of the
  pages; ``cp2-into-tp1-with-split-variable``: the variable on decode only changes nothing.

The modes refused (CP-TP group sharing; CP or KV sharding on decode; a sharded prefill into
another attention-TP width) are refused by name at start-up and, from the prefill's parallel
info, by decode (``cp_problems``, ``pairing_problems``); the shares are sglang's own filters'.

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
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool as SGLangPool  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

from dsa_bridge.plugin.sglang import bringup  # noqa: E402
from dsa_bridge.plugin.sglang.manager import DSABridgeKVManager  # noqa: E402
from dsa_bridge.plugin.sglang.mixed import (  # noqa: E402
    CP_PAGE_SPLIT_MARK,
    KV_LAYOUT_MARK,
    layout_mark,
)

from .conftest import published_context  # noqa: E402
from .test_sglang_conn import DSV32, kv_args_of  # noqa: E402

MODEL = {"layers": 4, "model_layers": 4, "kv_cache_dim": 656, "pages": 12}
ENGINES = ["mooncake", "nixl"]
PATIENT = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "300", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "300"}
EVEN, ODD = 2**62 + 12344, 2**62 + 12345  # rooms of prefill DP rank 0 and 1 (follow_bootstrap_room)
FIRST = {"room": EVEN, "src_pages": [3, 1, 4, 5, 6], "dst_pages": [2, 7, 5, 6, 8], "src_aux": 3, "dst_aux": 5}
SECOND = {"room": ODD, "src_pages": [9, 2, 6, 10, 11], "dst_pages": [1, 3, 4, 9, 10], "src_aux": 1,
          "dst_aux": 2}
# logical pages 7, 9, 11, 5 on shard rank 1, 2 on rank 0 (which owns none of the second chunk)
SHARDED = {**FIRST, "src_pages": [7, 2, 9, 11, 5], "split": "kv-sharding"}
CP_SPLIT = {**FIRST, "split": "cp"}  # pages 0-2 from CP rank 0, 3-4 from CP rank 1
# name: ((tp_size, dp_size) of prefill, of decode, and each rank's requests, by global rank)
SCENARIOS = {
    "tp2-into-dp2": ((2, 1), (2, 2), [[FIRST, SECOND]] * 2, [[FIRST], [SECOND]]),
    "tp1-into-tp2": ((1, 1), (2, 1), [[FIRST]], [[FIRST]] * 2),
    "dp2-into-tp2": ((2, 2), (2, 1), [[FIRST], [SECOND]], [[FIRST, SECOND]] * 2),
    "cp2-into-tp1": ((2, 1, 2), (1, 1), [[FIRST]] * 2, [[FIRST]]),  # (tp, dp, attention CP)
    # (and what the prefill ranks' configurations add)
    "cp2-layer-split-into-tp1": ((2, 1, 2), (1, 1), [[FIRST]] * 2, [[FIRST]], {"layer_split": True}),
    # (and what the decode ranks' configurations add)
    "tp2-sharded-into-tp2": ((2, 1), (2, 1), [[SHARDED]] * 2, [[SHARDED]] * 2, {"sharded": True}),
    "cp2-sharded-into-tp1": ((2, 1, 2), (1, 1), [[SHARDED]] * 2, [[SHARDED]], {"sharded": True}),
    # with a draft model (MTP), its pool sharded alike on prefill, whole on decode
    "cp2-sharded-mtp-into-tp1": ((2, 1, 2), (1, 1), [[SHARDED]] * 2, [[SHARDED]],
                                 {"sharded": True, "draft_layers": 1}, {"draft_layers": 1}),
    "cp2-page-split-into-tp1": ((2, 1, 2), (1, 1), [[CP_SPLIT]] * 2, [[CP_SPLIT]],
                                {"all_cp_ranks": True}),
    # the variable on decode only: decode follows the prefill's registration
    "cp2-into-tp1-with-split-variable": ((2, 1, 2), (1, 1), [[FIRST]] * 2, [[FIRST]], {},
                                         {"all_cp_ranks": True}),
}


def ranks_of(role: str, widths: tuple[int, ...], requests: list[list[dict]], base: dict,
             port_of_group: dict) -> list[tuple[str, dict]]:
    tp_size, dp_size, cp_size = (*widths, 1)[:3]
    world = tp_size // dp_size  # a DP group: attention TP x CP
    out = []
    for rank in range(tp_size):
        group = rank // world  # its DP group: one gloo world each
        port = port_of_group.setdefault((role, group), free_port())
        out.append((role, {**base, "tp_size": tp_size, "dp_size": dp_size, "cp_size": cp_size,
                           "tp_rank": rank, "world": world, "dist_rank": rank % world,
                           "dist_port": port, "requests": requests[rank]}))
    return out


@pytest.fixture(scope="module")
def widths():
    """(engine, scenario) -> each rank's result, prefill ranks first: one run of every rank's
    process per scenario, on first use."""
    done = {}

    def get(engine: str, scenario: str) -> list[dict]:
        if (engine, scenario) not in done:
            require_engine(engine)
            prefill, decode, prefill_requests, decode_requests, *extra = SCENARIOS[scenario]
            prefill_extra, decode_extra = (*extra, {}, {})[:2]
            base, ports = config(engine, MODEL), {}
            ranks = (ranks_of("width-prefill", prefill, prefill_requests, {**base, **prefill_extra},
                              ports)
                     + ranks_of("width-decode", decode, decode_requests, {**base, **decode_extra},
                                ports))
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
    assert first["groups"] == second["groups"] == [[1, 1, 1, False]]  # reads rank 0, tells rank 1
    assert writer["verdicts"] == idle["verdicts"] == [4, 4]  # sglang's MIN over both ranks
    assert idle["own"] == [4, 4] and idle["bytes"] == 0  # ended, writing nothing
    assert writer["bytes"] == first["compared"][0]["nbytes"] + second["compared"][0]["nbytes"]


@pytest.mark.parametrize("engine", ENGINES)
def test_a_tp1_prefill_into_a_tp2_decode(widths, engine):
    prefill, first, second = widths(engine, "tp1-into-tp2")
    assert exact(first) and exact(second), (first, second)
    assert first["groups"] == second["groups"] == [[1, 0, 2, False]]  # one writer, two copies
    assert prefill["verdicts"] == [4]
    # each page once to each decode rank
    assert first["compared"][0]["nbytes"] == second["compared"][0]["nbytes"]
    assert prefill["bytes"] == 2 * first["compared"][0]["nbytes"]


@pytest.mark.parametrize("engine", ENGINES)
def test_two_dp_attention_prefill_ranks_into_a_tp2_decode(widths, engine):
    even, odd, first, second = widths(engine, "dp2-into-tp2")
    assert exact(first) and exact(second), (first, second)
    assert first["groups"] == second["groups"] == [[1, 0, 2, False], [1, 0, 2, False]]
    assert first["nodes"] == second["nodes"] == 2  # a node per prefill DP group...
    assert first["engines"] == second["engines"] == 1  # ...over the rank's one engine
    assert even["verdicts"] == odd["verdicts"] == [4]
    assert even["bytes"] == 2 * first["compared"][0]["nbytes"]  # its room to both decode ranks
    assert odd["bytes"] == 2 * first["compared"][1]["nbytes"]


@pytest.mark.parametrize("engine", ENGINES)
def test_an_attention_cp2_prefill_into_one_decode_rank(widths, engine):
    writer, dummy, decode = widths(engine, "cp2-into-tp1")
    assert exact(decode), decode
    assert (writer["dummy"], dummy["dummy"]) == (False, True)
    assert decode["cp_routes"] == [writer["endpoint"], dummy["endpoint"]]  # both CP ranks registered
    assert decode["groups"] == [[1, 0, 1, False]]  # one writer, nothing to tell, one copy
    assert decode["peers"] == [[writer["endpoint"]]]  # CP rank 0 only...
    assert dummy["handshakes"] == 0 and dummy["bytes"] == 0  # ...CP rank 1 never contacted
    assert writer["verdicts"] == dummy["verdicts"] == [4]  # sglang's MIN over the CP group
    assert dummy["own"] == [4]  # the dummy's own poll: Success at its last chunk
    assert writer["handshakes"] >= 1 and writer["bytes"] == decode["compared"][0]["nbytes"]
    assert decode["verifies_checksums"]  # CP rank 0's digest covers every layer it wrote


def test_a_layer_split_attention_cp2_prefill_into_one_decode_rank(widths):
    first, second, decode = widths("mooncake", "cp2-layer-split-into-tp1")
    assert exact(decode), decode
    assert (first["dummy"], second["dummy"]) == (False, False)
    assert (first["layers"], second["layers"]) == ([0, 1], [2, 3])  # sglang's layer_shard_start
    assert decode["groups"] == [[2, 0, 1, False]]  # both CP ranks write, as two pipeline stages
    assert decode["peers"] == [[first["endpoint"], second["endpoint"]]]
    assert first["verdicts"] == second["verdicts"] == [4]
    two_layers = len(FIRST["src_pages"]) * 64 * (656 + 132) * 2
    assert first["bytes"] == two_layers  # no aux: the rank without the last layer
    assert second["bytes"] == two_layers + decode["compared"][0]["aux_bytes"]
    assert first["bytes"] + second["bytes"] == decode["compared"][0]["nbytes"]
    assert not decode["verifies_checksums"]  # the aux slot's digest: the last CP rank's layers only


@pytest.mark.parametrize("engine", ENGINES)
def test_a_kv_sharded_tp2_prefill_into_a_tp2_decode(widths, engine):
    """sglang's own ``PageInterleaveDSATokenToKVPool`` on each prefill rank: every decode rank
    reads both prefill ranks, each writing its shard of the pages (rank 0 none of the second
    chunk: its last chunk empty), every page once, the aux slot from rank 0."""
    shard0, shard1, first, second = widths(engine, "tp2-sharded-into-tp2")
    assert exact(first) and exact(second), (first["reasons"], second["reasons"], shard0, shard1)
    assert first["groups"] == second["groups"] == [[2, 0, 2, True]]  # both write a share to both
    assert first["peers"] == second["peers"] == [[shard0["endpoint"], shard1["endpoint"]]]
    assert shard0["verdicts"] == shard1["verdicts"] == [4]
    page = 64 * (656 + 132) * MODEL["layers"]
    aux = first["compared"][0]["aux_bytes"]
    assert first["compared"][0]["nbytes"] == 5 * page + aux
    assert shard0["bytes"] == 2 * (1 * page + aux)  # its one page (and the aux) to each decode rank
    assert shard1["bytes"] == 2 * 4 * page


@pytest.mark.parametrize("engine", ENGINES)
def test_a_kv_sharded_attention_cp2_prefill_into_one_decode_rank(widths, engine):
    """The shape sglang allows KV sharding in for DSA pools (prefill CP above 1): the shard group
    is the CP group, and decode reads both CP ranks as share writers."""
    shard0, shard1, decode = widths(engine, "cp2-sharded-into-tp1")
    assert exact(decode), decode
    assert (shard0["dummy"], shard1["dummy"]) == (False, False)
    assert decode["groups"] == [[2, 0, 1, True]]
    assert decode["peers"] == [[shard0["endpoint"], shard1["endpoint"]]]
    page = 64 * (656 + 132) * MODEL["layers"]
    assert shard0["bytes"] == 1 * page + decode["compared"][0]["aux_bytes"]
    assert shard1["bytes"] == 4 * page
    assert shard0["verdicts"] == shard1["verdicts"] == [4]


def test_a_kv_sharded_prefill_with_a_draft_model_writes_the_drafts_shares_too(widths):
    """KV sharding with a draft model (GLM-5's NextN): sglang shards the draft's pool as the
    target's, so each CP rank writes its share of the draft layer's pages as of every other."""
    shard0, shard1, decode = widths("mooncake", "cp2-sharded-mtp-into-tp1")
    assert exact(decode), decode
    assert shard0["layers"] == shard1["layers"] == [0, 1, 2, 3, 4]  # the draft's: layer 4
    assert "kv:4" in decode["compared"][0]["buffers"]
    page = 64 * (656 + 132) * (MODEL["layers"] + 1)
    assert shard0["bytes"] == 1 * page + decode["compared"][0]["aux_bytes"]
    assert shard1["bytes"] == 4 * page


@pytest.mark.parametrize("engine", ENGINES)
def test_an_attention_cp2_prefill_splitting_pages_into_one_decode_rank(widths, engine):
    """``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1`` on the prefill (not on decode, which
    follows the prefill's registration): each prefill CP rank writes its contiguous share of the
    pages (pages 0-2 and 3-4), none a dummy."""
    first, second, decode = widths(engine, "cp2-page-split-into-tp1")
    assert exact(decode), decode
    assert (first["dummy"], second["dummy"]) == (False, False)
    assert decode["groups"] == [[2, 0, 1, True]]
    page = 64 * (656 + 132) * MODEL["layers"]
    assert first["bytes"] == 3 * page + decode["compared"][0]["aux_bytes"]
    assert second["bytes"] == 2 * page
    assert first["verdicts"] == second["verdicts"] == [4]


def test_decode_follows_the_prefills_page_split_not_its_own_variable(widths):
    """sglang's own decode reads its own ``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER``, so a
    decode without it would read CP rank 0 alone while each CP rank writes a share (sglang's MIN
    over the CP ranks then waits for the bootstrap timeout). dsa-bridge's decode reads what the
    prefill registered (its ``kv_layout``): the split above was read by a decode without the
    variable, and a decode with it reads an unsplit prefill's CP rank 0, byte-exact."""
    writer, dummy, decode = widths("nixl", "cp2-into-tp1-with-split-variable")
    assert exact(decode), decode
    assert (writer["dummy"], dummy["dummy"]) == (False, True)
    assert decode["groups"] == [[1, 0, 1, False]] and dummy["bytes"] == 0


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
                             kv_layout=KV_LAYOUT_MARK)
    (problem,) = bringup.pairing_problems(info, page_size=64, kv_cache_dtype="fp8_e4m3",
                                          attn_tp_size=2)
    assert "attention-TP widths: prefill 3, decode 2, neither a multiple of the other" in problem
    assert "--tp-size" in problem
    assert bringup.pairing_problems(info, page_size=64, kv_cache_dtype="fp8_e4m3",
                                    attn_tp_size=1) == []


def test_an_attention_cp_prefill_pairs_and_kv_sharding_needs_equal_widths():
    """Decode reads prefill CP rank 0 (every CP rank holds the whole cache), or with layer split
    every CP rank (each its layers); a KV-sharded prefill pairs at equal attention-TP widths and
    is refused at others from the parallel info, naming the prefill's flag."""
    served = PrefillServerInfo(attn_tp_size=1, attn_cp_size=2, dp_size=1, pp_size=1, page_size=64,
                               kv_cache_dtype="fp8_e4m3", follow_bootstrap_room=True,
                               kv_layout=KV_LAYOUT_MARK)
    pairing = dict(page_size=64, kv_cache_dtype="fp8_e4m3", attn_tp_size=1)
    assert bringup.pairing_problems(served, **pairing) == []
    split = PrefillServerInfo(**{**vars(served), "enable_dsa_cache_layer_split": True})
    assert bringup.pairing_problems(split, **pairing) == []
    assert bringup.target_cp_ranks(2, False) == (0,) and bringup.target_cp_ranks(2, True) == (0, 1)
    sharded = PrefillServerInfo(**{**vars(served), "attn_cp_size": 1, "attn_tp_size": 2,
                                   "enable_kv_cache_sharding": True})
    assert bringup.pairing_problems(sharded, **{**pairing, "attn_tp_size": 2}) == []
    (problem,) = bringup.pairing_problems(sharded, **pairing)
    assert problem.startswith("--enable-kv-cache-sharding on the prefill needs equal attention-TP "
                              "widths") and "prefill 2, decode 1" in problem
    assert [bringup.dummy_cp_rank(2, r) for r in (0, 1)] == [False, True]
    assert not bringup.dummy_cp_rank(1, 0) and not bringup.dummy_cp_rank(2, 1, layer_split=True)
    assert not bringup.dummy_cp_rank(2, 1, split_pages=True)
    assert bringup.target_cp_ranks(2, False, split_pages=True) == (0, 1)


SPLIT_MARK = {"kv_layout": CP_PAGE_SPLIT_MARK}


@pytest.mark.parametrize(("fields", "split"), [
    ({}, ""),
    (SPLIT_MARK, "cp"),  # the prefill registered its CP page split
    ({"enable_kv_cache_sharding": True}, "cp"),  # sharded over the CP group
    ({"enable_dsa_cache_layer_split": True, **SPLIT_MARK}, ""),  # each CP rank writes its layers
    ({"attn_cp_size": 1, "enable_kv_cache_sharding": True}, "tp"),
    ({"attn_cp_size": 1, **SPLIT_MARK}, ""),
])
def test_page_split_is_read_from_the_prefills_registration(fields, split):
    info = PrefillServerInfo(**{"attn_tp_size": 2, "attn_cp_size": 2, "dp_size": 1, "pp_size": 1,
                                "page_size": 64, "kv_cache_dtype": "fp8_e4m3",
                                "follow_bootstrap_room": True, "kv_layout": KV_LAYOUT_MARK,
                                **fields})
    assert bringup.page_split(info) == split
    assert bringup.pairing_problems(info, page_size=64, kv_cache_dtype="fp8_e4m3",
                                    attn_tp_size=2) == []  # either mark is dsa-bridge's
    assert layout_mark(True) == CP_PAGE_SPLIT_MARK and layout_mark(False) == KV_LAYOUT_MARK


@pytest.mark.parametrize("num_pages", [1, 2, 5, 8, 13])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_page_shares_are_sglangs_filters(num_pages, size):
    """Each rank's (pages, positions) of every chunk are what sglang's own senders send:
    ``filter_kv_indices_for_shard_rank`` (KV sharding) and ``filter_kv_indices_for_cp_rank``
    (the CP page split); over the ranks every position once."""
    from types import SimpleNamespace

    import numpy as np
    from sglang.srt.disaggregation.utils import (
        filter_kv_indices_for_cp_rank,
        filter_kv_indices_for_shard_rank,
    )

    logical = np.random.default_rng(num_pages * size).permutation(np.arange(size, size * 40))[:num_pages]
    chunks = [(0, num_pages // 2), (num_pages // 2, num_pages)]
    for interleaved in (True, False):
        seen = []
        for rank in range(size):
            share = bringup.page_share(attn_cp_size=size, attn_cp_rank=rank, layer_split=False,
                                       all_cp_ranks=not interleaved,
                                       shard=(rank, size) if interleaved else None)
            assert share == bringup.PageShare(rank, size, interleaved)
            for start, end in chunks:
                pages, at = share.of_chunk(logical[start:end], start, num_pages)
                if interleaved:
                    want, want_at = filter_kv_indices_for_shard_rank(
                        kv_indices=logical[start:end], index_slice=slice(start, end),
                        shard_rank=rank, shard_size=size)
                else:
                    want, window = filter_kv_indices_for_cp_rank(
                        SimpleNamespace(attn_cp_rank=rank, attn_cp_size=size), logical[start:end],
                        slice(start, end), total_pages=num_pages)
                    want_at = np.arange(window.start, window.stop)
                assert pages.tolist() == want.tolist() and at.tolist() == want_at.tolist()
                seen += at.tolist()
        assert sorted(seen) == list(range(num_pages))
    assert bringup.page_share(attn_cp_size=2, attn_cp_rank=1, layer_split=True, all_cp_ranks=True,
                              shard=None) is None  # layer split: each rank writes its layers
    assert bringup.page_share(attn_cp_size=1, attn_cp_rank=0, layer_split=False,
                              all_cp_ranks=False, shard=(0, 1)) is None  # a shard group of one


@pytest.mark.parametrize(("mode", "fields", "env", "message"), [
    ("prefill", {"enable_cp_tp_group_sharing": True}, {},
     r"CP-TP group sharing .*\(give prefill --attn-cp-size 1\)"),
    ("decode", {}, {}, r"--attn-cp-size 2 on decode: .*\(give decode --attn-cp-size 1\)"),
    ("decode", {"enable_kv_cache_sharding": True}, {},
     r"--enable-kv-cache-sharding on decode: .*\(remove it from the decode\)"),
])
def test_attention_cp_modes_not_served_are_refused_at_start_up_by_name(mode, fields, env, message,
                                                                        monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with published_context(disaggregation_mode=mode, disaggregation_transfer_backend="nixl",
                           tp_size=2, attn_cp_size=2) as server_args:
        get_parallel().override_permanently(**fields)
        args = kv_args_of(SGLangPool(**DSV32))
        args.kv_cache_dtype_str = "fp8_e4m3"
        with pytest.raises(ValueError, match=message):
            DSABridgeKVManager(args, DisaggregationMode(mode), server_args, True)


def test_a_dummy_cp_rank_request_is_sglangs_dummy_sender():
    """WaitingForInput from the start, nothing before the last chunk, Success at it; an abort
    before it fails the request, and a send before ``init`` is refused."""
    from dsa_bridge.plugin.sglang.sender import DummyCPRequest

    request = DummyCPRequest()
    assert request.status == 2  # WaitingForInput, without decode
    request.init(5)
    request.sent(2)
    assert request.status == 2
    request.sent(3)
    assert request.status == 4  # Success with the last chunk
    request.abort("late")
    assert request.status == 4
    aborted = DummyCPRequest()
    aborted.init(5)
    aborted.abort("aborted by sglang")
    aborted.sent(5)
    assert (aborted.status, aborted.reason) == (0, "aborted by sglang")
    early = DummyCPRequest()
    early.sent(1)
    assert (early.status, early.reason) == (0, "send before init")
