"""dsa-bridge's pool inside SGLang (``plugin/sglang/pool.py``), against the real sglang 0.5.23.

SGLang's own ``setup_state_kv_args`` over SGLang's pool, over dsa-bridge's subclass and (the bug
of issue 11) over dsa-bridge's own pool; SGLang's accessors on the subclass; the subclass's
checked token operations — host copies of a request's tokens (a partial last page included) in
SGLang's call form and copy format, other locations and copies of another shape refused with
the pool unchanged — and SGLang's 0-row compact form normalised."""

from __future__ import annotations

import inspect

import pytest
import torch

from .conftest import SGLANG_MISSING

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

from sglang.srt.disaggregation.base import KVArgs  # noqa: E402
from sglang.srt.disaggregation.base.conn import StateType  # noqa: E402
from sglang.srt.disaggregation.utils import is_mla_backend, setup_state_kv_args  # noqa: E402
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool as SGLangPool  # noqa: E402

from dsa_bridge.plugin import DSALayout, DSATokenToKVPool  # noqa: E402
from dsa_bridge.plugin.descriptors import BufferSet  # noqa: E402
from dsa_bridge.plugin.sglang.pool import BridgeDSATokenToKVPool  # noqa: E402

pytestmark = pytest.mark.usefixtures("sglang_context")

LAYERS = 4
DSV32 = dict(size=256, page_size=64, kv_lora_rank=512, dtype=torch.float8_e4m3fn, qk_rope_head_dim=64,
             layer_num=LAYERS, device="cpu", index_head_dim=128, enable_memory_saver=False,
             kv_cache_dim=656)


def kv_args_of(pool) -> KVArgs:
    args = KVArgs()
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = pool.get_contiguous_buf_infos()
    setup_state_kv_args(args, pool)
    return args


