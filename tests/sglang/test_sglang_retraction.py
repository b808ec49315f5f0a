"""Decode-side retraction over dsa-bridge's ``BridgeDSATokenToKVPool``, driven by SGLang 0.5.23's
own code on the CPU.

What runs is SGLang's: ``resolve_decode_retraction_backup`` (mem_cache/kv_cache_builder.py
~186-242) choosing the backup for the pool; the real ``Req``, ``ReqToTokenPool`` and
``PagedTokenToKVPoolAllocator``; and ``backup_kv_cache`` / ``restore_kv_cache``
(mem_cache/common.py ~332-385), which ``release_req`` (managers/schedule_batch.py ~2381) and the
decode prealloc queue's ``resume_retracted_reqs`` (disaggregation/decode.py ~1088) call with the
resolved backend; they reach the pool through ``Req.offload_kv_cache`` / ``Req.load_kv_cache``
(schedule_batch.py ~2110-2146) and the allocator: ``get_cpu_copy(req_to_token[row, :seqlen - 1],
mamba_indices=req.kv.mamba_pool_idx, req_pool_index=req.kv.req_pool_idx)``, later
``load_cpu_copy(copy, <the same slice of the row after resume>, ...)``. Stand-ins (no model, no
GPU): the ``tp_worker`` handed to the resolution (the attributes it reads), and the scheduler
steps between backup and restore — freeing the request's row and pages as ``release_kv_cache``
does, another request taking pages, the request allocated again as ``_pre_alloc`` does — made
with SGLang's own pools' ``alloc`` / ``free``.

Each case runs on dsa-bridge's subclass and on SGLang's own ``DSATokenToKVPool`` side by side
(same bytes, same allocations) and ends with every byte of both pools equal: the subclass has
SGLang's semantics — KV rows by token; the indexer by whole page rows, the partial last page's
row included — and the request's bytes are the originals while every other byte (another
request's pages, pages reused in between) is as it was.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from .conftest import SGLANG_MISSING, published_context

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.common import backup_kv_cache, restore_kv_cache  # noqa: E402
from sglang.srt.mem_cache.kv_cache_builder import resolve_decode_retraction_backup  # noqa: E402
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool as SGLangPool  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.runtime_context import get_disagg  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from transformers import PretrainedConfig  # noqa: E402

from dsa_bridge.plugin.sglang.pool import BridgeDSATokenToKVPool  # noqa: E402

PAGE = 64
PAGES = 12
LAYERS = 4
SENTINEL = 0xAB
DSV32 = dict(size=PAGES * PAGE, page_size=PAGE, kv_lora_rank=512, dtype=torch.float8_e4m3fn,
             qk_rope_head_dim=64, layer_num=LAYERS, device="cpu", index_head_dim=128,
             enable_memory_saver=False, kv_cache_dim=656)
COMPACT = [False, True, True, False]  # SGLang's index sharing: 0-row indexers on layers 1 and 2


@pytest.fixture
def decode_context():
    with published_context(disaggregation_mode="decode") as server_args:
        yield server_args


def buffers(pool) -> list[torch.Tensor]:
    """Every buffer of the pool as uint8 rows: KV (token rows), then indexer (page rows)."""
    return [b.view(torch.uint8).reshape(b.shape[0], b[0].numel() * b.element_size() if b.shape[0] else 0)
            for b in [*pool.kv_buffer, *pool.index_k_with_scale_buffer]]


def fill(pools, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for views in zip(*(buffers(p) for p in pools), strict=True):
        data = torch.randint(0, 256, views[0].shape, dtype=torch.uint8, generator=g)
        for v in views:
            v.copy_(data)


def scribble(pools, pages: torch.Tensor) -> None:
    """Other requests write these pages: every byte of them, every layer, the sentinel."""
    tokens = (pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)
    for pool in pools:
        for i, b in enumerate(buffers(pool)):
            if b.shape[0]:
                b[tokens if i < LAYERS else pages] = SENTINEL


class Decode:
    """One side's SGLang state: the pool, SGLang's paged allocator and ReqToTokenPool."""

    def __init__(self, pool):
        self.pool = pool
        self.allocator = PagedTokenToKVPoolAllocator(PAGES * PAGE, PAGE, torch.float8_e4m3fn, "cpu", pool,
                                                     need_sort=False)
        self.req_to_token = ReqToTokenPool(4, 16 * PAGE, "cpu", False)

    def admit(self, req: Req, tokens: int) -> torch.Tensor:
        """A row and pages for ``tokens`` tokens (whole pages, as the paged allocator gives)."""
        self.req_to_token.alloc([req])
        locs = self.allocator.alloc(-(-tokens // PAGE) * PAGE)
        self.req_to_token.write((req.kv.req_pool_idx, slice(0, locs.numel())), locs.to(torch.int32))
        return locs

    def release(self, req: Req, locs: torch.Tensor) -> None:
        """What ``release_kv_cache`` gives back: the pages, then the row."""
        self.allocator.free(locs)
        self.req_to_token.free(req)


def make_req(rid: str, prompt: int, generated: int) -> Req:
    req = Req(rid=rid, origin_input_text="", origin_input_ids=list(range(1, prompt + 1)),
              sampling_params=SamplingParams(max_new_tokens=64))
    req.output_ids.extend(range(generated))
    return req


@pytest.mark.parametrize("cls", [SGLangPool, BridgeDSATokenToKVPool])
def test_sglang_resolves_the_cpu_tensor_backup_for_dsa_pools(decode_context, cls):
    """The default that makes retraction reach ``get_cpu_copy``: SGLang's host-pool backup is
    only for MHA / SWA pools, so for a DSA pool (the subclass, like SGLang's own) it resolves
    ``cpu_tensor`` onto the config bag its retraction reads."""
    side = Decode(cls(**DSV32))
    hf = PretrainedConfig()
    hf.model_type = "deepseek_v32"
    model_config = SimpleNamespace(hf_config=hf, is_draft_model=False, linear_attn_registry_result=None)
    worker = SimpleNamespace(  # what the resolution reads of a tp_worker
        get_memory_pool=lambda: (side.req_to_token, side.allocator), is_hybrid_swa=False,
        model_runner=SimpleNamespace(mtp_draft_device_pools=[], spec_algorithm=None,
                                     model_config=model_config))
    assert get_disagg().disaggregation_decode_retraction_backup is None  # unset: resolved here
    assert resolve_decode_retraction_backup(tp_worker=worker) == "cpu_tensor"
    assert get_disagg().disaggregation_decode_retraction_backup == "cpu_tensor"


@pytest.mark.parametrize("skip", [None, COMPACT], ids=["uniform", "compact"])
@pytest.mark.parametrize("tail", [1, 37, 63, 0])
@pytest.mark.parametrize("chunk", [8192, 100])
def test_retraction_round_trip_through_sglang_backup_and_restore(decode_context, skip, tail, chunk):
    """A request of seqlen 2 * PAGE + tail + 1 (its first seqlen - 1 tokens: two whole pages and
    ``tail`` tokens of a third) is backed up by SGLang's cpu_tensor backup, its pages freed and
    written by another request, resumed on other pages and restored: every layer's KV rows of
    its tokens and indexer rows of its pages are the originals; the other request's pages and
    the reused pages are untouched; SGLang's own pool ends with the same bytes."""
    kw = {} if skip is None else {"skip_topk_layers": skip}
    pools = [BridgeDSATokenToKVPool(**DSV32, **kw), SGLangPool(**DSV32, **kw)]
    sides = [Decode(p) for p in pools]
    for p in pools:
        p.cpu_offloading_chunk_size = chunk
    seqlen = 2 * PAGE + tail + 1
    reqs = [(make_req("r", 2 * PAGE, tail + 1), make_req("other", PAGE + 5, 0)) for _ in sides]
    first = [(s.admit(r, seqlen - 1), s.admit(o, PAGE + 5)) for s, (r, o) in zip(sides, reqs, strict=True)]
    assert torch.equal(first[0][0], first[1][0]) and torch.equal(first[0][1], first[1][1])
    fill(pools, seed=tail + chunk)
    original = [b.clone() for b in buffers(pools[0])]
    old_locs = first[0][0][: seqlen - 1]

    for side, (req, _), (locs, _) in zip(sides, reqs, first, strict=True):  # retract: back up, release
        assert req.seqlen == seqlen
        assert backup_kv_cache(req, None, side.req_to_token, side.allocator, "cpu_tensor")
        side.release(req, locs)
    taker = [s.allocator.alloc(PAGE) for s in sides]  # another request takes a freed page
    scribble(pools, torch.unique(old_locs // PAGE))  # and the rest of them are written too
    resumed = [s.admit(r, seqlen - 1) for s, (r, _) in zip(sides, reqs, strict=True)]
    assert torch.equal(resumed[0], resumed[1]) and torch.equal(taker[0], taker[1])
    new_locs = resumed[0][: seqlen - 1]
    assert not torch.equal(new_locs, old_locs)  # resumed elsewhere
    scribble(pools, torch.unique(new_locs // PAGE))  # stale bytes where it resumes
    before_restore = [b.clone() for b in buffers(pools[0])]
    for side, (req, _) in zip(sides, reqs, strict=True):
        restore_kv_cache(req, None, side.req_to_token, side.allocator, "cpu_tensor")
        assert req.kv.retraction_backup is None

    old_pages, new_pages = old_locs[::PAGE] // PAGE, new_locs[::PAGE] // PAGE
    after = buffers(pools[0])
    for i, (got, orig, prev) in enumerate(zip(after, original, before_restore, strict=True)):
        if got.shape[0] == 0:  # SGLang's 0-row placeholder: nothing held, nothing copied
            continue
        want = prev.clone()
        if i < LAYERS:  # KV: exactly the request's tokens
            want[new_locs] = orig[old_locs]
        else:  # indexer: whole page rows, the partial last page's included (SGLang's semantics)
            want[new_pages] = orig[old_pages]
        assert torch.equal(got, want), f"buffer {i}"
    other = first[0][1]
    for got, orig in zip(after[:LAYERS], original[:LAYERS], strict=True):
        assert torch.equal(got[other], orig[other])  # the other request's tokens
    for got, sglang_own in zip(after, buffers(pools[1]), strict=True):
        assert torch.equal(got, sglang_own)


def test_retraction_refuses_a_copy_loaded_into_another_request_shape(decode_context):
    """A copy restored into a row of another length (a request whose seqlen changed) is refused
    before any byte is written; SGLang's own load asserts chunk by chunk."""
    pool = BridgeDSATokenToKVPool(**DSV32)
    side = Decode(pool)
    req = make_req("r", PAGE, 11)
    locs = side.admit(req, PAGE + 10)
    fill([pool], seed=3)
    assert backup_kv_cache(req, None, side.req_to_token, side.allocator, "cpu_tensor")
    before = [b.clone() for b in buffers(pool)]
    req.output_ids.append(99)  # seqlen - 1 is now PAGE + 11
    side.req_to_token.write((req.kv.req_pool_idx, slice(0, locs.numel())), locs.to(torch.int32))
    with pytest.raises(ValueError, match="the copy holds 74 tokens but indices has 75"):
        restore_kv_cache(req, None, side.req_to_token, side.allocator, "cpu_tensor")
    assert all(torch.equal(a, b) for a, b in zip(before, buffers(pool), strict=True))
