"""Bytes on any device for the GPU tier: the launcher's page pattern written into and checked in
a pool's pages where the pool lives, a pool's buffers snapshot to host arrays, and a token-level
oracle of the pool operations that knows nothing of the pool's code (a token's KV row; its
indexer key bytes at ``offset * D`` and scale bytes at ``page_size * D + offset * S`` of its
page's row)."""

from __future__ import annotations

import numpy as np
import torch

from dsa_bridge.plugin import DSALayout
from dsa_bridge.transfer.launcher.page_pattern import expected_pages


def fill_pattern(pool, room: int, pages: np.ndarray) -> None:
    """The pattern of request ``room`` in ``pages`` of every buffer, on the pool's device."""
    index = torch.as_tensor(pages, dtype=torch.int64, device=pool.device)
    for layer, kind in pool.buffer_keys():
        view = pool.page_view(layer, kind)
        view.index_copy_(0, index, expected_pages(room, layer, kind, np.arange(len(pages)),
                                                  view.shape[1]).to(view.device))


def mismatches(pool, room: int, pages: np.ndarray) -> int:
    """Bytes of ``pages`` in every buffer that differ from request ``room``'s pattern."""
    index = torch.as_tensor(pages, dtype=torch.int64, device=pool.device)
    bad = 0
    for layer, kind in pool.buffer_keys():
        view = pool.page_view(layer, kind)
        want = expected_pages(room, layer, kind, np.arange(len(pages)), view.shape[1])
        bad += int((view.index_select(0, index).cpu() != want).sum())
    return bad


def random_fill(pool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for layer, kind in pool.buffer_keys():
        view = pool.page_view(layer, kind)
        view.copy_(torch.randint(0, 256, view.shape, dtype=torch.uint8, generator=gen))


def snapshot(pool) -> dict[tuple[int, str], np.ndarray]:
    """Every buffer, as (pages, item_len) host arrays."""
    return {key: pool.page_view(*key).cpu().numpy().copy() for key in pool.buffer_keys()}


def token_parts(layout: DSALayout, snap: dict, layer: int, loc: int) -> list[np.ndarray]:
    """Views of one token's bytes in a snapshot: KV row, and indexer key and scale bytes where the
    layer holds an indexer."""
    ps, d, s = layout.page_size, layout.index_head_dim, layout.index_scale_bytes
    page, off = divmod(loc, ps)
    parts = [snap[(layer, "kv")].reshape(-1, layout.kv_row_bytes)[loc]]
    if (layer, "index") in snap:
        row = snap[(layer, "index")][page]
        parts += [row[off * d:(off + 1) * d], row[ps * d + off * s:ps * d + (off + 1) * s]]
    return parts


def oracle_move(layout: DSALayout, before: dict, tgt: list[int], src: list[int]) -> dict:
    """``before`` with token ``src[i]``'s bytes (read from ``before``) at ``tgt[i]``, every layer."""
    after = {key: value.copy() for key, value in before.items()}
    for layer in layout.layer_ids:
        for t, s in zip(tgt, src, strict=True):
            for into, value in zip(token_parts(layout, after, layer, t),
                                   token_parts(layout, before, layer, s), strict=True):
                into[:] = value
    return after


def copy_rows(layout: DSALayout, copy, layer_index: int, index_index: int | None, row: int
              ) -> list[np.ndarray]:
    """Row ``row`` of a host copy, in ``token_parts`` order."""
    kv = copy.kv[layer_index].view(torch.uint8).reshape(copy.num_tokens, -1)[row].numpy()
    if index_index is None:
        return [kv]
    return [kv, copy.index_keys[index_index].view(torch.uint8)[row].numpy(),
            copy.index_scales[index_index].view(torch.uint8)[row].numpy()]