def fill(pool, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for buf in [*pool.kv_buffer, *pool.index_k_with_scale_buffer]:
        if buf.numel():
            buf.view(torch.uint8).copy_(torch.randint(0, 256, buf.view(torch.uint8).shape, generator=g,
                                                      dtype=torch.uint8))


def test_sglang_publishes_the_indexer_of_every_layer_for_its_pool_and_the_subclass():
    for cls in (SGLangPool, BridgeDSATokenToKVPool):
        pool = cls(**DSV32)
        args = kv_args_of(pool)
        assert args.state_types == [StateType.DSA], cls.__name__
        ptrs, lens, items = args.state_data_ptrs[0], args.state_data_lens[0], args.state_item_lens[0]
        assert len(ptrs) == LAYERS and all(ptrs) and all(n == 5 * 8448 for n in lens)
        assert items == [8448] * LAYERS
        assert args.kv_item_lens == [41984] * LAYERS


def test_dsa_bridge_own_pool_gets_no_indexer_state_from_sglang_the_bug_of_issue_11():
    pool = DSATokenToKVPool(**DSV32)
    assert not is_mla_backend(pool)
    assert kv_args_of(pool).state_types == []  # silently nothing: why the subclass exists


def test_subclass_keeps_sglang_type_signature_and_accessors():
    pool = BridgeDSATokenToKVPool(**DSV32)
    assert isinstance(pool, SGLangPool) and is_mla_backend(pool)
    assert inspect.signature(BridgeDSATokenToKVPool.__init__) == inspect.signature(SGLangPool.__init__)
    fill(pool)
    assert pool.get_key_buffer(2).data_ptr() == pool.kv_buffer[2].data_ptr()
    assert torch.equal(pool.get_index_k_with_scale_buffer(1).view(torch.uint8),
                       pool.index_k_with_scale_buffer[1].view(torch.uint8))
    # the write paths are SGLang's own (Triton kernels: GPU only, docs/sglang.md), inherited unchanged
    for name in ("set_mla_kv_buffer", "get_mla_kv_buffer", "set_index_k_scale_buffer",
                 "get_index_k_scale_buffer"):
        assert getattr(BridgeDSATokenToKVPool, name) is getattr(SGLangPool, name), name


def test_subclass_layout_and_descriptors_match_sglang_buffers_byte_for_byte():
    pool = BridgeDSATokenToKVPool(**DSV32)
    assert pool.layout == DSALayout(layer_ids=tuple(range(LAYERS)), page_size=64, kv_lora_rank=512,
                                    qk_rope_head_dim=64, kv_dtype="fp8", index_head_dim=128,
                                    index_quant_block=128)
    descs = pool.buffer_descriptors()
    assert [(d.layer_id, d.kind) for d in descs] == [(i, k) for i in range(LAYERS) for k in ("kv", "index")]
    ours = DSATokenToKVPool(**DSV32)
    assert [(d.nbytes, d.item_len) for d in descs] == \
        [(d.nbytes, d.item_len) for d in ours.buffer_descriptors()]
    assert pool.get_kv_size_bytes() == ours.get_kv_size_bytes()
    assert pool.kv_layer_ids == pool.state_layer_ids == list(range(LAYERS))


def test_sglang_compact_pool_zero_rows_normalise_to_absent_through_buffer_set():
    skip = [False, True, True, False]
    sglang_pool = SGLangPool(**DSV32, skip_topk_layers=skip)
    args = kv_args_of(sglang_pool)
    assert args.state_data_lens[0][1:3] == [0, 0]  # SGLang's 0-row placeholders
    layout = DSALayout(layer_ids=tuple(range(LAYERS)), page_size=64, kv_lora_rank=512, qk_rope_head_dim=64,
                       kv_dtype="fp8", index_head_dim=128, index_quant_block=128, index_layers=(0, 3))
    kv = (args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens)
    state = (args.state_data_ptrs[0], args.state_data_lens[0], args.state_item_lens[0])
    buffers = BufferSet.from_buf_infos(layout, kv, range(LAYERS), state, range(LAYERS))
    assert [(d.layer_id, d.kind) for d in buffers.buffer_descriptors() if d.kind == "index"] == \
        [(0, "index"), (3, "index")]
    uniform = DSALayout(layer_ids=tuple(range(LAYERS)), page_size=64, kv_lora_rank=512, qk_rope_head_dim=64,
                        kv_dtype="fp8", index_head_dim=128, index_quant_block=128)
    with pytest.raises(ValueError, match="layer 1: the layout holds its indexer"):
        BufferSet.from_buf_infos(uniform, kv, range(LAYERS), state, range(LAYERS))
    sub = BridgeDSATokenToKVPool(**DSV32, skip_topk_layers=skip)
    assert sub.layout == layout
    assert [d.layer_id for d in sub.buffer_descriptors() if d.kind == "index"] == [0, 3]


def test_subclass_refuses_what_its_layout_cannot_describe():
    with pytest.raises(ValueError, match="index_kpool_compress"):
        BridgeDSATokenToKVPool(**{**DSV32, "page_size": 128}, index_kpool=2, index_kpool_compress=True,
                               max_running_requests=4)


def test_move_kv_cache_accepts_speculative_padding_pairs_and_moves_every_layer():
    pool = BridgeDSATokenToKVPool(**DSV32)
    fill(pool)
    ref = SGLangPool(**DSV32)
    for a, b in zip([*ref.kv_buffer, *ref.index_k_with_scale_buffer],
                    [*pool.kv_buffer, *pool.index_k_with_scale_buffer], strict=True):
        a.copy_(b)
    tgt, src = torch.tensor([130, 131, 0, 0, 0]), torch.tensor([70, 71, 0, 0, 0])  # a zero-filled tail
    pool.move_kv_cache(tgt, src)
    ref.move_kv_cache(tgt[:2], src[:2])
    for a, b in zip([*ref.kv_buffer, *ref.index_k_with_scale_buffer],
                    [*pool.kv_buffer, *pool.index_k_with_scale_buffer], strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert torch.equal(pool.kv_buffer[0][130], pool.kv_buffer[0][70])


@pytest.mark.parametrize(("tgt", "src", "message"), [
    ([130, 5], [70, 71], "targets padding page 0: location 5"),
    ([130, 130], [70, 71], "duplicate locations"),
    ([130, 999], [70, 71], "tgt_loc out of range: location 999"),
    ([130], [70, 71], "tgt_loc has 1 locations but src_loc has 2"),
    ([130, 131], [70, -1], "src_loc out of range: location -1"),
])
def test_move_kv_cache_refuses_bad_locations_before_any_write(tgt, src, message):
    pool = BridgeDSATokenToKVPool(**DSV32)
    fill(pool)
    before = [t.clone() for t in [*pool.kv_buffer, *pool.index_k_with_scale_buffer]]
    with pytest.raises(ValueError, match=message):
        pool.move_kv_cache(torch.tensor(tgt), torch.tensor(src))
    assert all(torch.equal(a, b) for a, b in zip(before, [*pool.kv_buffer, *pool.index_k_with_scale_buffer],
                                                 strict=True))


def test_cpu_copy_in_sglang_call_form_and_format_round_trips():
    pool = BridgeDSATokenToKVPool(**DSV32)
    fill(pool)
    pages = torch.arange(64, 192)  # pages 1 and 2
    copy = pool.get_cpu_copy(pages, mamba_indices=None, req_pool_index=0)
    assert set(copy) == {"kv", "index_k"}
    assert len(copy["kv"]) == len(copy["index_k"]) == LAYERS
    assert torch.equal(torch.cat(copy["index_k"][2]), pool.index_k_with_scale_buffer[2][1:3])
    expected = [t.clone() for t in [*pool.kv_buffer, *pool.index_k_with_scale_buffer]]
    for t in [*pool.kv_buffer, *pool.index_k_with_scale_buffer]:
        t.view(torch.uint8)[64:].zero_() if t.dim() == 3 else t[1:].zero_()
    pool.load_cpu_copy(copy, pages, mamba_indices=None, req_pool_index=0)
    after = [*pool.kv_buffer, *pool.index_k_with_scale_buffer]
    for a, b in zip(expected, after, strict=True):
        if a.dim() == 3:
            assert torch.equal(a[64:192], b[64:192])
        else:
            assert torch.equal(a[1:3], b[1:3])


def test_cpu_copy_of_a_partial_last_page_in_sglang_call_form_round_trips():
    """A request's first seqlen - 1 tokens (page 1 whole, 36 tokens of page 3): KV rows by
    token, the indexer by whole page rows (SGLang's semantics; tests/sglang/test_sglang_retraction.py
    drives it through SGLang's own retraction)."""
    pool = BridgeDSATokenToKVPool(**DSV32)
    fill(pool)
    locs = torch.cat([torch.arange(64, 128), torch.arange(192, 228)]).to(torch.int32)
    copy = pool.get_cpu_copy(locs, mamba_indices=None, req_pool_index=1)
    assert torch.equal(torch.cat(copy["index_k"][3]), pool.index_k_with_scale_buffer[3][[1, 3]])
    expected = [t.clone() for t in [*pool.kv_buffer, *pool.index_k_with_scale_buffer]]
    for t in [*pool.kv_buffer, *pool.index_k_with_scale_buffer]:
        t.view(torch.uint8).fill_(0xAB)
    pool.load_cpu_copy(copy, locs, mamba_indices=None, req_pool_index=1)
    for a, b in zip(expected, [*pool.kv_buffer, *pool.index_k_with_scale_buffer], strict=True):
        rows = locs.long() if a.dim() == 3 else torch.tensor([1, 3])
        assert torch.equal(a[rows], b[rows])
        rest = torch.ones(b.shape[0], dtype=torch.bool)
        rest[rows] = False
        assert (b[rest].view(torch.uint8) == 0xAB).all()


REQUEST = list(range(64, 128)) + list(range(192, 200))  # page 1 whole, 8 tokens of page 3


@pytest.mark.parametrize(("locs", "message"), [
    (list(range(65, 129)), "position 0 holds location 65, at offset 1 of its page"),
    (list(range(127, 63, -1)), "position 0 holds location 127, at offset 63"),
    ([64, 66, 65], "position 1 holds location 66, expected 65"),
    (list(range(64, 100)) + [130], "position 36 holds location 130, expected 100"),
    (list(range(0, 70)), "includes padding page 0"),
    (list(range(64, 128)) + list(range(64, 70)), "duplicate locations: page 1 appears twice"),
    (list(range(256, 330)), "indices out of range: location 329"),
])
def test_cpu_copy_refuses_locations_that_are_not_a_requests_tokens(locs, message):
    pool = BridgeDSATokenToKVPool(**DSV32)
    fill(pool)
    good = pool.get_cpu_copy(torch.tensor(REQUEST))
    before = [t.clone() for t in [*pool.kv_buffer, *pool.index_k_with_scale_buffer]]
    with pytest.raises(ValueError, match=message):
        pool.get_cpu_copy(torch.tensor(locs), mamba_indices=None, req_pool_index=0)
    with pytest.raises(ValueError, match=message):
        pool.load_cpu_copy(good, torch.tensor(locs), mamba_indices=None, req_pool_index=0)
    assert all(torch.equal(a, b) for a, b in zip(before, [*pool.kv_buffer, *pool.index_k_with_scale_buffer],
                                                 strict=True))


def replaced(copy: dict, part: str, layer: int, chunk: int, tensor) -> dict:
    out = {k: [list(layer_chunks) for layer_chunks in v] for k, v in copy.items()}
    out[part][layer][chunk] = tensor
    return out


def other_pool_copy(**changes):
    other = BridgeDSATokenToKVPool(**{**DSV32, **changes})
    fill(other)
    return other.get_cpu_copy(torch.tensor(REQUEST))


@pytest.mark.parametrize(("make", "message"), [
    (lambda c: {"kv": c["kv"]}, "must be a get_cpu_copy result"),
    (lambda c: {**c, "tail_k": []}, "must be a get_cpu_copy result"),
    (lambda c: [c["kv"], c["index_k"]], "must be a get_cpu_copy result"),
    (lambda c: replaced(c, "kv", 0, 0, c["kv"][0][0][:-1]), "the copy holds 71 tokens but indices has 72"),
    (lambda c: replaced(c, "kv", 2, 0, c["kv"][2][0][:-1]), r'\["kv"\]\[2\]\[0\] is \(71, 1, 656\)'),
    (lambda c: replaced(c, "kv", 1, 0, c["kv"][1][0].view(torch.int8)), "torch.int8, expected"),
    (lambda c: replaced(c, "index_k", 3, 0, c["index_k"][3][0][:1]),
     r'\["index_k"\]\[3\]\[0\] is \(1, 8448\)'),
    (lambda c: {**c, "index_k": c["index_k"][:3]}, r'\["index_k"\] must be a list of 4 layers'),
    (lambda c: other_pool_copy(dtype=torch.bfloat16, kv_cache_dim=576),
     r'\["kv"\]\[0\]\[0\] is \(72, 1, 576\)'),
    (lambda c: other_pool_copy(skip_topk_layers=[False, True, True, False]),
     r'\["index_k"\]\[1\] must be a list of 1 chunks'),
])
def test_load_cpu_copy_refuses_a_copy_of_another_shape_before_any_write(make, message):
    pool = BridgeDSATokenToKVPool(**DSV32)
    fill(pool)
    copy = make(pool.get_cpu_copy(torch.tensor(REQUEST)))
    fill(pool, seed=2)
    before = [t.clone() for t in [*pool.kv_buffer, *pool.index_k_with_scale_buffer]]
    with pytest.raises(ValueError, match=message):
        pool.load_cpu_copy(copy, torch.tensor(REQUEST), mamba_indices=None, req_pool_index=0)
    assert all(torch.equal(a, b) for a, b in zip(before, [*pool.kv_buffer, *pool.index_k_with_scale_buffer],
                                                 strict=True))
