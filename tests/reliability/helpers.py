"""In-test pieces of the reliability tier: pools, settled requests, byte checks of one buffer.
(Bounded waits: ``tests.transfer.helpers.wait_for``.)"""

from __future__ import annotations

import numpy as np
import torch

from dsa_bridge.plugin import DSALayout, DSATokenToKVPool
from dsa_bridge.transfer.launcher.drivers import reset_pages
from dsa_bridge.transfer.launcher.page_pattern import SENTINEL, expected_pages
from dsa_bridge.transfer.request import TERMINAL

DEEPSEEK = DSALayout.preset("deepseek-v3.2")
GLM_COMPACT = DSALayout.preset("glm-5.2", kv_dtype="fp8_raw", indexer_layout="compact")
SMALL = {"num_hidden_layers": 4, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 128}
SMALL_SHARED = {**SMALL, "num_hidden_layers": 6,  # layers 2, 4 and 5 share another's top-k
                "indexer_types": ["full", "full", "shared", "full", "shared", "shared"]}


def make_pool(layout: DSALayout = DEEPSEEK, pages: int = 48, *, guard_bytes: int = 0,
              sentinel: bool = True) -> DSATokenToKVPool:
    """A pool of ``pages`` usable pages (plus padding page 0), optionally filled with the
    sentinel and surrounded by canary guard bytes."""
    pool = DSATokenToKVPool.from_layout(layout, size=pages * layout.page_size,
                                        guard_bytes=guard_bytes)
    if sentinel:
        reset_pages(pool, np.arange(pool.num_kv_pages))
    return pool


def settled(*requests) -> bool:
    return all(r.poll() in TERMINAL for r in requests)


def buffer_matches(pool, room: int, pages: np.ndarray, layer_id: int, kind: str) -> bool:
    """True when one (layer, cache) buffer holds the request's pattern on all its pages."""
    view = pool.page_view(layer_id, kind)
    got = view.index_select(0, torch.from_numpy(pages))
    return torch.equal(got, expected_pages(room, layer_id, kind, np.arange(pages.size), view.shape[1]))


def buffer_untouched(pool, pages: np.ndarray, layer_id: int, kind: str) -> bool:
    view = pool.page_view(layer_id, kind)
    return bool((view.index_select(0, torch.from_numpy(pages)) == SENTINEL).all())
