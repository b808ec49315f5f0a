"""Sizing: the design's worked numbers, capacity, real allocation, and the index-sharing report."""

from __future__ import annotations

import dataclasses

import pytest

from dsa_bridge.plugin import (
    DSALayout,
    DSATokenToKVPool,
    allocation_bytes,
    bytes_per_token,
    index_sharing_report,
    load_model_config,
    pool_capacity_tokens,
)

GIB = 1 << 30
DSV32 = DSALayout.preset("deepseek-v3.2")


def test_deepseek_v32_cell_and_capacity():
    assert bytes_per_token(DSV32) == 48_068
    assert 60 * GIB // 48_068 == 1_340_278  # design §3 prints 1,340,279 (rounded, not floored)
    assert pool_capacity_tokens(DSV32, 60 * GIB) == 1_340_224
    assert pool_capacity_tokens(DSV32, 60 * GIB) % 64 == 0


def test_capacity_edges():
    assert pool_capacity_tokens(DSV32, 0) == 0
    assert pool_capacity_tokens(DSV32, 48_068 * 63) == 0
    assert pool_capacity_tokens(DSV32, 48_068 * 64) == 64
    with pytest.raises(ValueError, match="budget_bytes"):
        pool_capacity_tokens(DSV32, -1)
    with pytest.raises(TypeError, match="budget_bytes"):
        pool_capacity_tokens(DSV32, 1.5e9)  # type: ignore[arg-type]


def test_allocation_formula_deepseek():
    size = 1_340_224
    pages = size // 64 + 1  # one padding page per layer; indexer has the same page count
    assert allocation_bytes(DSV32, size) == 61 * pages * (41_984 + 8_448)
    # the padding page (and its indexer row) of every layer comes on top of size * cell
    assert allocation_bytes(DSV32, size) - size * 48_068 == 61 * (41_984 + 8_448)


@pytest.mark.parametrize(
    ("layout", "size", "index_buf_size"),
    [
        (DSV32, 128, None),
        (dataclasses.replace(DSV32, kv_dtype="bf16", layer_ids=(7, 9)), 192, None),
        (dataclasses.replace(DSV32, kv_dtype="fp8_raw", layer_ids=(0,)), 64, 256),
        (dataclasses.replace(DSV32, page_size=1, layer_ids=(0, 1, 2)), 10, None),
        (dataclasses.replace(DSV32, page_size=1, layer_ids=(0, 1)), 10, 13),
    ],
)
def test_allocation_matches_the_pool(layout, size, index_buf_size):
    pool = DSATokenToKVPool.from_layout(layout, size, index_buf_size=index_buf_size)
    assert pool.get_kv_size_bytes() == allocation_bytes(layout, size, index_buf_size)


@pytest.mark.parametrize(
    ("size", "index_buf_size", "exc", "name"),
    [
        (100, None, ValueError, "size"),
        (0, None, ValueError, "size"),
        (64.0, None, TypeError, "size"),
        (128, 64, ValueError, "index_buf_size"),
        (128, 0, ValueError, "index_buf_size"),
    ],
)
def test_allocation_bad_sizes(size, index_buf_size, exc, name):
    with pytest.raises(exc, match=name):
        allocation_bytes(DSV32, size, index_buf_size)


def test_glm52_index_sharing_report_uniform():
    config = load_model_config("glm-5.2")
    layout = DSALayout.from_hf_config(config, kv_dtype="fp8_raw")
    report = index_sharing_report(config, layout)
    assert report["uniform_bytes_per_token"] == 55_224
    assert report["full_only_bytes_per_token"] == 47_700 == 78 * 576 + 21 * 132
    assert round(report["capacity_gain_pct"], 1) == 15.8
    assert round(report["memory_saving_pct"], 1) == 13.6
    assert report["full_layers"] == 21 and report["shared_layers"] == 57
    assert report["full_layer_ids"] == [0, 1, 2, *range(6, 75, 4)]
    # the default layout allocates the uniform cell
    assert report["indexer_layout"] == "uniform"
    assert report["allocated_bytes_per_token"] == bytes_per_token(layout) == 55_224
    budget = 10 * GIB
    assert pool_capacity_tokens(layout, budget) == (budget // 55_224) // 64 * 64


def test_glm52_compact_sizing_recovers_the_15_8_percent():
    config = load_model_config("glm-5.2")
    uniform = DSALayout.from_hf_config(config, kv_dtype="fp8_raw")
    compact = DSALayout.from_hf_config(config, kv_dtype="fp8_raw", indexer_layout="compact")
    assert compact.index_layer_ids == (0, 1, 2, *range(6, 75, 4))
    assert bytes_per_token(compact) == 47_700
    report = index_sharing_report(config, compact)
    assert report["indexer_layout"] == "compact" and report["allocated_bytes_per_token"] == 47_700
    budget = 60 * GIB
    gain = pool_capacity_tokens(compact, budget) / pool_capacity_tokens(uniform, budget)
    assert pool_capacity_tokens(compact, budget) == (budget // 47_700) // 64 * 64 == 1_350_592
    assert round((gain - 1) * 100, 1) == 15.8
    # the real allocation: 78 KV buffers, 21 indexer buffers, each with its padding
    size = 64 * 100
    assert allocation_bytes(compact, size) == 78 * (size + 64) * 576 + 21 * ((size + 65) // 64) * 8448


def test_report_for_a_slice_with_draft_layer():
    config = load_model_config("glm-5.2")
    layout = DSALayout.from_hf_config(
        config, kv_dtype="fp8_raw", start_layer=70, include_draft_layers=True
    )
    report = index_sharing_report(config, layout)
    assert report["full_layer_ids"] == [70, 74, 78]  # draft layer 78 never skips
    assert report["shared_layers"] == 6


def test_report_for_deepseek_saves_nothing():
    report = index_sharing_report(load_model_config("deepseek-v3.2"), DSV32)
    assert report["full_only_bytes_per_token"] == report["uniform_bytes_per_token"] == 48_068
    assert report["capacity_gain_pct"] == 0.0 and report["shared_layers"] == 0
