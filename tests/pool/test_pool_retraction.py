"""Decode-side retraction on dsa-bridge's own pool: ``get_cpu_copy`` / ``load_cpu_copy`` in the
form SGLang's retraction calls them (``Req.offload_kv_cache`` / ``load_kv_cache``,
managers/schedule_batch.py ~2110-2146: a request's first ``seqlen - 1`` token locations, whole
pages then a partial page, with ``mamba_indices=`` and ``req_pool_index=``), byte-exact on every
layer's KV rows and indexer keys and scales, uniform and compact, the other requests' tokens
and the rest of the partial page untouched (this pool copies exactly the tokens' bytes); and
``check_request_tokens``, the form SGLang's indexer copy needs (used by the SGLang subclass).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsa_bridge.plugin import DSALayout, DSATokenToKVPool
from dsa_bridge.plugin.token_locs import check_request_tokens

PAGE = 64
SIZE = 10 * PAGE
SENTINEL = 0xAB
UNIFORM = DSALayout(layer_ids=(0, 1, 2), page_size=PAGE, kv_lora_rank=512, qk_rope_head_dim=64,
                    kv_dtype="fp8", index_head_dim=128)


def compact_layout() -> DSALayout:
    """GLM-5.2's first 8 layers, compact: indexers on 0, 1, 2 and 6 only."""
    full = DSALayout.preset("glm-5.2", indexer_layout="compact")
    ids = tuple(range(8))
    return DSALayout(layer_ids=ids, page_size=PAGE, kv_lora_rank=full.kv_lora_rank,
                     qk_rope_head_dim=full.qk_rope_head_dim, kv_dtype=full.kv_dtype,
                     index_head_dim=full.index_head_dim, index_quant_block=full.index_quant_block,
                     index_layers=tuple(i for i in ids if i in full.index_layer_ids))


