"""Shared helpers for the pool-side tests: fill a pool with known bytes, snapshot, compare."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsa_bridge.plugin import DSATokenToKVPool


class PoolBytes:
    """Byte-level access to every buffer of a pool, keyed by (layer_id, kind)."""

    @staticmethod
    def views(pool: DSATokenToKVPool) -> dict[tuple[int, str], torch.Tensor]:
        """Every buffer the pool holds (a compact pool: no indexer of a shared layer)."""
        return {(lid, kind): pool.page_view(lid, kind) for lid, kind in pool.buffer_keys()}

    def fill(self, pool: DSATokenToKVPool, seed: int) -> None:
        """Random bytes in every page of every buffer (padding page included)."""
        gen = torch.Generator().manual_seed(seed)
        for view in self.views(pool).values():
            view.copy_(torch.randint(0, 256, view.shape, dtype=torch.uint8, generator=gen))

    def snapshot(self, pool: DSATokenToKVPool) -> dict[tuple[int, str], np.ndarray]:
        return {key: view.cpu().numpy().copy() for key, view in self.views(pool).items()}

    def assert_equal(self, pool: DSATokenToKVPool, expected: dict) -> None:
        for key, view in self.views(pool).items():
            np.testing.assert_array_equal(view.cpu().numpy(), expected[key], err_msg=str(key))


@pytest.fixture(scope="session")
def pool_bytes() -> PoolBytes:
    return PoolBytes()


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """These tests make many tiny tensor ops; on a shared 2-core box intra-op threads only spin."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
