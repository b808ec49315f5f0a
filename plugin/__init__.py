"""dsa_bridge.plugin — the pool side: DSA geometry, the uniform pool, descriptors and sizing.

Reading order: ``layout`` (geometry, byte math, layout hash, presets) -> ``sizing`` (bytes per
token, capacity, allocation) -> ``descriptors`` (registered buffers and their validation) ->
``pool`` (the SGLang-compatible ``DSATokenToKVPool``; ``workers`` shares its CPU copies among
threads).
"""

from __future__ import annotations

from .descriptors import (
    CACHE_KINDS,
    BufferDescriptor,
    CacheKind,
    page_bytes,
    to_three_lists,
    validate_descriptors,
)
from .layout import (
    KV_DTYPES,
    LAYOUT_VERSION,
    PRESETS,
    DSALayout,
    indexer_layer_ids,
    load_model_config,
    skip_topk_layer_ids,
)
from .pool import CpuCopy, DSATokenToKVPool
from .sizing import (
    allocation_bytes,
    bytes_per_token,
    index_sharing_report,
    pool_capacity_tokens,
)

__all__ = [
    "CACHE_KINDS",
    "KV_DTYPES",
    "LAYOUT_VERSION",
    "PRESETS",
    "BufferDescriptor",
    "CacheKind",
    "CpuCopy",
    "DSALayout",
    "DSATokenToKVPool",
    "allocation_bytes",
    "bytes_per_token",
    "index_sharing_report",
    "indexer_layer_ids",
    "load_model_config",
    "page_bytes",
    "pool_capacity_tokens",
    "skip_topk_layer_ids",
    "to_three_lists",
    "validate_descriptors",
]
