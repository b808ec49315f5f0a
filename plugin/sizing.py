"""Pool sizing: bytes per token, capacity for a memory budget, the real allocation, and what
index sharing saves. Pure functions; the pool allocates with these same formulas.

Per layer the pool allocates ``size + page_size`` KV rows (page 0 is padding); per layer that
holds an indexer (all of them in the uniform layout, the producers in the compact one)
``(index_buf_size + page_size + 1) // page_size`` indexer page rows (SGLang's formula).
"""

from __future__ import annotations

from typing import Any

from .layout import DSALayout, skip_topk_layer_ids


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def resolve_index_buf_size(layout: DSALayout, size: int, index_buf_size: int | None) -> int:
    """Check ``size`` (a positive multiple of page_size) and ``index_buf_size`` (default ``size``,
    never smaller: every KV page must have its indexer page); return the index_buf_size to use."""
    _check_positive_int("size", size)
    if size % layout.page_size:
        raise ValueError(f"size ({size}) must be a multiple of page_size ({layout.page_size})")
    if index_buf_size is None:
        return size
    _check_positive_int("index_buf_size", index_buf_size)
    if index_buf_size < size:
        raise ValueError(f"index_buf_size ({index_buf_size}) must be >= size ({size})")
    return index_buf_size


def kv_rows(layout: DSALayout, size: int) -> int:
    """Token rows of one layer's KV buffer: ``size`` plus the padding page."""
    return size + layout.page_size


def index_pages(layout: DSALayout, index_buf_size: int) -> int:
    """Page rows of one layer's indexer buffer."""
    return (index_buf_size + layout.page_size + 1) // layout.page_size


def bytes_per_token(layout: DSALayout) -> int:
    """Every layer's KV row plus an indexer row per layer that holds one."""
    return layout.bytes_per_token


def pool_capacity_tokens(layout: DSALayout, budget_bytes: int) -> int:
    """Tokens (the pool's ``size``) that fit ``budget_bytes``: ``budget // cell`` floored to a
    multiple of page_size. The padding page per layer and indexer row come on top of it."""
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
        raise TypeError(f"budget_bytes must be an int, got {type(budget_bytes).__name__}")
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    tokens = budget_bytes // layout.bytes_per_token
    return tokens - tokens % layout.page_size


def allocation_bytes(layout: DSALayout, size: int, index_buf_size: int | None = None) -> int:
    """Bytes the pool really allocates (KV + indexer, padding included, guard bytes excluded)."""
    index_buf_size = resolve_index_buf_size(layout, size, index_buf_size)
    return (
        layout.num_layers * kv_rows(layout, size) * layout.kv_row_bytes
        + len(layout.index_layer_ids) * index_pages(layout, index_buf_size) * layout.index_page_bytes
    )


def index_sharing_report(config: dict[str, Any], layout: DSALayout) -> dict[str, Any]:
    """Uniform against compact for ``layout``'s layers, and which one ``layout`` allocates."""
    skipped = set(skip_topk_layer_ids(config))
    full = [lid for lid in layout.layer_ids if lid not in skipped]
    shared = [lid for lid in layout.layer_ids if lid in skipped]
    uniform = layout.num_layers * (layout.kv_row_bytes + layout.index_row_bytes)
    full_only = layout.num_layers * layout.kv_row_bytes + len(full) * layout.index_row_bytes
    return {
        "uniform_bytes_per_token": uniform,
        "full_only_bytes_per_token": full_only,
        "capacity_gain_pct": (uniform / full_only - 1.0) * 100.0,
        "memory_saving_pct": (1.0 - full_only / uniform) * 100.0,
        "full_layers": len(full),
        "shared_layers": len(shared),
        "full_layer_ids": full,
        "shared_layer_ids": shared,
        "indexer_layout": layout.indexer_layout,
        "allocated_bytes_per_token": layout.bytes_per_token,
    }
