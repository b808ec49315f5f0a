"""validate_descriptors refuses every shape of bad buffer list, naming the layer (and kind)."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from dsa_bridge.plugin import BufferDescriptor, DSALayout, to_three_lists, validate_descriptors
from dsa_bridge.plugin.descriptors import BufferSet

LAYOUT = DSALayout(
    layer_ids=(4, 5, 6),
    page_size=64,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    kv_dtype="fp8",
    index_head_dim=128,
)
COMPACT = dataclasses.replace(LAYOUT, index_layers=(4, 6))  # layer 5 shares layer 4's indexer
KV_LEN, IDX_LEN = LAYOUT.kv_page_bytes, LAYOUT.index_page_bytes
PAGES = 3


def good() -> list[BufferDescriptor]:
    """Back-to-back buffers, kv then index per layer, starting at 0x10000."""
    descs, ptr = [], 0x10000
    for lid in LAYOUT.layer_ids:
        for kind, item in (("kv", KV_LEN), ("index", IDX_LEN)):
            descs.append(BufferDescriptor(lid, kind, ptr, PAGES * item, item, "cpu"))
            ptr += PAGES * item
    return descs


def test_good_list_passes_and_three_lists():
    descs = good()
    validate_descriptors(descs)
    validate_descriptors(descs, LAYOUT)
    ptrs, lens, items = to_three_lists(descs)
    assert ptrs == [d.ptr for d in descs]
    assert lens == [PAGES * KV_LEN, PAGES * IDX_LEN] * 3
    assert items == [KV_LEN, IDX_LEN] * 3
    assert all(d.num_items == PAGES for d in descs)


def replace_at(i: int, **change) -> list[BufferDescriptor]:
    descs = good()
    descs[i] = msgspec.structs.replace(descs[i], **change)
    return descs


@pytest.mark.parametrize(
    ("descs", "message"),
    [
        (replace_at(3, nbytes=0), "layer 5 index: nbytes is 0"),
        (replace_at(2, ptr=0), "layer 5 kv: null pointer"),
        (replace_at(4, ptr=-8), "layer 6 kv: negative pointer"),
        (replace_at(1, nbytes=PAGES * IDX_LEN + 1), "layer 4 index: nbytes .* not a multiple"),
        (replace_at(0, item_len=0), "layer 4 kv: item_len is 0"),
        (replace_at(5, kind="state"), "layer 6: kind"),
        (replace_at(3, ptr=good()[2].ptr + 64), "layer 5 index .* overlaps layer 5 kv"),
        (replace_at(5, ptr=good()[0].ptr), "layer (4 kv|6 index) .* overlaps layer (4 kv|6 index)"),
        (good() + [good()[2]], "layer 5 kv: duplicate"),
        (good()[1:], "layer 4: has an index buffer but no kv buffer"),
    ],
)
def test_refused_without_layout(descs, message):
    with pytest.raises(ValueError, match=message):
        validate_descriptors(descs)


def test_overlap_inside_a_larger_buffer_is_found():
    descs = good()
    big = msgspec.structs.replace(descs[0], nbytes=30 * KV_LEN)  # swallows everything after it
    with pytest.raises(ValueError, match="overlaps layer 4 kv"):
        validate_descriptors([big, *descs[1:]])


def test_same_address_on_different_devices_is_not_overlap():
    descs = good()
    moved = [msgspec.structs.replace(d, device="cuda:0") if d.layer_id == 6 else d for d in descs]
    moved[4] = msgspec.structs.replace(moved[4], ptr=descs[0].ptr)
    moved[5] = msgspec.structs.replace(moved[5], ptr=descs[1].ptr)
    validate_descriptors(moved, LAYOUT)


@pytest.mark.parametrize(
    ("descs", "message"),
    [
        (replace_at(2, item_len=IDX_LEN, nbytes=PAGES * IDX_LEN), "layer 5 kv: item_len 8448"),
        (
            replace_at(3, ptr=0x800000, item_len=KV_LEN, nbytes=PAGES * KV_LEN),
            "layer 5 index: item_len 41984",
        ),
        (good()[:4], "layer 6: in the layout but has no buffers"),
        (
            [msgspec.structs.replace(d, layer_id=7) if d.layer_id == 6 else d for d in good()],
            "layer 6: in the layout",
        ),
        (
            good()
            + [
                BufferDescriptor(9, "kv", 0x900000, KV_LEN, KV_LEN, "cpu"),
                BufferDescriptor(9, "index", 0x990000, IDX_LEN, IDX_LEN, "cpu"),
            ],
            "layer 9: has buffers but is not in the layout",
        ),
        ([], "layer 4: in the layout but has no buffers"),
        (good()[:3] + good()[4:], "layer 5: the layout holds its indexer but no index buffer"),
        (good(), "layer 5: has an index buffer but layer 5 holds no indexer in this compact layout "
                 r"\(it reuses layer 4's\)"),
    ],
)
def test_refused_against_layout(descs, message):
    layout = COMPACT if "compact" in message else LAYOUT
    with pytest.raises(ValueError, match=message):
        validate_descriptors(descs, layout)


def test_zero_size_regression_shape_of_the_seed():
    """The reverted change's lists: skip-topk layers with (ptr 0, len 0) indexer buffers."""
    descs = [
        msgspec.structs.replace(d, ptr=0, nbytes=0) if d.kind == "index" and d.layer_id == 5 else d
        for d in good()
    ]
    with pytest.raises(ValueError, match="layer 5 index"):
        validate_descriptors(descs)


