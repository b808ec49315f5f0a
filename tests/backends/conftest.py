"""Fixtures for the real-engine tests: one peer process and one local backend per engine.

Engines are expensive to start and stop (Mooncake teardown ~1 s, a peer process ~2-3 s with its
torch import), so the shared peer and the local backend live for the whole session; tests that
kill or freeze a peer get their own ``victim``. Every process is stopped by PID at teardown.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from dsa_bridge.plugin.descriptors import raw_region
from dsa_bridge.transfer.backends import BACKENDS, create_backend

from ..conftest import require_engine
from .helpers import Local
from .peer import SENTINEL, Peer, start_peer

PEER_BYTES = 128 << 20
SOURCE_BYTES = 128 << 20


@pytest.fixture(scope="session", params=BACKENDS)
def backend_name(request: pytest.FixtureRequest) -> str:
    require_engine(request.param)
    return request.param


@pytest.fixture(scope="session")
def peer(backend_name: str) -> Iterator[Peer]:
    started = start_peer(backend_name, PEER_BYTES, lifetime_s=300)
    yield started
    assert started.stop() == 0, "the peer process did not exit cleanly"


@pytest.fixture(scope="session")
def local(backend_name: str) -> Iterator[Local]:
    backend = create_backend(backend_name)
    source = np.random.default_rng(7).integers(0, 256, SOURCE_BYTES, dtype=np.uint8)
    backend.register([raw_region(source.ctypes.data, source.nbytes, "cpu")])
    yield Local(backend, source)
    backend.close()


@pytest.fixture
def connected(local: Local, peer: Peer) -> Iterator[tuple[Local, Peer, str]]:
    """The local backend connected to a peer whose buffer holds only the sentinel."""
    assert peer.ask("fill", SENTINEL) == "ok"
    yield local, peer, local.backend.connect(peer.metadata)


@pytest.fixture
def victim(backend_name: str) -> Iterator[Peer]:
    """A peer of its own, for tests that kill or freeze it."""
    started = start_peer(backend_name, 1 << 20, lifetime_s=60)
    yield started
    started.stop()
