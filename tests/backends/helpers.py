"""Helpers for the real-engine tests: the local side, DSA-sized runs, the oracle, a guard."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from dsa_bridge.transfer.backends.base import TransferBackend

from .peer import SENTINEL, Peer

KV_PAGE = 41_984  # one DSA MLA KV page (64 tokens x 656 B)
INDEXER_PAGE = 8_448  # one DSA indexer page (64 tokens x 132 B)
ENGINE_ATTR = {"mooncake": "_engine", "nixl": "_agent"}


@dataclass
class Local:
    """This process's backend, with a registered source buffer of random bytes."""

    backend: TransferBackend
    source: np.ndarray

    @property
    def base(self) -> int:
        return self.source.ctypes.data


def dsa_runs(
    rng: np.random.Generator, count: int, local: Local, peer: Peer
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``count`` runs of KV/indexer page size at random gaps, in a different order on each side."""
    length = rng.choice(np.array([KV_PAGE, INDEXER_PAGE], dtype=np.uint64), count)

    def place(base: int, space: int, order: np.ndarray) -> np.ndarray:
        gaps = rng.integers(0, 4096, count).astype(np.uint64)
        ends = np.cumsum(length[order] + gaps)
        assert int(ends[-1]) <= space, "buffer too small for this many runs"
        offsets = np.empty(count, dtype=np.uint64)
        offsets[order] = ends - length[order]
        return base + offsets

    src = place(local.base, local.source.nbytes, rng.permutation(count))
    dst = place(peer.addr, peer.nbytes, rng.permutation(count))
    return src, dst, length


def oracle(local: Local, peer: Peer, src: np.ndarray, dst: np.ndarray, length: np.ndarray) -> np.ndarray:
    """The peer buffer expected after the write: sentinel everywhere except the written ranges."""
    expected = np.full(peer.nbytes, SENTINEL, dtype=np.uint8)
    for s, d, n in zip((src - local.base).tolist(), (dst - peer.addr).tolist(), length.tolist(), strict=True):
        expected[d : d + n] = local.source[s : s + n]
    return expected


class _NoEngine:
    def __getattr__(self, name: str) -> None:
        raise AssertionError(f"the engine was called ({name}) before the checks refused")


@contextlib.contextmanager
def engine_forbidden(backend: TransferBackend) -> Iterator[None]:
    """Any engine call inside this block fails the test."""
    attr = ENGINE_ATTR[backend.name]
    real = getattr(backend, attr)
    setattr(backend, attr, _NoEngine())
    try:
        yield
    finally:
        setattr(backend, attr, real)
