"""The compact layout (issue: layer sets): an index-sharing layer's indexer is absent, not empty.

A GLM-5.2 pool with ``indexer_layout="compact"`` holds 78 KV buffers and only the 21 producer
layers' indexer buffers. Every public method is walked for zero-length or NULL entries; asking for
a shared layer's indexer names the layer and its producer; the token operations move exactly the
bytes a uniform pool moves for the buffers both hold (the uniform pool is checked against a
byte-level oracle in test_pool_ops).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from dsa_bridge.plugin import DSALayout, DSATokenToKVPool, allocation_bytes, load_model_config
from dsa_bridge.plugin.pool import AbsentIndexerError

GLM = load_model_config("glm-5.2")
FULL = (0, 1, 2, *range(6, 75, 4))
PAGE = 64
SIZE = 6 * PAGE


def glm(indexer_layout: str, **kw) -> DSALayout:
    return DSALayout.from_hf_config(GLM, kv_dtype="fp8_raw", indexer_layout=indexer_layout, **kw)


def pools(pool_bytes, **kw) -> tuple[DSATokenToKVPool, DSATokenToKVPool]:
    """A uniform and a compact GLM-5.2 pool holding the same bytes in every buffer both have."""
    uniform = DSATokenToKVPool.from_layout(glm("uniform"), SIZE, **kw)
    compact = DSATokenToKVPool.from_layout(glm("compact"), SIZE, **kw)
    pool_bytes.fill(uniform, seed=7)
    for lid, kind in compact.buffer_keys():
        compact.page_view(lid, kind).copy_(uniform.page_view(lid, kind))
    return uniform, compact


def assert_same_as_uniform(uniform, compact) -> None:
    for lid, kind in compact.buffer_keys():
        assert torch.equal(compact.page_view(lid, kind), uniform.page_view(lid, kind)), (lid, kind)


def test_compact_glm52_holds_only_producer_indexers():
    layout = glm("compact")
    assert layout.indexer_layout == "compact" and layout.index_layer_ids == FULL
    assert DSALayout.preset("glm-5.2", kv_dtype="fp8_raw", indexer_layout="compact") == glm("compact")
    pool = DSATokenToKVPool.from_layout(layout, SIZE)
    assert len(pool.kv_buffer) == 78 and len(pool.index_k_with_scale_buffer) == 78
    assert [lid for lid, _ in pool.index_k_with_scale_buffer.present()] == list(FULL)
    assert pool.kv_layer_ids == list(range(78)) and pool.state_layer_ids == list(FULL)


def test_every_public_method_of_a_compact_pool_has_no_empty_or_null_entry():
    pool = DSATokenToKVPool.from_layout(glm("compact"), SIZE)
    descs = pool.buffer_descriptors()
    assert len(descs) == 78 + 21
    assert all(d.ptr > 0 and d.nbytes > 0 and d.item_len > 0 for d in descs)
    kv_ptrs, kv_lens, kv_items = pool.get_contiguous_buf_infos()
    st_ptrs, st_lens, st_items = pool.get_state_buf_infos()
    assert len(kv_ptrs) == len(kv_lens) == len(kv_items) == 78
    assert len(st_ptrs) == len(st_lens) == len(st_items) == len(pool.state_layer_ids) == 21
    for values in (kv_ptrs, kv_lens, kv_items, st_ptrs, st_lens, st_items):
        assert all(isinstance(v, int) and v > 0 for v in values)
    assert set(st_items) == {8448}
    by_layer = {d.layer_id: d.ptr for d in descs if d.kind == "index"}
    assert [by_layer[lid] for lid in pool.state_layer_ids] == st_ptrs  # entries carry layer ids
    assert pool.get_kv_size_bytes() == allocation_bytes(pool.layout, SIZE)
    assert all(t.numel() > 0 for _, t in pool.index_k_with_scale_buffer.present())
    copy = pool.get_cpu_copy(torch.arange(PAGE, 3 * PAGE))
    assert len(copy.kv) == 78 and len(copy.index_keys) == len(copy.index_scales) == 21
    assert all(t.numel() > 0 for t in (*copy.kv, *copy.index_keys, *copy.index_scales))


@pytest.mark.parametrize(("layer", "producer"), [(3, 2), (5, 2), (7, 6), (77, 74)])
def test_a_shared_layers_indexer_is_an_error_naming_its_producer(layer, producer):
    pool = DSATokenToKVPool.from_layout(glm("compact"), SIZE)
    message = f"layer {layer} holds no indexer in this compact layout \\(it reuses layer {producer}'s\\)"
    with pytest.raises(AbsentIndexerError, match=message):
        pool.index_k_with_scale_buffer[layer]
    with pytest.raises(AbsentIndexerError, match=message):
        pool.page_view(layer, "index")
    with pytest.raises(AbsentIndexerError, match="layer 3 holds no indexer"):
        list(pool.index_k_with_scale_buffer)  # walking all layers stops loudly at the first one


def test_a_stage_starting_at_a_shared_layer_names_a_producer_outside_it():
    pool = DSATokenToKVPool.from_layout(glm("compact", start_layer=40, end_layer=48), SIZE)
    assert pool.state_layer_ids == [42, 46]
    with pytest.raises(AbsentIndexerError, match="layer 40 .*producer is outside this layout"):
        pool.page_view(40, "index")


def test_move_kv_cache_matches_the_uniform_pool(pool_bytes):
    uniform, compact = pools(pool_bytes)
    rng = np.random.default_rng(3)
    tgt = torch.from_numpy(rng.choice(np.arange(PAGE, SIZE + PAGE), 80, replace=False))
    src = torch.from_numpy(rng.integers(0, SIZE + PAGE, 80))
    uniform.move_kv_cache(tgt, src)
    compact.move_kv_cache(tgt, src)
    assert_same_as_uniform(uniform, compact)
    pages = torch.arange(2 * PAGE, 4 * PAGE)  # whole pages: the by-page path
    uniform.move_kv_cache(pages + 2 * PAGE, pages)
    compact.move_kv_cache(pages + 2 * PAGE, pages)
    assert_same_as_uniform(uniform, compact)


@pytest.mark.parametrize("tokens", [torch.arange(PAGE, 3 * PAGE), torch.tensor([70, 3, 200, 65])])
def test_cpu_copy_round_trip_matches_the_uniform_pool(pool_bytes, tokens):
    uniform, compact = pools(pool_bytes)
    copy_u, copy_c = uniform.get_cpu_copy(tokens), compact.get_cpu_copy(tokens)
    for i, lid in enumerate(compact.state_layer_ids):
        j = uniform.state_layer_ids.index(lid)
        assert torch.equal(copy_c.index_keys[i], copy_u.index_keys[j])
        assert torch.equal(copy_c.index_scales[i], copy_u.index_scales[j])
    assert all(torch.equal(a, b) for a, b in zip(copy_c.kv, copy_u.kv, strict=True))
    target = torch.arange(4 * PAGE, 4 * PAGE + tokens.numel())
    uniform.load_cpu_copy(copy_u, target)
    compact.load_cpu_copy(copy_c, target)
    assert_same_as_uniform(uniform, compact)


def test_a_copy_of_the_other_layout_is_refused(pool_bytes):
    uniform, compact = pools(pool_bytes)
    copy = uniform.get_cpu_copy(torch.arange(PAGE, 2 * PAGE))
    with pytest.raises(ValueError, match="different layout: index_layer_ids: 21 layers != 78 layers"):
        compact.load_cpu_copy(copy, torch.arange(PAGE, 2 * PAGE))
    forged = dataclasses.replace(copy, layout=compact.layout)
    with pytest.raises(ValueError, match="copy.index_keys has 78 layers, expected 21"):
        compact.load_cpu_copy(forged, torch.arange(PAGE, 2 * PAGE))


def test_guard_regions_of_a_compact_pool(pool_bytes):
    pool = DSATokenToKVPool.from_layout(glm("compact"), SIZE, guard_bytes=64)
    assert len(pool.guard_allocations) == 78 + 21
    pool_bytes.fill(pool, seed=1)
    pool.move_kv_cache(torch.arange(PAGE, 2 * PAGE), torch.arange(3 * PAGE, 4 * PAGE))
    assert pool.canaries_intact()
