"""dsa-bridge's pool inside SGLang: a subclass of SGLang's own ``DSATokenToKVPool``.

Imported only where ``sglang`` is installed. SGLang allocates and owns the buffers (so every
isinstance check, ``is_mla_backend``, ``get_key_buffer``, ``set_mla_kv_buffer``, the
``get_index_k_*`` family, ``get_cpu_copy(indices, mamba_indices=..., req_pool_index=...)`` and its
``{"kv": [...], "index_k": [...]}`` copy format are SGLang's); this class adds what dsa-bridge
guarantees on top:

- ``layout``: the pool's ``DSALayout`` (global layer ids; compact when SGLang's
  ``skip_topk_layers`` marks index-sharing layers), checked against SGLang's buffers at
  construction; ``kv_layer_ids`` / ``state_layer_ids`` name the entries of SGLang's two lists;
- ``buffer_descriptors()`` / ``buffer_set()``: validated descriptors, SGLang's 0-row indexer
  placeholders made absent (``BufferSet.from_buf_infos``), so a dsa-bridge transfer node takes
  this pool as it is;
- ``stage_start_layer(ptr)``: a pool's first global layer (its pipeline stage's), by the pointer of
  its first KV buffer — what a decode stage's ``KVArgs`` do not say (prefill's say it in
  ``prefill_start_layer``);
- ``move_kv_cache`` checks every location before any write and drops identity pairs (the
  ``(0 <- 0)`` padding of SGLang's speculative-decoding helper);
- ``get_cpu_copy`` / ``load_cpu_copy`` (decode-side retraction) take exactly what SGLang's
  retraction hands them — a request's first ``seqlen - 1`` token locations: whole pages, then a
  partial last page — and refuse any other locations (SGLang's indexer copy is by page, from
  the first location of every ``page_size`` of them, and would copy other tokens' indexer bytes
  silently); ``load_cpu_copy`` refuses a copy of another shape, dtype or token count before
  anything is written.
"""

from __future__ import annotations

import inspect
import weakref

import torch
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool as SGLangDSATokenToKVPool

from ..descriptors import BufferDescriptor, BufferSet
from ..layout import DSALayout
from ..pool import resolve_kv_dtype
from ..token_locs import check_request_tokens, check_targets, check_token_locs

_POOLS: dict[int, weakref.ref] = {}  # first KV buffer's data_ptr -> the dsa-bridge pool there


def stage_start_layer(kv_ptr: int) -> int | None:
    """The ``start_layer`` of the live dsa-bridge pool whose first KV buffer is at ``kv_ptr`` (the
    first of sglang's ``kv_data_ptrs``); None for memory no such pool of this process holds."""
    pool = _POOLS[kv_ptr]() if kv_ptr in _POOLS else None
    if pool is None or pool.kv_buffer[0].data_ptr() != kv_ptr:
        return None
    return pool.start_layer