def request_tokens(pages: list[int], seqlen: int) -> list[int]:
    """A request's first ``seqlen - 1`` token locations on ``pages`` (as SGLang's paged
    allocator lays them out: position i at offset i % PAGE of the request's i // PAGE-th page)."""
    return [pages[i // PAGE] * PAGE + i % PAGE for i in range(seqlen - 1)]


def oracle_load(layout: DSALayout, later: dict, dst: list[int], src: list[int], taken: dict) -> dict:
    """``later`` with token ``src[i]``'s bytes of ``taken`` at ``dst[i]``: the KV row of every
    layer; the 128 key bytes at ``offset * 128`` and the 4 scale bytes at ``PAGE * 128 + offset
    * 4`` of the page row, in every layer that holds an indexer. Nothing else."""
    d, s, w = layout.index_head_dim, layout.index_scale_bytes, layout.kv_row_bytes
    out = {k: v.copy() for k, v in later.items()}
    for lid in layout.layer_ids:
        for t, f in zip(dst, src, strict=True):
            out[(lid, "kv")].reshape(-1, w)[t] = taken[(lid, "kv")].reshape(-1, w)[f]
            if lid in layout.index_layer_ids:
                (tp, to), (fp, fo) = divmod(t, PAGE), divmod(f, PAGE)
                row, old = out[(lid, "index")][tp], taken[(lid, "index")][fp]
                row[to * d : (to + 1) * d] = old[fo * d : (fo + 1) * d]
                at, frm = PAGE * d + to * s, PAGE * d + fo * s  # the scales follow the page's keys
                row[at : at + s] = old[frm : frm + s]
    return out


def overwrite(pool_bytes, pool: DSATokenToKVPool, pages: list[int]) -> dict:
    """The request's pages taken by someone else: every byte of them (KV and indexer, every
    layer) the sentinel; returns the pool's bytes after."""
    for view in pool_bytes.views(pool).values():
        view[pages] = SENTINEL
    return pool_bytes.snapshot(pool)


@pytest.mark.parametrize("layout", [UNIFORM, compact_layout()], ids=["uniform", "compact"])
@pytest.mark.parametrize("tail", [1, 37, 63, 0])
def test_retraction_round_trip_with_a_partial_last_page(pool_bytes, layout, tail):
    """Fill, copy a request's seqlen - 1 tokens (pages 2, 5, 3 whole, page 7 holding ``tail``
    tokens), overwrite its pages with a sentinel, load the copy back: every layer's KV rows and
    indexer keys and scales of its tokens are the originals; every other byte — other requests'
    pages, the rest of page 7 — is what it was before the load."""
    pool = DSATokenToKVPool.from_layout(layout, SIZE)
    pool_bytes.fill(pool, seed=tail)
    pages = [2, 5, 3, 7] if tail else [2, 5, 3]
    locs = request_tokens(pages, 3 * PAGE + tail + 1)
    indices = torch.tensor(locs, dtype=torch.int32)  # a slice of SGLang's int32 req_to_token row
    taken = pool_bytes.snapshot(pool)
    copy = pool.get_cpu_copy(indices, mamba_indices=None, req_pool_index=3)
    assert copy.num_tokens == len(locs)
    later = overwrite(pool_bytes, pool, pages)
    pool.load_cpu_copy(copy, indices, mamba_indices=None, req_pool_index=3)
    pool_bytes.assert_equal(pool, oracle_load(layout, later, locs, locs, taken))
    if tail:  # the partial page: the request's tokens back, the rest still the sentinel
        for lid in layout.index_layer_ids:
            row = pool_bytes.snapshot(pool)[(lid, "index")][7]
            d, s = layout.index_head_dim, layout.index_scale_bytes
            assert (row[tail * d : PAGE * d] == SENTINEL).all()
            assert (row[PAGE * d + tail * s :] == SENTINEL).all()
            np.testing.assert_array_equal(row[: tail * d], taken[(lid, "index")][7][: tail * d])


def test_retraction_resumes_on_other_pages(pool_bytes):
    """SGLang resumes a retracted request on pages its allocator hands out then: the copy
    loads into another request-shaped set of locations, byte-exact, chunked anywhere."""
    pool = DSATokenToKVPool.from_layout(UNIFORM, SIZE)
    pool_bytes.fill(pool, seed=9)
    src = request_tokens([4, 1, 6], 2 * PAGE + 20)
    dst = request_tokens([8, 2, 9], 2 * PAGE + 20)
    taken = pool_bytes.snapshot(pool)
    copy = pool.get_cpu_copy(torch.tensor(src), mamba_indices=None, req_pool_index=1, chunk_size=100)
    later = overwrite(pool_bytes, pool, [4, 1, 6, 8, 2, 9])
    pool.load_cpu_copy(copy, torch.tensor(dst), mamba_indices=None, req_pool_index=5, chunk_size=64)
    pool_bytes.assert_equal(pool, oracle_load(UNIFORM, later, dst, src, taken))


@pytest.mark.parametrize(("dst", "message"), [
    ([0] + list(range(PAGE + 1, PAGE + 70)), "targets padding page 0"),
    (list(range(PAGE, PAGE + 69)) + [PAGE], "duplicate locations"),
    (list(range(SIZE + PAGE - 69, SIZE + PAGE + 1)), "out of range"),
    (list(range(PAGE, PAGE + 69)), "token_locs has 69 locations but the copy holds 70"),
])
def test_retraction_load_refusals_change_nothing(pool_bytes, dst, message):
    pool = DSATokenToKVPool.from_layout(UNIFORM, SIZE)
    pool_bytes.fill(pool, seed=2)
    copy = pool.get_cpu_copy(torch.arange(3 * PAGE, 3 * PAGE + 70), mamba_indices=None, req_pool_index=0)
    before = pool_bytes.snapshot(pool)
    with pytest.raises(ValueError, match=message):
        pool.load_cpu_copy(copy, torch.tensor(dst), mamba_indices=None, req_pool_index=0)
    pool_bytes.assert_equal(pool, before)


# ---- the request form (check_request_tokens) ----------------------------------------------------
@pytest.mark.parametrize("locs", [
    [],
    request_tokens([3], 2),
    request_tokens([3], PAGE + 1),
    request_tokens([3, 1, 2], 2 * PAGE + 10),
    request_tokens([3, 1, 2], 3 * PAGE + 1),
])
def test_request_tokens_accepted(locs):
    check_request_tokens("indices", torch.tensor(locs, dtype=torch.int64), PAGE)


@pytest.mark.parametrize(("locs", "message"), [
    (list(range(PAGE + 1, PAGE + 10)), "position 0 holds location 65, at offset 1 of its page"),
    (list(range(PAGE, 2 * PAGE)) + list(range(3 * PAGE + 5, 3 * PAGE + 9)),
     "position 64 holds location 197, at offset 5"),
    (list(range(2 * PAGE - 1, PAGE - 1, -1)), "position 0 holds location 127, at offset 63"),
    ([PAGE, PAGE + 2, PAGE + 1], "position 1 holds location 66, expected 65"),
    (list(range(PAGE, PAGE + 60)) + [3 * PAGE], "position 60 holds location 192, expected 124"),
    (list(range(0, PAGE + 3)), "includes padding page 0"),
    (request_tokens([2, 1], PAGE + 1) + list(range(2 * PAGE, 2 * PAGE + 3)),
     "duplicate locations: page 2 appears twice"),
])
def test_request_tokens_refused_naming_the_problem(locs, message):
    with pytest.raises(ValueError, match=message):
        check_request_tokens("indices", torch.tensor(locs, dtype=torch.int64), PAGE)
