"""dsa_bridge.plugin — the pool side: DSA geometry and layer sets, the pool, descriptors, sizing.

Reading order: ``layout`` (geometry, byte math, layout hash, presets) -> ``sizing`` (bytes per
token, capacity, allocation) -> ``descriptors`` (registered buffers and their validation) ->
``pool`` (the SGLang-compatible ``DSATokenToKVPool``, uniform or compact; ``token_locs`` checks
the token locations its operations get, ``row_copy`` plans and runs their row copies, ``workers``
shares its CPU copies among threads). The pool (and torch) is imported on first use, so the engines and
the planner can use the descriptors without it.
"""

from __future__ import annotations

from .descriptors import (
    CACHE_KINDS,
    BufferDescriptor,
    BufferKey,
    CacheKind,
    page_bytes,
    to_three_lists,
    validate_descriptors,
)
from .layout import (
    INDEXER_LAYOUTS,
    KV_DTYPES,
    LAYOUT_VERSION,
    PRESETS,
    DSALayout,
    index_layer_ids_for,
    load_model_config,
    skip_topk_layer_ids,
)
from .sizing import (
    allocation_bytes,
    bytes_per_token,
    index_sharing_report,
    pool_capacity_tokens,
)

_POOL_NAMES = ("CpuCopy", "DSATokenToKVPool")


def __getattr__(name: str):
    if name in _POOL_NAMES:
        from . import pool

        return getattr(pool, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CACHE_KINDS",
    "INDEXER_LAYOUTS",
    "KV_DTYPES",
    "LAYOUT_VERSION",
    "PRESETS",
    "BufferDescriptor",
    "BufferKey",
    "CacheKind",
    "CpuCopy",
    "DSALayout",
    "DSATokenToKVPool",
    "allocation_bytes",
    "bytes_per_token",
    "index_layer_ids_for",
    "index_sharing_report",
    "load_model_config",
    "page_bytes",
    "pool_capacity_tokens",
    "skip_topk_layer_ids",
    "to_three_lists",
    "validate_descriptors",
]
