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
- ``move_kv_cache`` checks every location before any write and drops identity pairs (the
  ``(0 <- 0)`` padding of SGLang's speculative-decoding helper);
- ``get_cpu_copy`` / ``load_cpu_copy`` refuse locations that are not whole pages, in order
  (SGLang's indexer copy is page-granular and would otherwise copy the wrong tokens silently).
"""

from __future__ import annotations

import inspect

import torch
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool as SGLangDSATokenToKVPool

from ..descriptors import BufferDescriptor, BufferSet
from ..layout import DSALayout
from ..pool import check_targets, check_token_locs, resolve_kv_dtype


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

    def _whole_pages(self, name: str, indices) -> torch.Tensor:
        locs = self._locs(name, indices)
        ps = self.page_size
        grid = locs.reshape(-1, ps) if locs.numel() % ps == 0 else None
        if grid is None or not (bool((grid[:, 0] % ps == 0).all())
                                and bool((grid - grid[:, :1] == torch.arange(ps, device=locs.device)).all())):
            raise ValueError(f"{name} must be whole pages, each page's {ps} tokens in order "
                             "(the indexer is copied by page)")
        return locs

    def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None):
        """SGLang's host copy, ``{"kv": [...], "index_k": [...]}``, of whole pages."""
        self._whole_pages("indices", indices)
        return super().get_cpu_copy(indices, mamba_indices=mamba_indices, req_pool_index=req_pool_index)

    def load_cpu_copy(self, kv_cache_cpu_dict, indices, mamba_indices=None, req_pool_index=None):
        """SGLang's load of a ``get_cpu_copy`` result into whole pages."""
        self._whole_pages("indices", indices)
        if not isinstance(kv_cache_cpu_dict, dict) or not {"kv", "index_k"} <= set(kv_cache_cpu_dict):
            raise ValueError('kv_cache_cpu_dict must be a get_cpu_copy result: '
                             '{"kv": [...], "index_k": [...]}')
        super().load_cpu_copy(kv_cache_cpu_dict, indices, mamba_indices=mamba_indices,
                              req_pool_index=req_pool_index)


BridgeDSATokenToKVPool.__init__.__signature__ = inspect.signature(SGLangDSATokenToKVPool.__init__)