class BridgeDSATokenToKVPool(SGLangDSATokenToKVPool):
    """SGLang's DSA pool with dsa-bridge's layout, validated descriptors and checked token
    operations; SGLang's constructor signature (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        unsupported = [name for name, on in (("index_kpool > 1", self.index_kpool != 1),
                                             ("index_kpool_compress", self.index_kpool_compress),
                                             ("dcp_replicated", self.index_page_size != self.page_size))
                       if on]
        if unsupported:
            raise ValueError(f"dsa-bridge's pool does not support {', '.join(unsupported)}")
        ids = tuple(range(self.start_layer, self.start_layer + self.layer_num))
        skip = self.skip_topk_layers
        self.layout = DSALayout(
            layer_ids=ids,
            page_size=self.page_size,
            kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim,
            kv_dtype=resolve_kv_dtype(self.dtype, self.kv_cache_dim, self.kv_lora_rank,
                                      self.qk_rope_head_dim),
            index_head_dim=self.index_head_dim,
            index_quant_block=self.quant_block_size,
            index_layers=tuple(lid for lid, s in zip(ids, skip, strict=True) if not s),
        )
        self.kv_layer_ids = list(ids)
        self.state_layer_ids = list(ids)  # SGLang's state list: one entry per layer, 0-row ones too
        self.buffer_set()  # refuse a pool whose buffers do not match the layout
        _POOLS[self.kv_buffer[0].data_ptr()] = weakref.ref(self)

    def buffer_set(self) -> BufferSet:
        """The buffers SGLang allocated, validated against ``layout``; 0-row indexer
        placeholders (index-sharing layers) absent."""
        return BufferSet.from_buf_infos(
            self.layout, self.get_contiguous_buf_infos(), self.kv_layer_ids,
            self.get_state_buf_infos(), self.state_layer_ids, device=str(self.kv_buffer[0].device))

    def buffer_descriptors(self) -> list[BufferDescriptor]:
        return self.buffer_set().buffer_descriptors()

    # ---- token operations: checked, then SGLang's own ----------------------------------------
    def _locs(self, name: str, locs) -> torch.Tensor:
        return check_token_locs(name, locs, device=self.kv_buffer[0].device,
                                rows=self.size + self.page_size)

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """SGLang's move (KV rows and indexer key + scale bytes, every layer), after checking
        every location; pairs with target == source (SGLang's (0 <- 0) padding) are no-ops and
        dropped; another target in padding page 0, or a repeated target, is refused."""
        tgt, src = self._locs("tgt_loc", tgt_loc), self._locs("src_loc", src_loc)
        if tgt.numel() != src.numel():
            raise ValueError(f"tgt_loc has {tgt.numel()} locations but src_loc has {src.numel()}")
        moving = tgt != src
        tgt, src = tgt[moving], src[moving]
        if tgt.numel() == 0:
            return
        check_targets("tgt_loc", tgt, self.page_size)
        super().move_kv_cache(tgt, src)

    def _request_tokens(self, indices) -> torch.Tensor:
        locs = self._locs("indices", indices)
        check_request_tokens("indices", locs, self.page_size)
        return locs

    def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None):
        """SGLang's host copy, ``{"kv": [...], "index_k": [...]}``, of a request's tokens
        (``check_request_tokens``: whole pages, then at most one partial page — SGLang's
        retraction copies a request's first ``seqlen - 1`` tokens). SGLang's semantics: the KV
        rows of exactly these tokens, chunked by ``cpu_offloading_chunk_size`` tokens; the
        indexer by whole page rows (``indices[::page_size] // page_size``), a partial last page
        included — its other positions are the same request's, past its ``seqlen - 1`` tokens
        (a paged allocator gives a page to one request). ``mamba_indices`` / ``req_pool_index`` are passed
        on as SGLang's pool takes them (unused by it for a pool without ``index_kpool_compress``,
        which this class refuses)."""
        self._request_tokens(indices)
        return super().get_cpu_copy(indices, mamba_indices=mamba_indices, req_pool_index=req_pool_index)

    def load_cpu_copy(self, kv_cache_cpu_dict, indices, mamba_indices=None, req_pool_index=None):
        """SGLang's load of a ``get_cpu_copy`` result into a request's tokens (as
        ``get_cpu_copy`` takes them; none in page 0, none twice; they may be other pages than
        the copy was taken from, as at SGLang's resume): KV rows by token, indexer page rows
        whole. The copy is checked first — SGLang's own load asserts chunk by chunk and would
        have written the earlier ones — so a copy of another token count, layer set, shape or
        dtype raises ValueError with the pool unchanged."""
        locs = self._request_tokens(indices)
        self._check_copy(kv_cache_cpu_dict, locs.numel())
        super().load_cpu_copy(kv_cache_cpu_dict, indices, mamba_indices=mamba_indices,
                              req_pool_index=req_pool_index)

    def _copy_form(self, num_tokens: int) -> dict[str, list[list[tuple[tuple[int, ...], torch.dtype]]]]:
        """(shape, dtype) of every tensor ``get_cpu_copy`` returns for ``num_tokens`` tokens,
        per part and layer (a 0-row buffer, SGLang's index-sharing placeholder: no chunks)."""
        chunk, ps = self.cpu_offloading_chunk_size, self.page_size
        pages, page_chunk = -(-num_tokens // ps), max(1, chunk // ps)

        def chunks(bufs, count: int, step: int):
            return [[] if buf.shape[0] == 0 else
                    [((min(step, count - i), *buf.shape[1:]), buf.dtype) for i in range(0, count, step)]
                    for buf in bufs]

        return {"kv": chunks(self.kv_buffer, num_tokens, chunk),
                "index_k": chunks(self.index_k_with_scale_buffer, pages, page_chunk)}

    def _check_copy(self, copy, num_tokens: int) -> None:
        if not isinstance(copy, dict) or set(copy) != {"kv", "index_k"}:
            raise ValueError('kv_cache_cpu_dict must be a get_cpu_copy result: '
                             '{"kv": [...], "index_k": [...]}')
        first = copy["kv"][0] if isinstance(copy["kv"], list) and copy["kv"] else None
        if isinstance(first, list) and all(isinstance(t, torch.Tensor) and t.dim() for t in first):
            taken = sum(t.shape[0] for t in first)  # every layer holds a KV buffer
            if taken != num_tokens:
                raise ValueError(f"the copy holds {taken} tokens but indices has {num_tokens}")
        for part, layers in self._copy_form(num_tokens).items():
            got = copy[part]
            if not isinstance(got, list) or len(got) != len(layers):
                raise ValueError(f'kv_cache_cpu_dict["{part}"] must be a list of {len(layers)} layers')
            for i, (want, have) in enumerate(zip(layers, got, strict=True)):
                if not isinstance(have, list) or len(have) != len(want):
                    raise ValueError(f'kv_cache_cpu_dict["{part}"][{i}] must be a list of {len(want)} '
                                     "chunks (that layer of this pool's copy)")
                for j, ((shape, dtype), t) in enumerate(zip(want, have, strict=True)):
                    if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
                        form = (f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor)
                                else type(t).__name__)
                        raise ValueError(f'kv_cache_cpu_dict["{part}"][{i}][{j}] is {form}, '
                                         f"expected {shape} {dtype}")


BridgeDSATokenToKVPool.__init__.__signature__ = inspect.signature(SGLangDSATokenToKVPool.__init__)
