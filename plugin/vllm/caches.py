"""vLLM's cache tensors as the pool a dsa-bridge node takes: ``VllmCaches``.

``register_kv_caches`` hands the worker one tensor per attention layer, by layer name: MLA
layers (``model.layers.N.self_attn.attn``, pages of ``page_size`` rows) and DSA indexer caches
(``model.layers.N.self_attn.indexer.k_cache``, one opaque page of 64 × 128 fp8 values then 64
fp32 scales). Each becomes a dsa-bridge descriptor by its global layer id N: block ``b`` of
vLLM's block table is page ``b`` of every buffer. The layout follows from the model's
``kv_lora_rank``, ``qk_rope_head_dim``, ``index_head_dim`` and the row bytes found: 656 per
token (``fp8_ds_mla``) is ``fp8``, (rank + rope) × 2 ``bf16``, rank + rope ``fp8_raw``.
Anything else is refused, naming the layer: a layer without an index, a page whose rows are
none of those, pages not one after the other in memory (vLLM's block-outermost packing).
"""

from __future__ import annotations

import re

import torch

from ..descriptors import BufferDescriptor, BufferSet
from ..layout import DSALayout

INDEXER_SUFFIX = "indexer.k_cache"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(name: str) -> tuple[int, str]:
    """(global layer id, "kv" or "index") of vLLM's cache ``name``."""
    match = _LAYER.search(name)
    if match is None:
        raise ValueError(f"cache {name!r}: no 'layers.N.' in its name, so no global layer id")
    return int(match.group(1)), "index" if name.endswith(INDEXER_SUFFIX) else "kv"


def _kv_dtype(row_bytes: int, kv_lora_rank: int, rope_dim: int, name: str) -> str:
    dtypes = {DSALayout((0,), 1, kv_lora_rank, rope_dim, dtype, 128).kv_row_bytes: dtype
              for dtype in ("fp8", "bf16", "fp8_raw") if dtype != "fp8" or kv_lora_rank % 128 == 0}
    if row_bytes not in dtypes:
        raise ValueError(f"cache {name!r}: {row_bytes} bytes per token is no MLA row dsa-bridge "
                         f"serves for kv_lora_rank {kv_lora_rank}, qk_rope_head_dim {rope_dim} "
                         f"({', '.join(f'{d} {b}' for b, d in sorted(dtypes.items()))})")
    return dtypes[row_bytes]


def _page(name: str, tensor: torch.Tensor) -> tuple[int, int]:
    """(blocks, bytes per block) of a layer's cache, its blocks one after the other."""
    if tensor.dim() < 2:
        raise ValueError(f"cache {name!r}: shape {tuple(tensor.shape)} has no block dimension")
    blocks = tensor.shape[0]
    page = tensor[0].numel() * tensor.element_size()
    if not tensor[0].is_contiguous() or tensor.stride(0) * tensor.element_size() != page:
        raise ValueError(f"cache {name!r}: its blocks are not one after the other in memory "
                         f"(block stride {tensor.stride(0) * tensor.element_size()} bytes, block "
                         f"{page} bytes; vLLM's block-outermost KV layout is not served)")
    return blocks, page


def caches_layout(caches: dict[str, torch.Tensor], *, page_size: int, kv_lora_rank: int,
                  rope_dim: int, index_head_dim: int | None
                  ) -> tuple[DSALayout, list[BufferDescriptor], dict[tuple[int, str], torch.Tensor]]:
    """The layout, descriptors and uint8 (pages, page bytes) views of vLLM's ``caches``
    (module docstring); ValueError naming the cache on the first problem."""
    if not caches:
        raise ValueError("vLLM registered no KV caches")
    kv: dict[int, tuple[str, torch.Tensor]] = {}
    index: dict[int, tuple[str, torch.Tensor]] = {}
    for name, tensor in caches.items():
        layer, kind = layer_of(name)
        table = index if kind == "index" else kv
        if layer in table:
            raise ValueError(f"cache {name!r}: layer {layer} has a {kind} cache already "
                             f"({table[layer][0]!r})")
        table[layer] = (name, tensor)
    orphans = sorted(set(index) - set(kv))
    if orphans:
        raise ValueError(f"cache {index[orphans[0]][0]!r}: layer {orphans[0]} has an indexer cache "
                         "but no MLA cache")
    if index and index_head_dim is None:
        raise ValueError(f"cache {next(iter(index.values()))[0]!r}: an indexer cache, but the "
                         "model has no index_head_dim")
    first_name, first = kv[min(kv)] if kv else next(iter(index.values()))
    _, first_page = _page(first_name, first)
    if not kv or first_page % page_size:
        raise ValueError(f"cache {first_name!r}: {first_page} bytes per block is not "
                         f"{page_size} MLA rows")
    kv_dtype = _kv_dtype(first_page // page_size, kv_lora_rank, rope_dim, first_name)
    layout = DSALayout(tuple(sorted(kv)), page_size, kv_lora_rank, rope_dim, kv_dtype,
                       index_head_dim or 128, index_layers=tuple(sorted(index)))
    descriptors, views = [], {}
    for kind, table, want in (("kv", kv, layout.kv_page_bytes), ("index", index, layout.index_page_bytes)):
        for layer, (name, tensor) in sorted(table.items()):
            blocks, page = _page(name, tensor)
            if page != want:
                raise ValueError(f"cache {name!r}: {page} bytes per block, the layout's {kind} "
                                 f"page is {want} ({layout.kv_dtype}, page size {page_size})")
            if tensor.device.type != "cpu" and tensor.device.type != "cuda":
                raise ValueError(f"cache {name!r}: on {tensor.device}, not a CPU or CUDA tensor")
            descriptors.append(BufferDescriptor(layer, kind, tensor.data_ptr(), blocks * page, page,
                                                str(tensor.device)))
            views[(layer, kind)] = tensor.view(-1).view(torch.uint8).view(blocks, page)
    return layout, descriptors, views


class VllmCaches:
    """vLLM's caches as a pool: the validated descriptors (a ``BufferSet``) and, for the
    checksums and the staged route, each buffer's pages as a uint8 view of vLLM's tensor."""

    def __init__(self, caches: dict[str, torch.Tensor], **geometry):
        layout, descriptors, self._views = caches_layout(caches, **geometry)
        self._buffers = BufferSet(layout, descriptors)
        self.layout = layout
        self.device = descriptors[0].device

    def buffer_descriptors(self) -> list[BufferDescriptor]:
        return self._buffers.buffer_descriptors()

    def page_view(self, layer_id: int, kind: str) -> torch.Tensor:
        """uint8 (pages, page bytes) view of the buffer of ``(layer_id, kind)``, sharing its memory."""
        return self._views[(layer_id, kind)]
