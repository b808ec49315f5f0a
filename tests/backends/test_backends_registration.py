"""Registration is refused before the engine sees it; close() deregisters everything, once."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from dsa_bridge.plugin.descriptors import BufferDescriptor, raw_region
from dsa_bridge.transfer.backends import create_backend
from dsa_bridge.transfer.backends.base import BackendError

from .helpers import engine_forbidden

SCRATCH = np.zeros(1 << 20, dtype=np.uint8)
BASE = SCRATCH.ctypes.data


def refused_cases(registered: BufferDescriptor) -> dict[str, list[BufferDescriptor]]:
    return {
        "zero length": [raw_region(BASE, 0)],
        "null pointer": [raw_region(0, 4096)],
        "unknown device": [raw_region(BASE, 4096, "gpu0")],
        "host memory claimed as a GPU's": [raw_region(BASE, 4096, "cuda:0")],
        "duplicate in one call": [raw_region(BASE, 4096), raw_region(BASE, 4096)],
        "overlap in one call": [raw_region(BASE, 4096), raw_region(BASE + 4095, 10)],
        "duplicate of a registered region": [registered],
        "overlap with a registered region": [raw_region(registered.ptr + 1, 4096)],
        "good then bad": [raw_region(BASE, 4096), raw_region(BASE + 8192, 0)],
        "nothing": [],
    }


@pytest.mark.parametrize("case", sorted(refused_cases(raw_region(1, 1))))
def test_refused_before_the_engine(local, case: str) -> None:
    registered = raw_region(local.base, local.source.nbytes)
    regions = refused_cases(registered)[case]
    with engine_forbidden(local.backend), pytest.raises(BackendError, match="register") as info:
        local.backend.register(regions)
    if regions:
        assert any(str(region) in str(info.value) for region in regions)


class Recorder:
    """Forwards every call to the real engine and records the names of the calls."""

    def __init__(self, engine: object) -> None:
        self.engine, self.calls = engine, []

    def __getattr__(self, name: str):
        method = getattr(self.engine, name)

        def call(*args, **kwargs):
            self.calls.append(name)
            return method(*args, **kwargs)

        return call


def test_close_deregisters_everything_once(backend_name: str, caplog) -> None:
    options = {"protocol": "rdma"} if backend_name == "mooncake" else {}
    with caplog.at_level(logging.WARNING):
        backend = create_backend(backend_name, **options)
    if backend_name == "mooncake":  # no RDMA device here: Mooncake silently uses TCP; we say so
        assert backend.transport() == "tcp"
        assert "no RDMA device" in caplog.text
    else:
        assert backend.transport().startswith("ucx")
    buffers = [np.zeros(1 << 16, dtype=np.uint8) for _ in range(3)]
    backend.register([raw_region(b.ctypes.data, b.nbytes) for b in buffers[:2]])
    backend.register([raw_region(buffers[2].ctypes.data, buffers[2].nbytes)])
    attr = {"mooncake": "_engine", "nixl": "_agent"}[backend_name]
    recorder = Recorder(getattr(backend, attr))
    setattr(backend, attr, recorder)
    backend.close()
    dereg = {"mooncake": "unregister_memory", "nixl": "deregister_memory"}[backend_name]
    # and each engine's scratch area: Mooncake's disconnect reads into one, NIXL's wake copies
    # within one (its worker threads')
    assert recorder.calls.count(dereg) == 3 + 1
    calls = len(recorder.calls)
    backend.close()
    assert len(recorder.calls) == calls
    with pytest.raises(BackendError, match="closed"):
        backend.register([raw_region(buffers[0].ctypes.data, 16)])
    with pytest.raises(BackendError, match="closed"):
        backend.connect(b"127.0.0.1:15000")
