"""Deterministic page contents: what a prefill node "computed" for a request, and the oracle
decode checks every received byte against.

A page's bytes depend on (room, layer id, cache kind, page index within the request): the first
16 bytes stamp those values exactly (so a page landing in the wrong place or layer can never match),
the rest is a window of a fixed pseudo-random table at an offset hashed from them. The page index
within the request names its tokens: page i holds tokens ``i*page_size .. (i+1)*page_size-1``.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

KIND_CODES = {"kv": 1, "index": 2}
STAMP_BYTES = 16
SENTINEL = 0xA5


@functools.lru_cache(maxsize=8)
def _base_words(item_len: int) -> torch.Tensor:
    """A fixed pseudo-random page, as int64 words (rounded up to whole words)."""
    words = -(-item_len // 8)
    return torch.from_numpy(np.random.default_rng(item_len).integers(
        -(2**63), 2**63 - 1, words, dtype=np.int64))


def page_keys(room: int, layer_id: int, kind: str, page_index: np.ndarray) -> np.ndarray:
    """One 64-bit key per page, mixed from (room, layer, kind, page index)."""
    tag = (layer_id << 40) | (KIND_CODES[kind] << 32)
    with np.errstate(over="ignore"):
        mixed = (np.uint64(room) * np.uint64(0x9E3779B97F4A7C15)
                 ^ np.uint64(tag) * np.uint64(0xC2B2AE3D27D4EB4F)
                 ^ page_index.astype(np.uint64) * np.uint64(0x165667B19E3779F9))
        mixed ^= mixed >> np.uint64(29)
    return mixed.view(np.int64)


def expected_pages(room: int, layer_id: int, kind: str, page_index: np.ndarray,
                   item_len: int) -> torch.Tensor:
    """The bytes of the request's pages ``page_index`` (0-based within the request):
    the base page XOR the page's key in every 8-byte word, then the stamp."""
    if item_len < STAMP_BYTES:
        raise ValueError(f"item_len {item_len} is smaller than the {STAMP_BYTES}-byte stamp")
    index = np.asarray(page_index, dtype=np.int64)
    keys = torch.from_numpy(page_keys(room, layer_id, kind, index))
    pages = (_base_words(item_len)[None, :] ^ keys[:, None]).view(torch.uint8)[:, :item_len]
    tag = (layer_id << 40) | (KIND_CODES[kind] << 32)
    stamp = np.stack([np.full(index.size, room, dtype=np.int64), tag | index], axis=1)
    pages[:, :STAMP_BYTES] = torch.from_numpy(stamp.view(np.uint8).reshape(index.size, STAMP_BYTES))
    return pages
