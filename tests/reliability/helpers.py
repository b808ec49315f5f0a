"""In-test pieces of the reliability tier: pools, settled requests, byte checks of one buffer.
(Bounded waits: ``tests.transfer.helpers.wait_for``.)"""

from __future__ import annotations

import time

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


def fence_state(receiver) -> str:
    """What holds a decode request's pages, for a failure message: its status, the prefill nodes
    that may still write, the quarantined ones, and when a failed write's grace ends."""
    now = time.monotonic()
    fence, state = receiver.fence, receiver.state
    until = "-" if fence.in_flight_until is None else f"{fence.in_flight_until - now:+.1f}s"
    at = "-" if state.release_at is None else f"{state.release_at - now:+.1f}s"
    return (f"room {receiver.room} {receiver.poll().name}: outstanding {sorted(fence.outstanding)}, "
            f"quarantined {sorted(fence.quarantined)}, in flight until {until}, release at {at}")


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
