"""move_kv_cache, get_cpu_copy and load_cpu_copy against byte-level oracles; bad input changes
nothing. The oracle addresses the indexer with the design's formula (page row, key bytes at
``offset * D``, scale bytes at ``page_size * D + offset * S``), independently of the pool's views.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsa_bridge.plugin import DSALayout, DSATokenToKVPool

PAGE = 64
SIZE = 4 * PAGE
ROWS = SIZE + PAGE
LAYOUT = DSALayout(
    layer_ids=(3, 4),
    page_size=PAGE,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    kv_dtype="fp8",
    index_head_dim=128,
)


def token_bytes(layout: DSALayout, snap: dict, lid: int, loc: int) -> tuple:
    """(kv row, index key bytes, index scale bytes) of one token in a snapshot."""
    ps, d, s = layout.page_size, layout.index_head_dim, layout.index_scale_bytes
    page, off = divmod(loc, ps)
    kv = snap[(lid, "kv")].reshape(-1, layout.kv_row_bytes)[loc]
    row = snap[(lid, "index")][page]
    return kv, row[off * d : (off + 1) * d], row[ps * d + off * s : ps * d + (off + 1) * s]


def oracle_write(layout: DSALayout, snap: dict, lid: int, loc: int, values: tuple) -> None:
    ps, d, s = layout.page_size, layout.index_head_dim, layout.index_scale_bytes
    page, off = divmod(loc, ps)
    snap[(lid, "kv")].reshape(-1, layout.kv_row_bytes)[loc] = values[0]
    row = snap[(lid, "index")][page]
    row[off * d : (off + 1) * d] = values[1]
    row[ps * d + off * s : ps * d + (off + 1) * s] = values[2]


def oracle_move(layout: DSALayout, before: dict, tgt: list[int], src: list[int]) -> dict:
    after = {k: v.copy() for k, v in before.items()}
    for lid in layout.layer_ids:
        for t, s in zip(tgt, src, strict=True):
            oracle_write(layout, after, lid, t, token_bytes(layout, before, lid, s))
    return after


def make_pool(pool_bytes, layout: DSALayout = LAYOUT, seed: int = 0, **kw) -> DSATokenToKVPool:
    pool = DSATokenToKVPool.from_layout(layout, SIZE, **kw)
    pool_bytes.fill(pool, seed)
    return pool


def locs(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


# ---- move_kv_cache -------------------------------------------------------------------------------
@st.composite
def moves(draw):
    """Distinct targets outside page 0; sources anywhere, often overlapping the targets."""
    tgt = draw(st.lists(st.integers(PAGE, ROWS - 1), min_size=1, max_size=48, unique=True))
    src = []
    for _ in tgt:
        if draw(st.booleans()):
            src.append(draw(st.integers(0, ROWS - 1)))
        else:  # a neighbour of some target: chains and swaps
            near = draw(st.sampled_from(tgt)) + draw(st.integers(-2, 2))
            src.append(min(max(near, 0), ROWS - 1))
    return tgt, src


@settings(max_examples=60, deadline=None)
@given(moves(), st.integers(0, 2**16))
def test_move_kv_cache_matches_oracle(pool_bytes, move, seed):
    tgt, src = move
    pool = make_pool(pool_bytes, seed=seed)
    before = pool_bytes.snapshot(pool)
    pool.move_kv_cache(locs(tgt), locs(src))
    pool_bytes.assert_equal(pool, oracle_move(LAYOUT, before, tgt, src))


@pytest.mark.parametrize(
    "layout",
    [
        dataclasses.replace(LAYOUT, kv_dtype="bf16"),
        dataclasses.replace(LAYOUT, kv_dtype="fp8_raw", index_head_dim=256, index_quant_block=64),
        dataclasses.replace(LAYOUT, page_size=1),
        dataclasses.replace(LAYOUT, page_size=16, layer_ids=(0, 1, 2, 61)),
    ],
)
def test_move_kv_cache_other_geometries(pool_bytes, layout):
    pool = DSATokenToKVPool.from_layout(layout, SIZE)
    pool_bytes.fill(pool, seed=7)
    rows = SIZE + layout.page_size
    gen = torch.Generator().manual_seed(3)
    tgt = (torch.randperm(SIZE, generator=gen)[:40] + layout.page_size).tolist()
    src = torch.randint(0, rows, (40,), generator=gen).tolist()
    before = pool_bytes.snapshot(pool)
    pool.move_kv_cache(locs(tgt), locs(src))
    pool_bytes.assert_equal(pool, oracle_move(layout, before, tgt, src))


def test_move_chain_uses_a_snapshot_of_the_sources(pool_bytes):
    """Shift 100 tokens right by one: each target gets its source's OLD bytes."""
    pool = make_pool(pool_bytes)
    before = pool_bytes.snapshot(pool)
    src = list(range(100, 200))
    tgt = [s + 1 for s in src]
    pool.move_kv_cache(locs(tgt), locs(src))
    after = pool_bytes.snapshot(pool)
    for lid in LAYOUT.layer_ids:
        for t, s in zip(tgt, src, strict=True):
            got, want = token_bytes(LAYOUT, after, lid, t), token_bytes(LAYOUT, before, lid, s)
            for g, w in zip(got, want, strict=True):
                np.testing.assert_array_equal(g, w)
    pool_bytes.assert_equal(pool, oracle_move(LAYOUT, before, tgt, src))


