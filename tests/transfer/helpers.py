"""Small pools and bounded waits for the transfer tests."""

from __future__ import annotations

import time

import numpy as np

from dsa_bridge.plugin import DSALayout, DSATokenToKVPool
from dsa_bridge.transfer.launcher.drivers import reset_pages

SMALL_CONFIG = {"num_hidden_layers": 4, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                "index_head_dim": 128}


def wait_for(predicate, timeout_s: float = 10.0, what: str = "condition"):
    """Poll ``predicate`` until it is truthy; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.002)
    raise AssertionError(f"{what} not reached within {timeout_s}s")


def make_pool(config=None, *, size: int = 64 * 32, sentinel: bool = False, **layout_kw):
    layout = DSALayout.from_hf_config(config or SMALL_CONFIG, **layout_kw)
    pool = DSATokenToKVPool.from_layout(layout, size=size)
    if sentinel:
        reset_pages(pool, np.arange(pool.num_kv_pages))
    return pool
