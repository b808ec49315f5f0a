"""The staged route between processes: ``dsa-bridge prefill --route staged`` (pages from its
allocator's fragmented free list, all 61 DeepSeek-V3.2 layers) into a decode node in the test
process that asks for one page in two (every page its own descriptor on the direct route), over
both real engines: every byte lands, one descriptor per staging slice, and ``--route auto`` tries
each route on the first chunks of a size class (two direct, then staged)."""

from __future__ import annotations

import numpy as np
import pytest

from dsa_bridge.transfer.backends import create_backend
from dsa_bridge.transfer.decode import DecodeNode
from dsa_bridge.transfer.launcher.drivers import count_mismatches, sentinel_intact

from .processes import PrefillProcess
from .test_two_process import POOL_TOKENS, decode_pool, run

STAGING_MIB = 64  # two slices of 32 MiB: 10 pages of 3.08 MB (61 layers, both caches) each


@pytest.fixture(scope="module")
def prefills(backend, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("staged")
    nodes = {}
    try:
        for route in ("staged", "auto"):
            nodes[route] = PrefillProcess(tmp, backend, "--pool-tokens", str(POOL_TOKENS),
                                          "--peer-timeout", "10", "--chunk-pages", "16",
                                          "--route", route, "--staging-mib", str(STAGING_MIB))
        yield nodes
    finally:
        for node in nodes.values():
            node.stop()


@pytest.mark.parametrize("route", ["staged", "auto"])
def test_fragmented_pages_land_byte_exact_on_the_route_chosen(backend, prefills, route):
    """40 pages in chunks of 16, 16 and 8: slices of 32 MiB hold 10 pages, so 2 + 2 + 1 slices
    staged; on auto (a new node: its route costs know nothing yet), chunks of one-page runs x 122
    buffers go direct twice, then staged (``route_costs.MIN_SAMPLES`` of each)."""
    with DecodeNode(decode_pool(), create_backend(backend), prefills[route].endpoint,
                    peer_timeout_s=10.0, request_timeout_s=60.0,
                    staging_bytes=STAGING_MIB << 20) as node:
        pages = np.arange(2, 82, 2)
        (receiver, _), = run(node, [(1, pages)])
        assert count_mismatches(node.pool, 1, pages) == 0, receiver.failure_exception()
        assert sentinel_intact(node.pool, np.setdiff1d(np.arange(1, node.pool.num_kv_pages), pages))
        staged = route == "staged"
        assert receiver.descriptors == (2 + 2 + 1 if staged else 32 * 122 + 1)
        counts = node.counters.snapshot()
        assert counts["staged_chunks"] == (3 if staged else 1)
        assert counts["staging_bytes"] == STAGING_MIB << 20
