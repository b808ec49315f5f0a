"""Every pointer, length and count a peer announces in its handshake is checked, each refusal
naming the field, and the counts before any per-buffer work."""

from __future__ import annotations

import msgspec
import pytest

from dsa_bridge.plugin import DSALayout, descriptors
from dsa_bridge.transfer import handshake
from dsa_bridge.transfer.handshake import (
    HandshakeError,
    buffer_infos,
    check_index_reads,
    check_peer,
    pair_with_peer,
    pool_buffers,
    transfer_set,
)
from dsa_bridge.transfer.plan import BufferDescriptor
from dsa_bridge.transfer.protocol import MAX_BUFFERS, MAX_LAYERS, PROTOCOL_VERSION

from .helpers import SMALL_CONFIG, make_pool

LAYOUT = DSALayout.from_hf_config(SMALL_CONFIG)
POOL = make_pool()
LOCAL = pool_buffers(POOL)
KEYS = transfer_set(LAYOUT, LAYOUT, LAYOUT.index_layer_ids)
BASE = 1 << 40  # the peer's (pretend) buffers start here, one after another
KV, IDX = LAYOUT.kv_page_bytes, LAYOUT.index_page_bytes
PAGES = 8


def peer_buffers() -> list[BufferDescriptor]:
    out, ptr = [], BASE
    for lid in LAYOUT.layer_ids:
        for kind, item in (("kv", KV), ("index", IDX)):
            out.append(BufferDescriptor(lid, kind, ptr, PAGES * item, item))
            ptr += PAGES * item
    return out


def with_buffer(i: int, **change) -> list[BufferDescriptor]:
    buffers = peer_buffers()
    b = buffers[i]
    fields = {"layer_id": b.layer_id, "kind": b.kind, "ptr": b.ptr, "nbytes": b.nbytes,
              "item_len": b.item_len, **change}
    buffers[i] = BufferDescriptor(**fields)
    return buffers


def test_good_buffers_pair():
    pairs = pair_with_peer(LAYOUT, LOCAL, peer_buffers(), KEYS)
    assert [(p.dst.layer_id, p.dst.kind) for p in pairs] == KEYS


