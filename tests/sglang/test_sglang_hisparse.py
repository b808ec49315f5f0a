"""sglang's HiSparse decode (``--enable-hisparse``) for a DSA model, served: decode receives the KV
into HiSparse's host pool (whose page 0 is a page) and the indexer into its device pool, each at
its own pages, as sglang's own Mooncake connector does. A prefill rank (``pd_rank.py``) and a
HiSparse decode rank (``hisparse_rank.py``: sglang's own ``HiSparseDSATokenToKVPool`` and
``MLATokenToKVPoolHost``, the manager from sglang's own ``_init_kv_manager``), each its own
process, byte-exact on KV, indexer and aux, both engines, with and without checksums.
"""

from __future__ import annotations

import pytest

from tests.conftest import require_engine

from .conftest import SGLANG_MISSING
from .test_sglang_conn import config, run_ranks

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

MODEL = {"layers": 4, "model_layers": 4, "kv_cache_dim": 656}
PAGE_BYTES = 64 * (656 + 132) * 4


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