def test_move_indexer_bytes_land_by_page_and_offset(pool_bytes):
    """One token, known bytes: the key goes to offset*128, the scales to 64*128 + offset*4."""
    pool = DSATokenToKVPool.from_layout(LAYOUT, SIZE)
    idx = pool.page_view(3, "index")
    idx[1, 5 * 128 : 6 * 128] = 0x11  # token 69 = page 1, offset 5
    idx[1, 64 * 128 + 5 * 4 : 64 * 128 + 6 * 4] = 0x22
    pool.move_kv_cache(locs([130]), locs([69]))  # -> page 2, offset 2
    row = idx[2]
    assert bool((row[2 * 128 : 3 * 128] == 0x11).all())
    assert bool((row[64 * 128 + 2 * 4 : 64 * 128 + 3 * 4] == 0x22).all())
    assert int((row != 0).sum()) == 128 + 4  # nothing else in the page changed
    assert int((pool.page_view(4, "index") != 0).sum()) == 0


def test_move_empty_and_int32_locations(pool_bytes):
    pool = make_pool(pool_bytes)
    before = pool_bytes.snapshot(pool)
    pool.move_kv_cache(locs([]), locs([]))
    pool_bytes.assert_equal(pool, before)
    pool.move_kv_cache(torch.tensor([70], dtype=torch.int32), torch.tensor([5], dtype=torch.int16))
    pool_bytes.assert_equal(pool, oracle_move(LAYOUT, before, [70], [5]))


# ---- host copies ---------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(st.data(), st.integers(1, 9), st.integers(0, 2**16))
def test_cpu_copy_round_trip_to_other_locations(pool_bytes, data, chunk, seed):
    src = data.draw(st.lists(st.integers(PAGE, ROWS - 1), min_size=0, max_size=40, unique=True))
    dst = data.draw(st.permutations(range(PAGE, ROWS)))[: len(src)]
    pool = make_pool(pool_bytes, seed=seed)
    taken = pool_bytes.snapshot(pool)
    copy = pool.get_cpu_copy(locs(src), chunk_size=chunk)
    assert copy.num_tokens == len(src)
    pool_bytes.fill(pool, seed + 1)  # the pool moves on; other tokens share the pages
    later = pool_bytes.snapshot(pool)
    pool.load_cpu_copy(copy, locs(dst), chunk_size=chunk)
    expected = {k: v.copy() for k, v in later.items()}
    for lid in LAYOUT.layer_ids:
        for s, t in zip(src, dst, strict=True):
            oracle_write(LAYOUT, expected, lid, t, token_bytes(LAYOUT, taken, lid, s))
    pool_bytes.assert_equal(pool, expected)


def test_cpu_copy_same_locations_restores_exactly(pool_bytes):
    layout = dataclasses.replace(LAYOUT, kv_dtype="bf16", layer_ids=tuple(range(61)))
    pool = make_pool(pool_bytes, layout=layout, seed=5)
    request = locs(range(PAGE + 10, PAGE + 150))
    original = pool_bytes.snapshot(pool)
    copy = pool.get_cpu_copy(request, chunk_size=32)
    assert copy.kv[0].device.type == "cpu" and copy.kv[0].shape == (140, 1, 576)
    assert copy.index_keys[60].shape == (140, 128) and copy.index_scales[60].shape == (140, 4)
    pool.move_kv_cache(request, locs([0] * 140))  # clobber the request's tokens
    assert not np.array_equal(pool_bytes.snapshot(pool)[(60, "index")], original[(60, "index")])
    pool.load_cpu_copy(copy, request)
    pool_bytes.assert_equal(pool, original)


# ---- bad input: every error before any byte changes ----------------------------------------------
def other_copy(pool_bytes):
    other = DSATokenToKVPool.from_layout(dataclasses.replace(LAYOUT, page_size=32), SIZE)
    return other.get_cpu_copy(locs([40, 41]))