def test_compact_list_without_the_shared_layers_indexer_passes():
    descs = [d for d in good() if (d.layer_id, d.kind) != (5, "index")]
    validate_descriptors(descs)
    validate_descriptors(descs, COMPACT)


# ---- SGLang's three-list form, with layer ids -------------------------------------------------
def sglang_lists(descs, zero_row_layers=()):
    """What SGLang 0.5.23's pool hands to KVArgs: a (0, 0, 0) state entry for index-sharing layers."""
    kv = [d for d in descs if d.kind == "kv"]
    state = [d for d in descs if d.kind == "index"]
    state_lists = ([0 if d.layer_id in zero_row_layers else d.ptr for d in state],
                   [0 if d.layer_id in zero_row_layers else d.nbytes for d in state],
                   [0 if d.layer_id in zero_row_layers else d.item_len for d in state])
    return to_three_lists(kv), [d.layer_id for d in kv], state_lists, [d.layer_id for d in state]


def test_from_buf_infos_normalises_zero_row_entries_to_absent(caplog):
    kv, kv_ids, state, state_ids = sglang_lists(good(), zero_row_layers=(5,))
    with caplog.at_level("INFO"):
        buffers = BufferSet.from_buf_infos(COMPACT, kv, kv_ids, state, state_ids)
    keys = [(d.layer_id, d.kind) for d in buffers.buffer_descriptors()]
    assert keys == [(4, "kv"), (4, "index"), (5, "kv"), (6, "kv"), (6, "index")]
    assert all(d.ptr > 0 and d.nbytes > 0 and d.item_len > 0 for d in buffers.buffer_descriptors())
    assert "layers [5]" in caplog.text


def test_from_buf_infos_zero_rows_against_a_uniform_layout_are_refused():
    kv, kv_ids, state, state_ids = sglang_lists(good(), zero_row_layers=(5,))
    with pytest.raises(ValueError, match="layer 5: the layout holds its indexer"):
        BufferSet.from_buf_infos(LAYOUT, kv, kv_ids, state, state_ids)


def test_from_buf_infos_uniform_round_trip():
    kv, kv_ids, state, state_ids = sglang_lists(good())
    buffers = BufferSet.from_buf_infos(LAYOUT, kv, kv_ids, state, state_ids)
    assert buffers.buffer_descriptors() == good()


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda kv, state: kv[1].__setitem__(0, 0), "kv entry 0 \\(layer 4\\).*zero-length"),
        (lambda kv, state: kv[0].__setitem__(1, 0), "kv entry 1 \\(layer 5\\).*null pointer"),
        (lambda kv, state: state[0].__setitem__(1, 0), "state entry 1 \\(layer 5\\).*null pointer"),
        (lambda kv, state: state[2].__setitem__(0, 0), "state entry 0 \\(layer 4\\).*item_len of 0"),
        (lambda kv, state: kv[2].pop(), "kv buffer infos are ragged"),
        (lambda kv, state: state[1].__setitem__(0, -1), "state entry 0: len must be a non-negative"),
    ],
)
def test_from_buf_infos_refuses_bad_entries(mutate, message):
    kv, kv_ids, state, state_ids = sglang_lists(good())
    kv, state = [list(x) for x in kv], [list(x) for x in state]
    mutate(kv, state)
    with pytest.raises(ValueError, match=message):
        BufferSet.from_buf_infos(LAYOUT, tuple(kv), kv_ids, tuple(state), state_ids)


def test_from_buf_infos_pairs_by_layer_id_not_position():
    kv, kv_ids, state, state_ids = sglang_lists(good())
    # the state lists in reverse order, with their ids: the same buffers
    state = tuple(list(reversed(x)) for x in state)
    buffers = BufferSet.from_buf_infos(LAYOUT, kv, kv_ids, state, list(reversed(state_ids)))
    assert buffers.buffer_descriptors() == good()
    with pytest.raises(ValueError, match="layer 7: has an index buffer but no kv buffer"):
        BufferSet.from_buf_infos(LAYOUT, kv, kv_ids, state, [7, 5, 4])
