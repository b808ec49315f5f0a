"""sglang's HiSparse decode (``--enable-hisparse``) for a DSA model, served: decode receives the KV
into HiSparse's host pool (whose page 0 is a page) and the indexer into its device pool, each at
its own pages, as sglang's own Mooncake connector does. A prefill rank (``pd_rank.py``) and a
HiSparse decode rank (``hisparse_rank.py``: sglang's own ``HiSparseDSATokenToKVPool`` and
``MLATokenToKVPoolHost``, the manager from sglang's own ``_init_kv_manager``), each its own
process, byte-exact on KV, indexer and aux, both engines, with and without checksums; GLM-5.2
compact on both sides (the 0-row indexer placeholders never written). With a
draft model (MTP; Mooncake, as sglang's decode allows): the draft's KV lands in the device pool at
the indexer's pages (``device_kv_indices``), and device pages other than those fail the request.
"""

from __future__ import annotations

import pytest

from tests.conftest import require_engine

from .conftest import SGLANG_MISSING
from .test_sglang_conn import GLM_SKIP, config, run_ranks

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

MODEL = {"layers": 4, "model_layers": 4, "kv_cache_dim": 656}
PAGE_BYTES = 64 * (656 + 132) * 4
GLM_COMPACT = {"layers": 8, "model_layers": 8, "kv_cache_dim": 576, "skip": GLM_SKIP}


@pytest.mark.parametrize("checksum", [False, True])
@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_a_hisparse_decode_gets_the_kv_in_its_host_pool_and_the_indexer_on_device(engine, checksum):
    require_engine(engine)
    cfg = config(engine, MODEL, host_pages=[0, 9, 10, 11, 4], checksum=checksum)
    (prefill,), (decode,) = run_ranks([("prefill", [cfg]), ("hisparse-decode", [cfg])],
                                      module="tests.sglang.hisparse_rank")
    assert decode["poll"] == prefill["poll"] == 4, decode["reason"]
    assert decode["mismatched"] == [] and decode["others_sentinel"] and decode["aux_exact"]
    assert decode["nbytes"] == prefill["bytes"] == 5 * PAGE_BYTES + decode["aux_bytes"]


def test_a_compact_hisparse_decode_gets_its_indexer_layers_only():
    """GLM-5.2's first 8 layers, compact on both sides (indexers of 0, 1, 2 and 6 only): sglang's
    HiSparse device pool holds 0-row placeholders for the others, and nothing is written there."""
    require_engine("nixl")
    cfg = config("nixl", GLM_COMPACT, host_pages=[0, 9, 10, 11, 4])
    (prefill,), (decode,) = run_ranks([("prefill", [cfg]), ("hisparse-decode", [cfg])],
                                      module="tests.sglang.hisparse_rank")
    assert decode["poll"] == prefill["poll"] == 4, decode["reason"]
    assert [key for key in decode["buffers"] if key.startswith("index")] == [
        "index:0", "index:1", "index:2", "index:6"]
    assert decode["mismatched"] == [] and decode["others_sentinel"] and decode["aux_exact"]
    assert decode["nbytes"] == prefill["bytes"] == 5 * 64 * (8 * 576 + 4 * 132) + decode["aux_bytes"]


MTP = {**MODEL, "draft_layers": 1}  # the draft's KV and indexer: layer 4, on the device


@pytest.fixture(scope="module")
def with_a_draft_model():
    """sglang's HiSparse decode with a draft model, on Mooncake (sglang's decode sends the draft
    KV's device pages on Mooncake only): one request whose ``device_kv_indices`` are the
    indexer's pages, as sglang's prealloc queue makes them, with checksums; and one whose differ."""
    require_engine("mooncake")
    served = config("mooncake", MTP, host_pages=[0, 9, 10, 11, 4], checksum=True)
    differing = config("mooncake", MTP, host_pages=[0, 9, 10, 11, 4], device_pages=[2, 7, 5, 6, 1])
    prefill, decode = run_ranks([("prefill", [served, differing]),
                                 ("hisparse-decode", [served, differing])],
                                module="tests.sglang.hisparse_rank")
    return dict(zip(("served", "differing"), zip(prefill, decode, strict=True), strict=True))


def test_a_draft_models_kv_lands_on_the_device_at_the_indexers_pages(with_a_draft_model):
    prefill, decode = with_a_draft_model["served"]
    assert decode["poll"] == prefill["poll"] == 4, decode["reason"]
    assert "kv:4" in decode["buffers"] and "index:4" in decode["buffers"]
    assert decode["mismatched"] == [] and decode["others_sentinel"] and decode["aux_exact"]
    assert prefill["checksums_computed"] > 0
    assert decode["nbytes"] == prefill["bytes"] == 5 * PAGE_BYTES * 5 // 4 + decode["aux_bytes"]


def test_device_pages_other_than_the_indexers_fail_the_request_on_both_sides(with_a_draft_model):
    prefill, decode = with_a_draft_model["differing"]
    assert decode["poll"] == prefill["poll"] == 0  # Failed, and prefill was told at once
    assert "device_kv_indices (5 pages) differ from the DSA state indices" in decode["reason"]
    assert "device_kv_indices" in prefill["reason"]
    assert decode["untouched"]
