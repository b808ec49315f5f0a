"""move_kv_cache, get_cpu_copy and load_cpu_copy against byte-level oracles, on one thread and
with helper threads, for any chunk size and into a reused host copy (``out=``); bad input changes
nothing (neither the pool nor ``out``). The oracle addresses the indexer with the design's formula
(page row, key bytes at ``offset * D``, scale bytes at ``page_size * D + offset * S``),
independently of the pool's views.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsa_bridge.plugin import CpuCopy, DSALayout, DSATokenToKVPool
from dsa_bridge.plugin import pool as pool_module

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


def oracle_move(layout: DSALayout, before: dict, tgt: list[int], src: list[int],
                source: dict | None = None) -> dict:
    """``before`` with each token ``src[i]``'s bytes written at ``tgt[i]`` (every layer), taken
    from the snapshot ``source`` (default: ``before`` itself)."""
    source = before if source is None else source
    after = {k: v.copy() for k, v in before.items()}
    for lid in layout.layer_ids:
        for t, s in zip(tgt, src, strict=True):
            oracle_write(layout, after, lid, t, token_bytes(layout, source, lid, s))
    return after


def make_pool(pool_bytes, layout: DSALayout = LAYOUT, seed: int = 0, **kw) -> DSATokenToKVPool:
    pool = DSATokenToKVPool.from_layout(layout, SIZE, **kw)
    pool_bytes.fill(pool, seed)
    return pool


def locs(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


@contextlib.contextmanager
def torch_threads(threads: int):
    """The pool's CPU copies share their work among ``torch.get_num_threads()`` threads; here
    however short they are (these pools are small)."""
    saved = torch.get_num_threads(), pool_module.MIN_SHARED_COPY_BYTES
    torch.set_num_threads(threads)
    pool_module.MIN_SHARED_COPY_BYTES = 0
    try:
        yield
    finally:
        torch.set_num_threads(saved[0])
        pool_module.MIN_SHARED_COPY_BYTES = saved[1]


def copy_bytes(copy) -> dict:
    return {(field, i): t.numpy().copy() for field in ("kv", "index_keys", "index_scales")
            for i, t in enumerate(getattr(copy, field))}


def assert_copy_holds(layout: DSALayout, copy, snap: dict, taken: list[int]) -> None:
    """Row j of every copy tensor holds token ``taken[j]`` of ``snap``, every layer."""
    assert copy.num_tokens == len(taken)
    for i, lid in enumerate(layout.layer_ids):
        got = (copy.kv[i].view(torch.uint8).reshape(len(taken), layout.kv_row_bytes).numpy(),
               copy.index_keys[i].numpy(), copy.index_scales[i].numpy())
        for j, loc in enumerate(taken):
            for part, want in zip(got, token_bytes(layout, snap, lid, loc), strict=True):
                np.testing.assert_array_equal(part[j], want, err_msg=f"layer {lid} row {j}")


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
@given(moves(), st.integers(0, 2**16), st.sampled_from([1, 2, 3]))
def test_move_kv_cache_matches_oracle(pool_bytes, move, seed, threads):
    tgt, src = move
    pool = make_pool(pool_bytes, seed=seed)
    before = pool_bytes.snapshot(pool)
    with torch_threads(threads):
        pool.move_kv_cache(locs(tgt), locs(src))
    pool_bytes.assert_equal(pool, oracle_move(LAYOUT, before, tgt, src))


def test_copies_are_shared_among_threads_only_when_long_enough(pool_bytes, monkeypatch):
    """Short copies stay on the calling thread (two threads would only pass the GIL back and
    forth); long ones are shared among torch.get_num_threads() threads."""
    calls = []
    monkeypatch.setattr(pool_module, "run_tasks",
                        lambda tasks, threads: calls.append((len(tasks), threads)))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    pool = make_pool(pool_bytes)
    request = locs(range(PAGE, 3 * PAGE))  # 128 tokens, 6 copies of 34 KB on average
    pool.move_kv_cache(request + 2 * PAGE, request)
    pool.get_cpu_copy(request)
    monkeypatch.setattr(pool_module, "MIN_SHARED_COPY_BYTES", 128 * LAYOUT.bytes_per_token // 6)
    pool.move_kv_cache(request + 2 * PAGE, request)
    pool.load_cpu_copy(pool.get_cpu_copy(request, chunk_size=64), request, chunk_size=128)
    assert calls == [(6, 1), (6, 1), (6, 3), (6, 1), (6, 1), (6, 3)]


@pytest.mark.parametrize("threads", [1, 2])
def test_move_whole_pages_matches_oracle(pool_bytes, threads):
    """A request's tokens (whole pages, in runs and alone), disjoint and overlapping moves."""
    layout = dataclasses.replace(LAYOUT, layer_ids=tuple(range(7)))
    pool = make_pool(pool_bytes, layout=layout, seed=11)
    pages = [list(range(p * PAGE, (p + 1) * PAGE)) for p in range(5)]
    cases = [(pages[3] + pages[4], pages[1] + pages[2]),  # one run each, disjoint
             (pages[4] + pages[2], pages[1] + pages[3]),  # single pages
             (pages[2] + pages[3], pages[1] + pages[2])]  # overlapping: from a snapshot
    for tgt, src in cases:
        before = pool_bytes.snapshot(pool)
        with torch_threads(threads):
            pool.move_kv_cache(locs(tgt), locs(src))
        pool_bytes.assert_equal(pool, oracle_move(layout, before, tgt, src))


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
    pool_bytes.assert_equal(pool, oracle_move(LAYOUT, later, dst, src, source=taken))


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


