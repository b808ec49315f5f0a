"""Requests with a decode radix-cache prefix move only the pages decode lacks; a decode-side
refusal reaches prefill at once.

sglang's decode matches a request against its radix cache and sends prefill the pages after the
prefix with ``decode_prefix_len`` (tokens, whole pages); sglang's prefill asks its sender
``pop_decode_prefix_len()`` at the end of bootstrap, sends from there and counts only the rest
in ``init``. Here, as sglang's ranks in two processes (``pd_rank.py``), both engines:

- a five-page request whose first two pages decode holds: the last three move, byte-exact on KV,
  indexer and aux; decode's two prefix pages and every other page untouched; the byte count
  three pages';
- a prefix that is not whole pages, refused by decode: prefill's sender fails at once with
  decode's reason (told by decode, not by its bootstrap timeout), and nothing is written.
"""

from __future__ import annotations

import pytest

from tests.conftest import require_engine

from .conftest import SGLANG_MISSING
from .test_sglang_conn import config, run_pd

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

MODEL = {"layers": 4, "model_layers": 4, "kv_cache_dim": 656}
PAGE_BYTES = 64 * (656 + 132) * 4  # KV and indexer rows of a page, every layer


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_a_prefix_hit_moves_only_the_rest_and_a_refusal_reaches_prefill(engine):
    require_engine(engine)
    hit, refused = config(engine, MODEL, prefix_tokens=128), config(engine, MODEL, prefix_tokens=32)
    (p_hit, p_refused), (d_hit, d_refused) = run_pd([hit, refused], [hit, refused])
    assert p_hit["decode_prefix_len"] == 128  # told by decode's pages
    assert d_hit["poll"] == p_hit["poll"] == 4, d_hit.get("reason")
    assert d_hit["mismatched"] == [] and d_hit["others_sentinel"]  # the prefix pages untouched
    assert d_hit["aux_exact"] and d_hit["aux_others_sentinel"]
    assert d_hit["nbytes"] == p_hit["bytes"] == 3 * PAGE_BYTES + d_hit["aux_bytes"]
    assert d_refused["poll"] == p_refused["poll"] == 0  # Failed on both sides
    assert "decode_prefix_len 32 is not a whole number of 64-token pages" in d_refused["reason"]
    assert "aborted by decode" in p_refused["reason"]
    assert "decode_prefix_len 32" in p_refused["reason"]  # decode's reason, not a timeout
    assert d_refused["others_sentinel"]
