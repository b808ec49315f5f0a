"""The planner: pairing by layer id, bounds, coalescing, and exact byte coverage."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsa_bridge.plugin.descriptors import BufferDescriptor
from dsa_bridge.transfer.plan import (
    PairTable,
    PlanError,
    as_aux_buffers,
    check_aux_index,
    coalesce_runs,
    pair_aux,
    pair_buffers,
    plan_chunk,
    plan_writes,
    with_aux_writes,
)

KV, IDX = 41984, 8448


def buffers(layer_ids, base, pages, kv=KV, idx=IDX):
    out = []
    for i, layer in enumerate(layer_ids):
        out.append(BufferDescriptor(layer, "kv", base + i * 10**9, pages * kv, kv))
        out.append(BufferDescriptor(layer, "index", base + i * 10**9 + 5 * 10**8, pages * idx, idx))
    return out


def pairs(layers=(0, 1, 2), src_pages=100, dst_pages=80):
    return pair_buffers(buffers(layers, 10**12, src_pages), buffers(layers, 2 * 10**12, dst_pages))


def test_pairs_by_global_layer_id_not_position():
    local = buffers((30, 31), 10**12, 10)
    remote = list(reversed(buffers((30, 31), 2 * 10**12, 10)))
    for pair in pair_buffers(local, remote):
        assert (pair.src.layer_id, pair.src.kind) == (pair.dst.layer_id, pair.dst.kind)


@pytest.mark.parametrize("remote_layers, message", [
    ((30,), "peer has no kv buffer for layer 31"),
    ((30, 31, 32), "layer 32 that this side lacks"),
    ((30, 32), "peer has no kv buffer for layer 31"),
])
def test_layer_sets_must_match(remote_layers, message):
    with pytest.raises(PlanError, match=message):
        pair_buffers(buffers((30, 31), 10**12, 10), buffers(remote_layers, 2 * 10**12, 10))


def test_item_len_must_match():
    with pytest.raises(PlanError, match="kv item_len of layer 0: local 41984 != peer 41983"):
        pair_buffers(buffers((0,), 10**12, 10), buffers((0,), 2 * 10**12, 10, kv=41983))


@pytest.mark.parametrize("field", ["ptr", "nbytes"])
def test_null_or_empty_buffers_refused(field):
    remote = buffers((0,), 2 * 10**12, 10)
    remote[1] = msgspec.structs.replace(remote[1], **{field: 0})
    with pytest.raises(PlanError, match="index buffer of layer 0 is empty or null"):
        pair_buffers(buffers((0,), 10**12, 10), remote)


def test_one_write_per_run_per_layer_per_cache():
    plan = plan_writes(pairs(), [5, 6, 7, 20, 21], [1, 2, 3, 9, 10])
    assert plan.runs == 2
    assert plan.descriptors == 2 * 3 * 2
    assert plan.nbytes == 5 * (KV + IDX) * 3
    first = pairs()[0]
    assert plan.src[0] == first.src.ptr + 5 * KV
    assert plan.dst[0] == first.dst.ptr + 1 * KV
    assert plan.length[0] == 3 * KV


@pytest.mark.parametrize("src, dst, message", [
    ([1, 2], [1], "src_pages has 2 pages but dst_pages has 1"),
    ([0, 1], [1, 2], "src_pages contains page 0"),
    ([1, 2], [0, 1], "dst_pages contains page 0"),
    ([1, 100], [1, 2], "src_pages contains page 100, beyond the registered 100 pages"),
    ([1, 2], [1, 80], "dst_pages contains page 80, beyond the registered 80 pages"),
    ([-3, 2], [1, 2], "src_pages contains page -3"),
    ([1, 1], [1, 2], "src_pages lists a page more than once"),
    ([1, 2], [3, 3], "dst_pages lists a page more than once"),
    ([98, 99, 100], [1, 2, 3], "src_pages contains page 100, beyond"),  # one run: its ends
    ([1, 2, 3], [78, 79, 80], "dst_pages contains page 80, beyond"),
    ([0, 2, 1], [1, 2, 3], "src_pages contains page 0"),  # not ascending: by min and max
    ([2**63 - 1, -2**63], [1, 2], "src_pages contains page -9223372036854775808"),  # +1 wrapped
    ([1, 2**62, 2**63 - 1, -2**63 + 1, -1, 3], [1, 2, 3, 4, 5, 6], "src_pages contains page -"),
    ([3, 1, 2, 1], [1, 2, 3, 4], "src_pages lists a page more than once"),  # not ascending
    ([], [], "src_pages is empty"),
    ([1.5], [1], "src_pages must hold integers"),
    ([[1]], [1], "src_pages must be a 1-D"),
])
def test_bad_pages_refused_before_any_address(src, dst, message):
    with pytest.raises(PlanError, match=message):
        plan_writes(pairs(), src, dst)


def test_bounds_use_the_smaller_of_kv_and_index_regions():
    local = buffers((0,), 10**12, 100)
    remote = buffers((0,), 2 * 10**12, 80)
    remote[1] = BufferDescriptor(0, "index", remote[1].ptr, 50 * IDX, IDX)  # fewer indexer rows
    with pytest.raises(PlanError, match="dst_pages contains page 50"):
        plan_writes(pair_buffers(local, remote), [1], [50])


def test_indexer_writes_address_the_same_pages_as_kv_writes():
    """Page p of a KV buffer is row p of the indexer buffer: one page list addresses both."""
    plan = plan_writes(pairs(layers=(0,)), [5, 6, 9], [7, 8, 2])
    kv, index = pairs(layers=(0,))
    runs = plan.runs
    kv_dst, index_dst = plan.dst[:runs], plan.dst[runs:]
    assert ((kv_dst - kv.dst.ptr) // KV).tolist() == [7, 2]
    assert ((index_dst - index.dst.ptr) // IDX).tolist() == [7, 2]
    assert (plan.length[runs:] // IDX).tolist() == (plan.length[:runs] // KV).tolist() == [2, 1]


def test_pairing_a_subset_by_key():
    local, remote = buffers((0, 1), 10**12, 10), buffers((0, 1), 2 * 10**12, 10)
    chosen = pair_buffers(local, remote, [(1, "kv"), (0, "kv"), (1, "index")])
    assert [(p.src.layer_id, p.src.kind) for p in chosen] == [(0, "kv"), (1, "kv"), (1, "index")]
    with pytest.raises(PlanError, match="peer has no index buffer for layer 0"):
        pair_buffers(local, [b for b in remote if (b.layer_id, b.kind) != (0, "index")],
                     [(0, "index")])
    with pytest.raises(PlanError, match="this side has no kv buffer for layer 5"):
        pair_buffers(local, remote, [(5, "kv")])


page_lists = st.integers(1, 60).flatmap(lambda n: st.tuples(
    st.permutations(list(range(1, 100)))
    .map(lambda p: p[:n]),
    st.permutations(list(range(1, 80))).map(lambda p: p[:n]),
))


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(page_lists, st.booleans())
def test_runs_cover_exactly_the_per_page_ranges(lists, sort):
    src, dst = (sorted(x) for x in lists) if sort else lists
    pr = pairs()
    plan = plan_writes(pr, src, dst)
    covered = set()
    for s, d, n in zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist(), strict=True):
        pair = next(p for p in pr if p.src.ptr <= s < p.src.ptr + p.src.nbytes)
        item = pair.src.item_len
        assert n % item == 0 and (s - pair.src.ptr) % item == 0
        for k in range(n // item):
            covered.add((pair.src.ptr + (s - pair.src.ptr) + k * item, d + k * item))
    expected = {(p.src.ptr + a * p.src.item_len, p.dst.ptr + b * p.dst.item_len)
                for p in pr for a, b in zip(src, dst, strict=True)}
    assert covered == expected
    # minimal: a run ends exactly where either side stops stepping by +1
    breaks = sum(1 for i in range(1, len(src))
                 if src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1)
    assert plan.runs == breaks + 1
    assert plan.descriptors == plan.runs * len(pr)


def test_coalesce_is_vectorised_and_handles_one_page():
    s, d, n = coalesce_runs(np.array([7]), np.array([3]))
    assert (s.tolist(), d.tolist(), n.tolist()) == ([7], [3], [1])
    big = np.arange(1, 200_001)
    s, d, n = coalesce_runs(big, big[::-1].copy())
    assert n.size == 200_000


AUX = [(10**6, 8 * 64, 64), (2 * 10**6, 8 * 512, 512)]  # (ptr, nbytes, item_len): 8 slots each


def aux_pairs():
    return pair_aux(as_aux_buffers(AUX), as_aux_buffers([(p + 10**9, n * 2, i) for p, n, i in AUX]))


def test_aux_slots_join_the_plan_after_the_pages():
    plan = plan_writes(pairs(), [5, 6], [1, 2])
    joined = with_aux_writes(plan, aux_pairs(), 3, 11)
    assert joined.descriptors == plan.descriptors + 2 and joined.runs == plan.runs
    assert list(joined.src[-2:]) == [10**6 + 3 * 64, 2 * 10**6 + 3 * 512]
    assert list(joined.dst[-2:]) == [10**9 + 10**6 + 11 * 64, 10**9 + 2 * 10**6 + 11 * 512]
    assert joined.nbytes == plan.nbytes + 64 + 512
    assert with_aux_writes(plan, aux_pairs(), 3, None) is plan  # decode asked for no slot


@pytest.mark.parametrize("src, dst, message", [
    (8, 1, "aux_index 8 is outside the aux buffers' 8 slots"),
    (-2, 1, "aux_index -2 is outside"),
    (1, 16, "decode's aux_index 16 is outside the aux buffers' 16 slots"),
    (None, 1, "decode asked for aux slot 1 but this request has none"),
    ("1", 1, "aux_index must be an int"),
])
def test_aux_slots_are_bounds_checked_before_any_address(src, dst, message):
    with pytest.raises(PlanError, match=message):
        with_aux_writes(plan_writes(pairs(), [5], [1]), aux_pairs(), src, dst)


def test_no_aux_buffers_means_no_slot():
    assert check_aux_index([], None, "aux_index") is None
    assert check_aux_index([], -1, "aux_index") is None
    with pytest.raises(PlanError, match="aux_index is 0 but there are no aux buffers"):
        check_aux_index([], 0, "aux_index")


@pytest.mark.parametrize("remote, message", [
    (AUX[:1], "aux buffers: this side holds 2, the peer 1"),
    ([AUX[0], (3 * 10**6, 8 * 256, 256)], "aux buffer 1: item_len local 512 != peer 256"),
])
def test_aux_pairs_by_position_with_equal_counts_and_item_lens(remote, message):
    with pytest.raises(PlanError, match=message):
        pair_aux(as_aux_buffers(AUX), as_aux_buffers(remote))


@pytest.mark.parametrize("infos, message", [
    ([(0, 64, 64)], "aux buffer 0: ptr must be a positive int"),
    ([(4096, 0, 64)], "aux buffer 0: nbytes must be a positive int"),
    ([(4096, 100, 64)], "nbytes 100 is not a multiple of item_len 64"),
])
def test_bad_aux_buffers_refused(infos, message):
    with pytest.raises(PlanError, match=message):
        as_aux_buffers(infos)


def test_a_pair_table_plans_exactly_what_its_pairs_do():
    table = pairs(layers=(4, 7, 9), src_pages=100, dst_pages=80)
    listed = list(table)
    assert isinstance(table, PairTable) and table == listed and len(table) == 6
    assert (table.src_pages, table.dst_pages) == (100, 80)
    src, dst = np.array([3, 4, 5, 9]), np.array([10, 11, 12, 70])
    fast, slow = plan_writes(table, src, dst), plan_writes(listed, src, dst)
    for key in ("src", "dst", "length"):
        assert getattr(fast, key).dtype == np.uint64
        assert getattr(fast, key).tolist() == getattr(slow, key).tolist()
    assert fast.runs == slow.runs == 2
    with pytest.raises(PlanError, match="dst_pages contains page 80, beyond the registered 80"):
        plan_writes(table, [1], [80])


def test_a_chunk_plan_adds_the_aux_slots_only_with_the_last_chunk():
    table = pairs(layers=(4, 7))
    alone = plan_writes(table, [3, 4], [10, 11])
    middle = plan_chunk(table, [3, 4], [10, 11], last=False, aux_pairs=aux_pairs(), aux_src=3, aux_dst=11)
    last = plan_chunk(table, [3, 4], [10, 11], last=True, aux_pairs=aux_pairs(), aux_src=3, aux_dst=11)
    assert middle.dst.tolist() == alone.dst.tolist()
    assert last.dst.tolist() == with_aux_writes(alone, aux_pairs(), 3, 11).dst.tolist()
    with pytest.raises(PlanError, match="decode asked for aux slot 11 but this request has none"):
        plan_chunk(table, [3], [10], last=True, aux_pairs=aux_pairs(), aux_dst=11)


def test_the_first_plan_imports_nothing():
    """A node's first request must not stall its control thread on an import (np.unique's first
    call imported numpy.ma: ~140 ms, in a process where nothing else had)."""
    code = """
import sys
import numpy as np
from dsa_bridge.plugin.descriptors import BufferDescriptor
from dsa_bridge.transfer.plan import check_destination, pair_buffers, plan_writes
side = lambda base: [BufferDescriptor(0, "kv", base, 64 * 10, 64)]
pairs = pair_buffers(side(1 << 30), side(1 << 31))
before = set(sys.modules)
check_destination(pairs, [3, 4])
plan_writes(pairs, np.array([1, 2]), np.array([3, 4]))
print(sorted(set(sys.modules) - before))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
