"""What the node tests share: small pools, aux buffers as SGLang's metadata buffers, bounded
waits."""

from __future__ import annotations

import time

import numpy as np

from dsa_bridge.plugin import DSALayout, DSATokenToKVPool
from dsa_bridge.transfer.backends import create_backend
from dsa_bridge.transfer.decode import DecodeNode
from dsa_bridge.transfer.launcher.drivers import reset_pages
from dsa_bridge.transfer.prefill import PrefillNode
from dsa_bridge.transfer.request import TERMINAL

SMALL_CONFIG = {"num_hidden_layers": 4, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
                "index_head_dim": 128}


def wait_for(predicate, timeout_s: float = 10.0, what: str = "condition", *, poll_s: float = 0.002,
             error: type[Exception] = AssertionError, detail=None):
    """Poll ``predicate`` every ``poll_s`` until it is truthy and return its value; after
    ``timeout_s`` (the predicate asked once more at the deadline) raise ``error`` — by default
    an AssertionError, which fails the test; a caller that catches the timeout names its own.
    ``detail``, a function, says what the state was then (for a failure that must be explained)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise error(f"{what} not reached within {timeout_s}s"
                        + (f": {detail()}" if detail is not None else ""))
        time.sleep(poll_s)


def make_pool(config=None, *, size: int = 64 * 32, sentinel: bool = False, **layout_kw):
    layout = DSALayout.from_hf_config(config or SMALL_CONFIG, **layout_kw)
    pool = DSATokenToKVPool.from_layout(layout, size=size)
    if sentinel:
        reset_pages(pool, np.arange(pool.num_kv_pages))
    return pool


def aux_tensors(slots: int, fill: int | None = None) -> list[np.ndarray]:
    """Two aux buffers of ``slots`` slots (64 and 512 bytes a slot), as SGLang's metadata buffers."""
    rng = np.random.default_rng(slots)
    out = [np.zeros((slots, 64), np.uint8), np.zeros((slots, 512), np.uint8)]
    for buf in out:
        buf[:] = rng.integers(0, 256, buf.shape, dtype=np.uint8) if fill is None else fill
    return out


def infos(bufs):
    return [(b.ctypes.data, b.nbytes, b[0].nbytes) for b in bufs]


def ended(*handles):
    wait_for(lambda: all(h.poll() in TERMINAL for h in handles), 20, "the request's end")


# Long enough that a loaded machine (CI with a CPU burner, load 20) never makes a live node look
# silent: these nodes share one process and its GIL. Tests of liveness set their own.
PEER_TIMEOUT_S = 6.0


def prefill_node(engine, made, aux=None, *, request_timeout_s=60.0):
    """A prefill node over the real engine ``engine``, checksums on, closed by ``made``."""
    node = PrefillNode(make_pool(), create_backend(engine), peer_timeout_s=PEER_TIMEOUT_S,
                       heartbeat_s=0.1,
                       checksums=True, aux_buffers=infos(aux or []),
                       request_timeout_s=request_timeout_s)
    made.append(node)
    return node


def decode_node(engine, made, prefills, aux=None, *, request_timeout_s=60.0):
    """A decode node of the ``prefills`` over the real engine ``engine``, its pages at the
    sentinel, checksums on, closed by ``made``."""
    node = DecodeNode(make_pool(size=64 * 24, sentinel=True), create_backend(engine),
                      [p.endpoint for p in prefills], peer_timeout_s=PEER_TIMEOUT_S, heartbeat_s=0.1,
                      checksums=True, aux_buffers=infos(aux or []),
                      request_timeout_s=request_timeout_s)
    made.append(node)
    return node
