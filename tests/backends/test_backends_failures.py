"""A dead or frozen peer: every write ends within a bound, and the engine is not wedged after."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest

from dsa_bridge.plugin.descriptors import raw_region
from dsa_bridge.transfer.backends import create_backend
from dsa_bridge.transfer.backends.base import BackendError, TransferTimeout

from .helpers import INDEXER_PAGE, KV_PAGE, Local
from .peer import start_peer

U64 = np.uint64


def one_page(local, peer, handle: str, *, timeout_s: float) -> None:
    local.backend.write(
        handle,
        np.array([local.base, local.base + KV_PAGE], U64),
        np.array([peer.addr, peer.addr + KV_PAGE], U64),
        np.array([KV_PAGE, INDEXER_PAGE], U64),
        timeout_s=timeout_s,
    )


@pytest.mark.slow
@pytest.mark.parametrize("when", ["after a first write", "before any write"])
def test_write_into_a_dead_peer_fails_fast(local, victim, when: str) -> None:
    handle = local.backend.connect(victim.metadata)
    if when == "after a first write":
        one_page(local, victim, handle, timeout_s=10)
    victim.signal(signal.SIGKILL)
    victim.process.join(5)
    start = time.monotonic()
    with pytest.raises(BackendError) as info:
        one_page(local, victim, handle, timeout_s=10)
    elapsed = time.monotonic() - start
    assert elapsed < 5, f"took {elapsed:.1f} s"
    assert not isinstance(info.value, TransferTimeout), "the engine should notice, not our deadline"


@pytest.mark.slow
@pytest.mark.parametrize("when", ["after a first write", "before any write"])
def test_write_into_a_frozen_peer(local, victim, peer, when: str) -> None:
    """Ends on our deadline when the engine needs the peer; NIXL over CMA does not, once wired."""
    handle = local.backend.connect(victim.metadata)
    if when == "after a first write":
        one_page(local, victim, handle, timeout_s=10)
    victim.freeze()
    if local.backend.name == "nixl" and when == "after a first write":
        # CMA (process_vm_writev) writes into the stopped process one-sidedly: nothing to wait for.
        one_page(local, victim, handle, timeout_s=1.0)
        return
    assert_times_out_twice(local, victim, handle, timeout_s=1.0)
    # The other peers are not held up meanwhile. (Mooncake's own handshake with a frozen peer
    # would hold an engine-wide lock for 60 s; the backend's probe, which holds none, runs first.)
    one_page(local, peer, local.backend.connect(peer.metadata), timeout_s=5)


@pytest.mark.slow
def test_nixl_over_ucx_tcp_frozen_peer_times_out(monkeypatch) -> None:
    """Without CMA (UCX_TLS=tcp on both sides) a wired-up NIXL write needs the peer to run."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    frozen = start_peer("nixl", 1 << 20, lifetime_s=60, env={"UCX_TLS": "tcp"})
    backend = create_backend("nixl")
    try:
        source = np.ones(KV_PAGE + INDEXER_PAGE, dtype=np.uint8)
        backend.register([raw_region(source.ctypes.data, source.nbytes)])
        local = Local(backend, source)
        assert "UCX_TLS=tcp" in backend.transport()
        handle = backend.connect(frozen.metadata)
        one_page(local, frozen, handle, timeout_s=10)
        frozen.freeze()
        assert_times_out_twice(local, frozen, handle, timeout_s=1.0)
    finally:
        backend.close()
        frozen.stop()


def assert_times_out_twice(local, peer, handle: str, *, timeout_s: float) -> None:
    """The second write waits behind the first one (Mooncake) or times out anew (NIXL)."""
    for attempt in (1, 2):
        start = time.monotonic()
        try:
            one_page(local, peer, handle, timeout_s=timeout_s)
        except TransferTimeout:
            pass
        else:
            pytest.fail(f"write {attempt} into the frozen peer completed after "
                        f"{time.monotonic() - start:.2f} s (every thread of the peer stopped: "
                        f"{peer.threads_stopped()})")
        elapsed = time.monotonic() - start
        # the margin is for a loaded machine: what this guards against is Mooncake's 60 s stall
        assert timeout_s <= elapsed < timeout_s + 3, f"write {attempt} took {elapsed:.2f} s"