BAD_CALLS = [
    # (call, exception, message)
    (lambda p, b: p.move_kv_cache([70], locs([5])), TypeError, "tgt_loc"),
    (lambda p, b: p.move_kv_cache(locs([70]), [5]), TypeError, "src_loc"),
    (lambda p, b: p.move_kv_cache(torch.tensor([70.0]), locs([5])), TypeError, "tgt_loc"),
    (lambda p, b: p.move_kv_cache(locs([70]), torch.tensor([True])), TypeError, "src_loc"),
    (lambda p, b: p.move_kv_cache(locs([[70]]), locs([5])), ValueError, "tgt_loc"),
    (lambda p, b: p.move_kv_cache(locs([70, 71]), locs([5])), ValueError, "tgt_loc .* src_loc"),
    (lambda p, b: p.move_kv_cache(locs([70, 10]), locs([5, 6])), ValueError, "tgt_loc .*padding"),
    (lambda p, b: p.move_kv_cache(locs([70, ROWS]), locs([5, 6])), ValueError, "tgt_loc out of"),
    (lambda p, b: p.move_kv_cache(locs([70, 71]), locs([5, ROWS])), ValueError, "src_loc out of"),
    (lambda p, b: p.move_kv_cache(locs([70, 71]), locs([-1, 6])), ValueError, "src_loc out of"),
    (lambda p, b: p.move_kv_cache(locs([70, 70]), locs([5, 6])), ValueError, "tgt_loc .*duplicate"),
    (lambda p, b: p.move_kv_cache(locs([70]), locs([5]).to("meta")), ValueError, "src_loc is on"),
    (lambda p, b: p.get_cpu_copy(locs([ROWS + 1])), ValueError, "token_locs out of range"),
    (lambda p, b: p.get_cpu_copy(locs([70]), chunk_size=0), ValueError, "chunk_size"),
    (lambda p, b: p.load_cpu_copy(p.get_cpu_copy(locs([70])), locs([70, 71])), ValueError,
     "token_locs has 2 .* copy holds 1"),
    (lambda p, b: p.load_cpu_copy(p.get_cpu_copy(locs([70, 71])), locs([72, 72])), ValueError,
     "duplicate"),
    (lambda p, b: p.load_cpu_copy(p.get_cpu_copy(locs([70])), locs([3])), ValueError,
     "padding page 0"),
    (lambda p, b: p.load_cpu_copy(p.get_cpu_copy(locs([70])), torch.tensor([70.0])), TypeError,
     "token_locs"),
    (lambda p, b: p.load_cpu_copy(other_copy(b), locs([70, 71])), ValueError,
     "different layout: page_size: 64 != 32"),
    (lambda p, b: p.load_cpu_copy({"kv": []}, locs([70])), TypeError, "copy"),
    (lambda p, b: p.load_cpu_copy(
        dataclasses.replace(p.get_cpu_copy(locs([70, 71])), num_tokens=3), locs([72, 73, 74])
    ), ValueError, r"copy.kv\[0\]"),
]  # fmt: skip


BAD_IDS = [
    "move-tgt-list", "move-src-list", "move-tgt-float", "move-src-bool", "move-tgt-2d",
    "move-length", "move-tgt-page0", "move-tgt-range", "move-src-range", "move-src-negative",
    "move-tgt-duplicate", "move-src-device", "copy-range", "copy-chunk", "load-count",
    "load-duplicate", "load-page0", "load-float", "load-other-layout", "load-not-a-copy",
    "load-bad-shapes",
]  # fmt: skip


@pytest.mark.parametrize(("call", "exc", "message"), BAD_CALLS, ids=BAD_IDS)
def test_bad_input_changes_nothing(pool_bytes, call, exc, message):
    pool = make_pool(pool_bytes, guard_bytes=16)
    before = pool_bytes.snapshot(pool)
    with pytest.raises(exc, match=message):
        call(pool, pool_bytes)
    pool_bytes.assert_equal(pool, before)
    assert pool.canaries_intact()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(-3, ROWS + 3), min_size=1, max_size=12),
    st.lists(st.integers(-3, ROWS + 3), min_size=1, max_size=12),
)
def test_fuzzed_moves_either_succeed_like_the_oracle_or_change_nothing(pool_bytes, tgt, src):
    pool = make_pool(pool_bytes, guard_bytes=16)
    before = pool_bytes.snapshot(pool)
    valid = (
        len(tgt) == len(src)
        and len(set(tgt)) == len(tgt)
        and all(PAGE <= t < ROWS for t in tgt)
        and all(0 <= s < ROWS for s in src)
    )
    if valid:
        pool.move_kv_cache(locs(tgt), locs(src))
        pool_bytes.assert_equal(pool, oracle_move(LAYOUT, before, tgt, src))
    else:
        with pytest.raises(ValueError):
            pool.move_kv_cache(locs(tgt), locs(src))
        pool_bytes.assert_equal(pool, before)
    assert pool.canaries_intact()
