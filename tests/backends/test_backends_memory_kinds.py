"""A region's claimed device ("cpu", "cuda:N") against the memory its pointer is
(``transfer/memory_kinds.py``): the CUDA driver's answers stood in for by lookups, and this
host's own lookup (no CUDA driver here: every buffer is host memory)."""

from __future__ import annotations

import numpy as np
import pytest

from dsa_bridge.plugin.descriptors import BufferDescriptor
from dsa_bridge.transfer.memory_kinds import (
    CU_MEMORYTYPE_DEVICE,
    CU_MEMORYTYPE_HOST,
    CU_MEMORYTYPE_UNIFIED,
    PointerInfo,
    device_problem,
    process_lookup,
)


def answer(info: PointerInfo | None):
    return lambda ptr: info


def failing(ptr: int) -> PointerInfo | None:
    raise OSError(f"cuPointerGetAttribute({ptr:#x}) failed with CUDA error 999")


@pytest.mark.parametrize("device, info", [
    ("cpu", None),  # plain host memory
    ("cpu", PointerInfo(CU_MEMORYTYPE_HOST, -1)),  # pinned host memory
    ("cuda:0", PointerInfo(CU_MEMORYTYPE_DEVICE, 0)),
    ("cuda:3", PointerInfo(CU_MEMORYTYPE_DEVICE, 3)),
])
def test_a_region_claimed_as_the_memory_it_is_passes(device, info):
    region = BufferDescriptor(3, "kv", 0x10000, 4096, 4096, device)
    assert device_problem(region, answer(info)) is None


@pytest.mark.parametrize("device, lookup, said", [
    ("cuda:0", answer(None), "claims cuda:0 but its pointer is host memory"),
    ("cuda:0", answer(PointerInfo(CU_MEMORYTYPE_HOST, -1)), "is pinned host memory"),
    ("cpu", answer(PointerInfo(CU_MEMORYTYPE_DEVICE, 0)), "claims cpu but its pointer is gpu memory (cuda:0"),
    ("cuda:0", answer(PointerInfo(CU_MEMORYTYPE_DEVICE, 1)), "is gpu memory (cuda:1"),
    ("cuda:0", answer(PointerInfo(CU_MEMORYTYPE_UNIFIED, 0)), "unified"),
    ("cuda:0", failing, "CUDA error 999"),
    ("cuda:0", None, "claims cuda:0 but this process has no CUDA driver"),
    ("cuda:2", None, "claims cuda:2"),
])
def test_a_region_claimed_as_other_memory_is_refused_by_name(device, lookup, said):
    region = BufferDescriptor(3, "kv", 0x10000, 4096, 4096, device)
    problem = device_problem(region, lookup)
    assert problem is not None and said in problem
    assert problem.startswith(str(region)) and "\n" not in problem  # one line naming layer 3's kv


def test_this_hosts_lookup_takes_host_memory_as_cpu_only():
    """On a host without CUDA (this suite's), the lookup is None: "cpu" passes, "cuda:0" does
    not; on a CUDA host the driver says the same of a numpy array."""
    host = np.zeros(4096, dtype=np.uint8)
    region = BufferDescriptor(0, "index", host.ctypes.data, host.nbytes, 4096)
    lookup = process_lookup()
    assert device_problem(region, lookup) is None
    claimed = BufferDescriptor(0, "index", host.ctypes.data, host.nbytes, 4096, "cuda:0")
    assert "claims cuda:0" in device_problem(claimed, lookup)