BIG = 12 * PAGE  # the chunk-size property's pool: room for many single tokens besides pages


@st.composite
def request_locations(draw):
    """Unique token locations outside page 0 made of whole pages (a request's: each page's tokens
    in order) and single tokens, in any order: whole pages land anywhere in the copy, so a chunk
    size cuts them anywhere."""
    pages = draw(st.lists(st.integers(1, BIG // PAGE), max_size=4, unique=True))
    singles = draw(st.lists(st.integers(PAGE, BIG + PAGE - 1), max_size=90, unique=True))
    segments = [list(range(p * PAGE, (p + 1) * PAGE)) for p in pages]
    segments += [[loc] for loc in singles if loc // PAGE not in pages]
    order = draw(st.permutations(range(len(segments))))
    return [loc for i in order for loc in segments[i]]


def chunk_sizes(n: int):
    """Any positive size; often one that makes a later chunk the last 1-3 pages' worth."""
    tails = [n - k * PAGE for k in (1, 2, 3) if n - k * PAGE > 0]
    fixed = st.sampled_from([1, 3, 63, 64, 65, 127, 128, 129, 8192])
    return st.one_of(st.sampled_from(tails), fixed, st.integers(1, 4 * PAGE)) if tails else fixed


@settings(max_examples=80, deadline=None)
@given(st.data(), request_locations(), st.permutations(range(1, BIG // PAGE + 1)),
       st.sampled_from([1, 2]), st.integers(0, 2**16))
@pytest.mark.slow
def test_cpu_copy_any_chunk_size_matches_oracle(pool_bytes, data, src, page_map, threads, seed):
    """Any positive chunk size copies the right bytes, whole pages falling anywhere in a chunk
    or across chunks; loaded to other pages (same offsets: whole pages stay whole)."""
    get_chunk, load_chunk = data.draw(chunk_sizes(len(src))), data.draw(chunk_sizes(len(src)))
    dst = [page_map[loc // PAGE - 1] * PAGE + loc % PAGE for loc in src]
    pool = DSATokenToKVPool.from_layout(LAYOUT, BIG)
    pool_bytes.fill(pool, seed)
    taken = pool_bytes.snapshot(pool)
    with torch_threads(threads):
        copy = pool.get_cpu_copy(locs(src), chunk_size=get_chunk)
        assert_copy_holds(LAYOUT, copy, taken, src)
        pool_bytes.fill(pool, seed + 1)
        later = pool_bytes.snapshot(pool)
        pool.load_cpu_copy(copy, locs(dst), chunk_size=load_chunk)
    pool_bytes.assert_equal(pool, oracle_move(LAYOUT, later, dst, src, source=taken))


@pytest.mark.parametrize("chunk", [3, 65])
def test_cpu_copy_odd_chunk_ending_in_a_whole_page(pool_bytes, chunk):
    """65 single tokens, then a whole page: with chunk_size 65 the page is a chunk of its own at
    row 65 of the copy (its scale bytes at offset 260, not a multiple of 8) — this used to raise
    after the first chunk had been written."""
    src = list(range(PAGE + 1, PAGE + 66)) + list(range(3 * PAGE, 4 * PAGE))
    dst = list(range(2 * PAGE + 1, 2 * PAGE + 66)) + list(range(4 * PAGE, 5 * PAGE))
    pool = make_pool(pool_bytes, seed=4)
    before = pool_bytes.snapshot(pool)
    copy = pool.get_cpu_copy(locs(src), chunk_size=chunk)
    assert_copy_holds(LAYOUT, copy, before, src)
    pool.load_cpu_copy(copy, locs(dst), chunk_size=chunk)
    pool_bytes.assert_equal(pool, oracle_move(LAYOUT, before, dst, src))


@pytest.mark.parametrize("threads", [1, 2])
def test_get_cpu_copy_into_a_reused_copy(pool_bytes, threads):
    """``out=``: the bytes land in the given tensors (no new host memory), as a fresh copy's."""
    pool = make_pool(pool_bytes, seed=8)
    first = locs(range(PAGE, 3 * PAGE))
    out = pool.get_cpu_copy(first)
    ptrs = [t.data_ptr() for t in (*out.kv, *out.index_keys, *out.index_scales)]
    pool_bytes.fill(pool, 9)
    again = list(range(3 * PAGE, 4 * PAGE)) + list(range(PAGE + 7, 2 * PAGE + 7))
    with torch_threads(threads):
        got = pool.get_cpu_copy(locs(again), out=out, chunk_size=50)
    assert got is out
    assert [t.data_ptr() for t in (*got.kv, *got.index_keys, *got.index_scales)] == ptrs
    assert_copy_holds(LAYOUT, got, pool_bytes.snapshot(pool), again)
    fresh = copy_bytes(pool.get_cpu_copy(locs(again)))
    for key, value in copy_bytes(got).items():
        np.testing.assert_array_equal(value, fresh[key], err_msg=str(key))


def carved_copy(layout: DSALayout, n: int) -> tuple[CpuCopy, torch.Tensor]:
    """A CpuCopy of n tokens whose tensors are carved from one zeroed host buffer, one byte in:
    at offsets no word size divides. Returns it and the buffer."""
    sizes = [n * layout.kv_row_bytes, n * layout.index_head_dim, n * layout.index_scale_bytes]
    base = torch.zeros(1 + layout.num_layers * sum(sizes) + 1, dtype=torch.uint8)
    tensors, at = [], 1
    for _ in layout.layer_ids:
        for nbytes in sizes:
            tensors.append(base[at:at + nbytes])
            at += nbytes
    out = CpuCopy(layout=layout, num_tokens=n,
                  kv=tuple(t.view(n, 1, layout.kv_cache_dim) for t in tensors[0::3]),
                  index_keys=tuple(t.view(n, layout.index_head_dim) for t in tensors[1::3]),
                  index_scales=tuple(t.view(n, layout.index_scale_bytes) for t in tensors[2::3]))
    return out, base


@pytest.mark.parametrize(("src", "chunk"), [
    (list(range(2 * PAGE, 4 * PAGE)), 8192),  # whole pages: by page
    (list(range(PAGE + 3, PAGE + 8)) + list(range(2 * PAGE, 3 * PAGE)), 7),  # by token
])
def test_cpu_copy_with_tensors_at_odd_offsets(pool_bytes, src, chunk):
    """``out`` tensors (then loaded back) carved from one host buffer at odd byte offsets."""
    pool = make_pool(pool_bytes, seed=12)
    out, base = carved_copy(LAYOUT, len(src))
    before = pool_bytes.snapshot(pool)
    pool.get_cpu_copy(locs(src), out=out, chunk_size=chunk)
    assert_copy_holds(LAYOUT, out, before, src)
    assert int(base[0]) == 0 and int(base[-1]) == 0  # nothing written outside the tensors
    dst = [loc + PAGE for loc in src]
    pool.load_cpu_copy(out, locs(dst), chunk_size=chunk)
    pool_bytes.assert_equal(pool, oracle_move(LAYOUT, before, dst, src))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("chunk", [7, 65, 8192])
def test_cpu_copy_round_trip_on_cuda(pool_bytes, chunk):
    """A CUDA pool: host copies (new, and into tensors at odd offsets) and back, by page and by
    token, any chunk size; and a move."""
    pool = DSATokenToKVPool.from_layout(LAYOUT, SIZE, device="cuda")
    pool_bytes.fill(pool, 3)
    before = pool_bytes.snapshot(pool)
    src = list(range(PAGE + 1, PAGE + 66)) + list(range(3 * PAGE, 4 * PAGE))
    dst = list(range(2 * PAGE + 1, 2 * PAGE + 66)) + list(range(4 * PAGE, 5 * PAGE))
    copy = pool.get_cpu_copy(locs(src).cuda(), chunk_size=chunk)
    assert copy.kv[0].device.type == "cpu"
    assert_copy_holds(LAYOUT, copy, before, src)
    carved, _ = carved_copy(LAYOUT, len(src))
    pool.get_cpu_copy(locs(src).cuda(), chunk_size=chunk, out=carved)
    assert_copy_holds(LAYOUT, carved, before, src)
    pool.load_cpu_copy(carved, locs(dst).cuda(), chunk_size=chunk)
    pool_bytes.assert_equal(pool, oracle_move(LAYOUT, before, dst, src))
    moved = pool_bytes.snapshot(pool)
    pool.move_kv_cache(locs(src).cuda(), locs(dst).cuda())
    pool_bytes.assert_equal(pool, oracle_move(LAYOUT, moved, src, dst))


# ---- bad input: every error before any byte changes ----------------------------------------------
def other_copy(pool_bytes):
    other = DSATokenToKVPool.from_layout(dataclasses.replace(LAYOUT, page_size=32), SIZE)
    return other.get_cpu_copy(locs([40, 41]))


def with_tensor(copy, field: str, i: int, tensor: torch.Tensor):
    tensors = list(getattr(copy, field))
    tensors[i] = tensor
    return dataclasses.replace(copy, **{field: tuple(tensors)})


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
    (lambda p, b: p.get_cpu_copy(locs([70]), chunk_size=True), TypeError, "chunk_size"),
    (lambda p, b: p.load_cpu_copy(p.get_cpu_copy(locs([70, 71])), locs([72, 73]), chunk_size=0),
     ValueError, "chunk_size must be >= 1"),
    (lambda p, b: p.load_cpu_copy(p.get_cpu_copy(locs([70, 71])), locs([72, 73]), chunk_size=-3),
     ValueError, "chunk_size must be >= 1"),
    (lambda p, b: p.load_cpu_copy(p.get_cpu_copy(locs([70, 71])), locs([72, 73]), chunk_size=2.5),
     TypeError, "chunk_size must be an int"),
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
    (lambda p, b: p.load_cpu_copy(with_tensor(p.get_cpu_copy(locs([70, 71])), "index_scales", 1,
                                              torch.zeros(2, 4, dtype=torch.uint8, device="meta")),
                                  locs([72, 73])), ValueError,
     r"copy.index_scales\[1\] is on meta, which holds no bytes"),
    (lambda p, b: p.load_cpu_copy(with_tensor(p.get_cpu_copy(locs([70, 71])), "kv", 0, [0, 1]),
                                  locs([72, 73])), TypeError, r"copy.kv\[0\] must be a torch.Tensor"),
    (lambda p, b: p.load_cpu_copy(
        dataclasses.replace(p.get_cpu_copy(locs([70, 71])), num_tokens=3), locs([72, 73, 74])
    ), ValueError, r"copy.kv\[0\]"),
]  # fmt: skip


BAD_IDS = [
    "move-tgt-list", "move-src-list", "move-tgt-float", "move-src-bool", "move-tgt-2d",
    "move-length", "move-tgt-page0", "move-tgt-range", "move-src-range", "move-src-negative",
    "move-tgt-duplicate", "move-src-device", "copy-range", "copy-chunk", "copy-chunk-bool",
    "load-chunk-zero", "load-chunk-negative", "load-chunk-float", "load-count",
    "load-duplicate", "load-page0", "load-float", "load-other-layout", "load-not-a-copy",
    "load-meta-tensor", "load-not-a-tensor", "load-bad-shapes",
]  # fmt: skip


@pytest.mark.parametrize(("call", "exc", "message"), BAD_CALLS, ids=BAD_IDS)
def test_bad_input_changes_nothing(pool_bytes, call, exc, message):
    pool = make_pool(pool_bytes, guard_bytes=16)
    before = pool_bytes.snapshot(pool)
    with pytest.raises(exc, match=message):
        call(pool, pool_bytes)
    pool_bytes.assert_equal(pool, before)
    assert pool.canaries_intact()


BAD_OUTS = [
    # (make out from (pool, a good out of 2 tokens), token locations, exception, message)
    (lambda p, o: {"kv": o.kv}, [70, 71], TypeError, "out must be a CpuCopy"),
    (lambda p, o: other_copy(None), [70, 71], ValueError, "out was taken from a different layout"),
    (lambda p, o: o, [70, 71, 72], ValueError, "out holds 2 tokens but token_locs has 3"),
    (lambda p, o: o, [70, ROWS], ValueError, "token_locs out of range"),
    (lambda p, o: with_tensor(o, "index_keys", 1, torch.zeros(2, 64, dtype=torch.uint8)),
     [70, 71], ValueError, r"out.index_keys\[1\] is \(2, 64\)"),
    (lambda p, o: with_tensor(o, "index_scales", 0, torch.zeros(4, 2, dtype=torch.uint8).T),
     [70, 71], ValueError, r"out.index_scales\[0\] is not contiguous"),
    (lambda p, o: with_tensor(o, "kv", 1, o.kv[1].to("meta")), [70, 71], ValueError,
     r"out.kv\[1\] is on meta, expected cpu"),
    (lambda p, o: with_tensor(o, "kv", 1, o.kv[0]), [70, 71], ValueError,
     r"out.kv\[1\] overlaps out.kv\[0\]"),
    (lambda p, o: with_tensor(o, "index_scales", 1, o.index_keys[1][:, :4]), [70, 71], ValueError,
     r"out.index_scales\[1\] is not contiguous"),
    (lambda p, o: with_tensor(o, "index_scales", 1, o.index_keys[1].reshape(-1)[4:12].view(2, 4)),
     [70, 71], ValueError, r"out.index_scales\[1\] overlaps out.index_keys\[1\]"),
    (lambda p, o: with_tensor(o, "index_keys", 0, p.page_view(3, "index")[1, :256].view(2, 128)),
     [70, 71], ValueError, r"out.index_keys\[0\] overlaps the pool's buffers"),
]  # fmt: skip


@pytest.mark.parametrize(("make_out", "token_locs", "exc", "message"), BAD_OUTS,
                         ids=["not-a-copy", "other-layout", "count", "locs-range", "shape",
                              "not-contiguous", "device", "aliased", "strided-alias",
                              "overlapping", "pool-alias"])
def test_bad_out_changes_nothing(pool_bytes, make_out, token_locs, exc, message):
    pool = make_pool(pool_bytes, guard_bytes=16)
    good = pool.get_cpu_copy(locs([90, 91]))
    for t in (*good.kv, *good.index_keys, *good.index_scales):
        t.view(torch.uint8).fill_(0x5A)
    out = make_out(pool, good)
    before, held = pool_bytes.snapshot(pool), copy_bytes(good)
    with pytest.raises(exc, match=message):
        pool.get_cpu_copy(locs(token_locs), out=out)
    pool_bytes.assert_equal(pool, before)
    for key, value in copy_bytes(good).items():
        np.testing.assert_array_equal(value, held[key], err_msg=str(key))
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
