"""DSATokenToKVPool construction, buffers, descriptors and guard canaries."""

from __future__ import annotations

import pytest
import torch

from dsa_bridge.plugin import (
    DSALayout,
    DSATokenToKVPool,
    allocation_bytes,
    load_model_config,
    skip_topk_layer_ids,
    validate_descriptors,
)


def deepseek_pool(**kw) -> DSATokenToKVPool:
    args = dict(
        size=128,
        page_size=64,
        kv_lora_rank=512,
        dtype=torch.float8_e4m3fn,
        qk_rope_head_dim=64,
        layer_num=61,
        index_head_dim=128,
    )
    args.update(kw)
    return DSATokenToKVPool(**args)


# ---- shapes ------------------------------------------------------------------------------------
def test_deepseek_fp8_flashmla_shapes():
    pool = deepseek_pool()
    assert pool.layout == DSALayout.preset("deepseek-v3.2")
    assert pool.num_kv_pages == 3  # page 0 = padding, pages 1..2 usable
    assert len(pool.kv_buffer) == len(pool.index_k_with_scale_buffer) == 61
    for kv, idx in zip(pool.kv_buffer, pool.index_k_with_scale_buffer, strict=True):
        assert kv.shape == (192, 1, 656) and kv.dtype == torch.uint8
        assert idx.shape == ((128 + 64 + 1) // 64, 64 * 132) == (3, 8448)
        assert idx.dtype == torch.uint8
        assert not kv.any() and not idx.any()
    assert pool.device == "cpu"
    assert pool.state_type == "dsa"


@pytest.mark.parametrize(
    ("dtype", "kv_cache_dim", "kind", "store", "dim"),
    [
        (torch.bfloat16, None, "bf16", torch.bfloat16, 576),
        ("bf16", 576, "bf16", torch.bfloat16, 576),
        (torch.float8_e4m3fn, None, "fp8", torch.uint8, 656),
        (torch.uint8, 656, "fp8", torch.uint8, 656),
        ("fp8", None, "fp8", torch.uint8, 656),
        (torch.float8_e4m3fn, 576, "fp8_raw", torch.uint8, 576),
        ("fp8_raw", None, "fp8_raw", torch.uint8, 576),
    ],
)
def test_dtype_resolution(dtype, kv_cache_dim, kind, store, dim):
    pool = deepseek_pool(dtype=dtype, kv_cache_dim=kv_cache_dim, layer_num=2)
    assert pool.layout.kv_dtype == kind
    assert pool.kv_buffer[0].dtype == store == pool.store_dtype
    assert pool.kv_buffer[0].shape == (192, 1, dim) and pool.kv_cache_dim == dim
    assert pool.kv_buffer[0].numel() * pool.kv_buffer[0].element_size() == 192 * (
        pool.layout.kv_row_bytes
    )


@pytest.mark.parametrize(
    ("kw", "exc", "name"),
    [
        ({"size": 100}, ValueError, "size"),
        ({"size": 0}, ValueError, "size"),
        ({"size": "128"}, TypeError, "size"),
        ({"page_size": 48, "size": 96}, ValueError, "page_size"),
        ({"dtype": torch.float16}, ValueError, "dtype"),
        ({"dtype": "fp16"}, ValueError, "dtype"),
        ({"dtype": torch.float8_e4m3fn, "kv_cache_dim": 600}, ValueError, "kv_cache_dim"),
        ({"dtype": torch.bfloat16, "kv_cache_dim": 656}, ValueError, "kv_cache_dim"),
        ({"layer_num": 0}, ValueError, "layer_num"),
        ({"start_layer": 30, "end_layer": 60}, ValueError, "end_layer"),
        ({"start_layer": -1}, ValueError, "start_layer"),
        ({"index_buf_size": 64}, ValueError, "index_buf_size"),
        ({"index_head_dim": 100}, ValueError, "index_head_dim"),
        ({"kv_lora_rank": "512"}, TypeError, "kv_lora_rank"),
        ({"enable_memory_saver": True}, ValueError, "enable_memory_saver"),
        ({"guard_bytes": 3}, ValueError, "guard_bytes"),
        ({"guard_bytes": -8}, ValueError, "guard_bytes"),
    ],
)
def test_bad_constructor_arguments(kw, exc, name):
    with pytest.raises(exc, match=name):
        deepseek_pool(**{"layer_num": 2, **kw})


def test_pipeline_slice_keeps_global_ids():
    pool = deepseek_pool(layer_num=31, start_layer=30)
    assert pool.layout.layer_ids == tuple(range(30, 61))
    assert (pool.start_layer, pool.end_layer) == (30, 61)
    assert pool.layer_index(30) == 0 and pool.layer_index(60) == 30
    assert [d.layer_id for d in pool.buffer_descriptors()][::2] == list(range(30, 61))
    with pytest.raises(ValueError, match="layer_id 29"):
        pool.layer_index(29)
    with pytest.raises(TypeError, match="layer_id"):
        pool.layer_index("30")  # type: ignore[arg-type]
    assert deepseek_pool(layer_num=31, start_layer=30, end_layer=61).layout == pool.layout


def test_from_layout_with_draft_layer_non_contiguous():
    config = load_model_config("deepseek-v3.2")
    layout = DSALayout.from_hf_config(config, end_layer=2, include_draft_layers=True)
    pool = DSATokenToKVPool.from_layout(layout, 64)
    assert pool.layout.layer_ids == (0, 1, 61)
    assert pool.layer_index(61) == 2
    with pytest.raises(ValueError, match="layer_id 2 is not held"):
        pool.page_view(2, "kv")
    with pytest.raises(TypeError, match="layout"):
        DSATokenToKVPool.from_layout(layout.to_dict(), 64)  # type: ignore[arg-type]


# ---- the seed's regression: index sharing keeps the pool uniform ------------------------------
def test_glm52_pool_is_uniform():
    config = load_model_config("glm-5.2")
    assert len(skip_topk_layer_ids(config)) == 57
    layout = DSALayout.from_hf_config(config, kv_dtype="fp8_raw")
    pool = DSATokenToKVPool.from_layout(layout, 64)
    assert len(pool.index_k_with_scale_buffer) == 78
    assert all(b.numel() == 2 * 8448 for b in pool.index_k_with_scale_buffer)
    ptrs, lens, items = pool.get_state_buf_infos()
    assert len(ptrs) == len(lens) == len(items) == 78
    assert all(p != 0 for p in ptrs) and all(n == 2 * 8448 for n in lens)
    assert set(items) == {8448}
    kv_ptrs, kv_lens, kv_items = pool.get_contiguous_buf_infos()
    assert len(kv_ptrs) == 78 and set(kv_items) == {576 * 64} and set(kv_lens) == {2 * 576 * 64}
    # shared (skip-topk) layers have real indexer buffers too
    for lid in skip_topk_layer_ids(config):
        assert pool.page_view(lid, "index").shape == (2, 8448)


def test_glm52_pool_via_sglang_keywords():
    pool = DSATokenToKVPool(
        size=64, page_size=64, kv_lora_rank=512, dtype=torch.float8_e4m3fn,
        qk_rope_head_dim=64, layer_num=78, kv_cache_dim=576,
    )  # fmt: skip
    assert pool.layout == DSALayout.preset("glm-5.2", kv_dtype="fp8_raw")
    assert len(pool.buffer_descriptors()) == 156


# ---- descriptors -------------------------------------------------------------------------------
@pytest.mark.parametrize(("dtype", "kv_item"), [(torch.float8_e4m3fn, 41_984), ("bf16", 73_728)])
def test_descriptors(dtype, kv_item):
    pool = deepseek_pool(dtype=dtype)
    descs = pool.buffer_descriptors()
    assert [(d.layer_id, d.kind) for d in descs] == [
        (lid, kind) for lid in range(61) for kind in ("kv", "index")
    ]
    for d in descs:
        i = pool.layer_index(d.layer_id)
        buf = pool.kv_buffer[i] if d.kind == "kv" else pool.index_k_with_scale_buffer[i]
        assert d.ptr == buf.data_ptr() and d.device == "cpu"
        assert d.nbytes == buf.numel() * buf.element_size()
        assert d.item_len == (kv_item if d.kind == "kv" else 8_448)
        assert d.num_items == 3
    validate_descriptors(descs, pool.layout)
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    kv = [d for d in descs if d.kind == "kv"]
    assert (ptrs, lens, items) == ([d.ptr for d in kv], [d.nbytes for d in kv], [kv_item] * 61)
    assert sum(lens) + sum(pool.get_state_buf_infos()[1]) == pool.get_kv_size_bytes()
    assert pool.get_kv_size_bytes() == allocation_bytes(pool.layout, 128)


def test_page_view_shares_storage_and_addresses_pages():
    pool = deepseek_pool(dtype="bf16", layer_num=2)
    view = pool.page_view(1, "kv")
    assert view.shape == (3, 73_728) and view.dtype == torch.uint8
    assert view.data_ptr() == pool.kv_buffer[1].data_ptr()
    view[2, :2] = torch.tensor([0x80, 0x3F], dtype=torch.uint8)  # bf16 1.0, little endian
    assert pool.kv_buffer[1][128, 0, 0].item() == 1.0  # page 2 starts at token row 128
    idx = pool.page_view(0, "index")
    assert idx.data_ptr() == pool.index_k_with_scale_buffer[0].data_ptr()
    with pytest.raises(ValueError, match="kind"):
        pool.page_view(0, "state")


# ---- guard canaries ------------------------------------------------------------------------------
def test_canaries_trivially_true_without_guards():
    pool = deepseek_pool(layer_num=2)
    assert pool.guard_allocations == () and pool.canaries_intact()


@pytest.mark.parametrize("dtype", ["fp8", "bf16"])
def test_canaries_catch_writes_past_a_buffer(dtype, pool_bytes):
    g = 64
    pool = deepseek_pool(dtype=dtype, layer_num=3, guard_bytes=g)
    assert len(pool.guard_allocations) == 6
    assert pool.get_kv_size_bytes() == allocation_bytes(pool.layout, 128)
    validate_descriptors(pool.buffer_descriptors(), pool.layout)
    for base in pool.guard_allocations:  # buffers start zeroed, guards hold the canary
        assert not base[g:-g].any()
    pool_bytes.fill(pool, seed=1)
    for view in pool_bytes.views(pool).values():
        view.fill_(0xFF)  # every byte of every page, through the public views
    assert pool.canaries_intact()
    for d, base in zip(
        sorted(pool.buffer_descriptors(), key=lambda d: (d.kind != "kv", d.layer_id)),
        pool.guard_allocations,
        strict=True,
    ):
        assert base.data_ptr() + g == d.ptr and base.numel() == d.nbytes + 2 * g
    last = pool.guard_allocations[-1]
    last[-g] = 0x00  # one byte past the end of the last indexer buffer
    assert not pool.canaries_intact()
    last[-g] = 0xCD
    assert pool.canaries_intact()
    pool.guard_allocations[0][g - 1] = 0x00  # one byte before the first KV buffer
    assert not pool.canaries_intact()


# ---- GPU ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_pool_on_cuda_reports_device():
    pool = deepseek_pool(layer_num=2, device="cuda", guard_bytes=64)
    descs = pool.buffer_descriptors()
    assert {d.device for d in descs} == {"cuda:0"} and pool.device == "cuda:0"
    locs = torch.arange(64, 96, device="cuda")
    pool.move_kv_cache(locs + 32, locs)
    with pytest.raises(ValueError, match="tgt_loc"):
        pool.move_kv_cache(locs.cpu(), locs)
    assert pool.canaries_intact()