@pytest.mark.parametrize(("buffers", "field"), [
    (with_buffer(0, ptr=0), r"layer 0 kv: null pointer \(ptr=0\)"),
    (with_buffer(0, ptr=-4096), r"layer 0 kv: negative pointer \(ptr=-4096\)"),
    (with_buffer(2, ptr=2**63), r"layer 1 kv: ptr \+ nbytes = .* reaches past 2\*\*63"),
    (with_buffer(2, ptr=2**63 - PAGES * KV), r"layer 1 kv: ptr \+ nbytes = 0x8000000000000000"),
    (with_buffer(3, ptr=2**64 - 64), r"layer 1 index: ptr \+ nbytes"),
    (with_buffer(1, nbytes=0), r"layer 0 index: nbytes is 0"),
    (with_buffer(1, nbytes=-IDX), r"layer 0 index: nbytes is -"),
    (with_buffer(1, nbytes=2**63), r"layer 0 index: ptr \+ nbytes = .* nbytes=9223372036854775808"),
    (with_buffer(0, item_len=0), r"layer 0 kv: item_len is 0"),
    (with_buffer(0, item_len=-KV), r"layer 0 kv: item_len is -"),
    (with_buffer(0, nbytes=PAGES * KV + 1), r"layer 0 kv: nbytes \d+ is not a multiple of item_len"),
    (with_buffer(0, item_len=KV // 2), r"layer 0 kv: item_len \d+ != layout's"),
    (with_buffer(4, layer_id=-1), r"layer -1: layer_id must be >= 0"),
    (with_buffer(4, kind="state"), r"layer 2: kind must be one of"),
    (with_buffer(5, ptr=BASE), r"layer 2 index \[0x10000000000, .*\) overlaps layer 0 kv"),
    (with_buffer(2, ptr=BASE + 64), r"layer 1 kv \[0x10000000040, .*\) overlaps layer 0 kv"),
    (with_buffer(3, layer_id=1, kind="kv"), r"layer 1 kv: duplicate descriptor"),
    (with_buffer(7, layer_id=9), r"layer 9: has an index buffer but no kv buffer"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_bad_buffer_is_refused_naming_the_field(buffers, field):
    with pytest.raises(HandshakeError, match=f"peer buffers: {field}"):
        pair_with_peer(LAYOUT, LOCAL, buffers, KEYS)


@pytest.mark.parametrize("count", [0, 7, 9, MAX_BUFFERS + 1, 600_000])
def test_the_buffer_count_is_checked_before_any_buffer(count, monkeypatch):
    def untouched(*args, **kwargs):
        raise AssertionError("a buffer was looked at before the count")

    monkeypatch.setattr(handshake, "validate_descriptors", untouched)
    monkeypatch.setattr(handshake, "BufferDescriptor", untouched)
    buffers = (peer_buffers() * (count // 8 + 1))[:count]
    with pytest.raises(HandshakeError, match=f"peer buffers: {count} announced, but its layout "
                                             r"holds 8 \(4 KV, 4 indexer\)"):
        pair_with_peer(LAYOUT, LOCAL, buffers, KEYS)


def peer_layout(**change) -> dict:
    return {**LAYOUT.to_dict(), **change}


@pytest.mark.parametrize("field", ["layer_ids", "index_layer_ids"])
def test_a_layout_of_too_many_layers_is_refused_before_it_is_built(field, monkeypatch):
    def untouched(*args, **kwargs):
        raise AssertionError("the layout was built")

    monkeypatch.setattr(DSALayout, "from_dict", untouched)
    layout = peer_layout(**{field: list(range(MAX_LAYERS + 1))})
    with pytest.raises(HandshakeError, match=f"{field} lists {MAX_LAYERS + 1} layers, more than "
                                             f"the {MAX_LAYERS}"):
        check_peer(LAYOUT, "fake", version=PROTOCOL_VERSION, peer_backend="fake",
                   peer_layout=layout, peer_hash="x")


def test_a_layout_of_max_layers_is_built():
    ids = list(range(MAX_LAYERS))
    big = DSALayout(tuple(ids), LAYOUT.page_size, LAYOUT.kv_lora_rank, LAYOUT.qk_rope_head_dim,
                    LAYOUT.kv_dtype, LAYOUT.index_head_dim)
    got = check_peer(LAYOUT, "fake", version=PROTOCOL_VERSION, peer_backend="fake",
                     peer_layout=big.to_dict(), peer_hash=big.layout_hash())
    assert got.num_layers == MAX_LAYERS


def test_our_own_buffers_beyond_the_protocol_are_refused_before_a_hello():
    too_many = [BufferDescriptor(i, "kv", BASE + i * KV, KV * 2, KV) for i in range(MAX_BUFFERS + 1)]
    with pytest.raises(HandshakeError, match=f"this node holds {MAX_BUFFERS + 1}, more than the "
                                             f"{MAX_BUFFERS} a Hello carries"):
        buffer_infos(too_many)
    assert len(buffer_infos(too_many[:MAX_BUFFERS])) == MAX_BUFFERS


def test_index_reads_of_a_layer_without_an_indexer_are_refused():
    compact = DSALayout(LAYOUT.layer_ids, LAYOUT.page_size, LAYOUT.kv_lora_rank,
                        LAYOUT.qk_rope_head_dim, LAYOUT.kv_dtype, LAYOUT.index_head_dim,
                        index_layers=(0, 2))
    assert check_index_reads(compact, [2, 0, 2]) == (0, 2)
    with pytest.raises(ValueError, match="index_reads: layer 1: decode cannot read"):
        check_index_reads(compact, [0, 1])


def test_descriptor_fields_must_be_ints():
    good = POOL.buffer_descriptors()[0]
    for field in ("layer_id", "ptr", "nbytes", "item_len"):
        bad = msgspec.structs.replace(good, **{field: 1.5})
        with pytest.raises(ValueError, match=f"{field} must be an int, got 1.5"):
            descriptors.validate_descriptors([bad])
    with pytest.raises(ValueError, match="ptr must be an int, got True"):
        descriptors.validate_descriptors([msgspec.structs.replace(good, ptr=True)])
