"""End-to-end page checksums, pure: one 64-bit value per (buffer, page) of a chunk.

Prefill computes them over the pages it sends (every layer, both caches) and sends them with the
chunk's ``ChunkDone``; decode computes them again over the pages the chunk wrote into its own
pool and compares, before the request may turn Success. Two algorithms, named on the wire so that
both sides compute the same one whatever their devices:

- ``xxh3_64``: xxHash3 (64-bit) of each page's bytes, over numpy views of a CPU pool;
- ``wsum64``: sum over each page's 64-bit words of ``word * weight`` modulo 2**64, with fixed
  odd pseudo-random weights, as one torch reduction on the pool's own device (a CUDA pool's pages
  never leave the GPU). An odd weight is invertible modulo 2**64, so a change to any one word —
  any flipped byte — always changes the sum. Pages whose length is not a multiple of 8 weigh
  their last bytes one by one.

A pool on CPU sends ``xxh3_64``, one on CUDA ``wsum64``; the verifying side computes whichever
the message names (``xxh3_64`` of a CUDA page copies it to the host first).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from ..plugin.descriptors import BufferKey
from . import protocol
from .plan import on_index_pages

XXH3 = "xxh3_64"
WSUM = "wsum64"
ALGORITHMS = (XXH3, WSUM)
MAX_CHECKSUM_BYTES = protocol.MAX_MESSAGE_BYTES // 2  # of one ChunkDone; the rest is headroom


class ChecksumError(ValueError):
    """A chunk whose checksums do not match its pages, or cannot be checked at all."""


def algorithm_for(device: torch.device | str) -> str:
    """The algorithm a pool on ``device`` computes: xxHash3 on the CPU, the torch sum elsewhere."""
    return XXH3 if torch.device(device).type == "cpu" else WSUM


def pool_views(pool) -> dict[BufferKey, torch.Tensor]:
    """Every buffer of the pool as a (pages, item_len) uint8 view, keyed by (layer id, kind)."""
    return {(d.layer_id, d.kind): pool.page_view(d.layer_id, d.kind) for d in pool.buffer_descriptors()}


@functools.lru_cache(maxsize=32)
def _weights(count: int, device: str) -> torch.Tensor:
    """``count`` fixed odd 64-bit weights (the same on every node: seeded by the count)."""
    rng = np.random.default_rng(0x5EED0000 + count)
    weights = rng.integers(-(2**63), 2**63 - 1, count, dtype=np.int64, endpoint=True) | 1
    return torch.from_numpy(weights).to(device)


def weighted_sums(pages: torch.Tensor) -> torch.Tensor:
    """``wsum64`` of each row of a (pages, item_len) uint8 tensor, on its device: int64 (pages,)."""
    if pages.dtype != torch.uint8 or pages.dim() != 2:
        raise ValueError(f"pages must be a 2-D uint8 tensor, got {pages.dtype} {tuple(pages.shape)}")
    item_len = pages.shape[1]
    whole = item_len - item_len % 8
    device = str(pages.device)
    total = torch.zeros(pages.shape[0], dtype=torch.int64, device=pages.device)
    if whole:
        flat = pages[:, :whole].reshape(-1)  # a copy unless the rows are already packed
        if flat.storage_offset() % 8:
            flat = flat.clone()
        words = flat.view(torch.int64).view(pages.shape[0], whole // 8)
        total += (words * _weights(whole // 8, device)).sum(dim=1)
    if whole < item_len:  # the last bytes, one weight each, after the words' weights
        tail = pages[:, whole:].to(torch.int64)
        total += (tail * _weights(whole // 8 + item_len - whole, device)[whole // 8:]).sum(dim=1)
    return total


def page_checksums(view: torch.Tensor, pages: np.ndarray, algorithm: str) -> np.ndarray:
    """The checksum of each of ``pages`` (row ids of ``view``, a (pages, item_len) uint8 tensor),
    as uint64, in the order of ``pages``."""
    if algorithm == XXH3:
        on_cpu = view.device.type == "cpu"
        rows = view.numpy() if on_cpu else _select(view, pages).cpu().numpy()
        picked = pages if on_cpu else range(len(pages))
        digest = xxhash.xxh3_64_intdigest
        return np.fromiter((digest(rows[p]) for p in picked), dtype=np.uint64, count=len(pages))
    if algorithm == WSUM:
        return weighted_sums(_select(view, pages)).cpu().numpy().view(np.uint64)
    raise ChecksumError(f"unknown checksum algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")


def _select(view: torch.Tensor, pages: np.ndarray) -> torch.Tensor:
    return view.index_select(0, torch.from_numpy(pages).to(view.device))


def chunk_checksums(views: dict[BufferKey, torch.Tensor], keys: Sequence[BufferKey], pages: np.ndarray,
                    offset: int, algorithm: str) -> protocol.PageChecksums:
    """What prefill sends with a chunk: the checksums of ``pages`` in every buffer of ``keys``,
    buffer-major; ``offset`` is the chunk's first page within the request."""
    values = np.stack([page_checksums(views[key], pages, algorithm) for key in keys])
    if values.nbytes > MAX_CHECKSUM_BYTES:
        raise ChecksumError(f"a chunk of {len(pages)} pages x {len(keys)} buffers needs {values.nbytes} "
                            f"bytes of checksums, more than {MAX_CHECKSUM_BYTES}: send chunks of at "
                            f"most {max_chunk_pages(len(keys))} pages")
    return protocol.PageChecksums(algorithm, int(offset), [tuple(key) for key in keys],
                                  values.astype("<u8").tobytes())


def max_chunk_pages(num_buffers: int) -> int:
    """The most pages one chunk may hold for its checksums to fit one message."""
    return MAX_CHECKSUM_BYTES // (8 * num_buffers)


def verify_chunk(views: dict[BufferKey, torch.Tensor], request_pages: np.ndarray,
                 sums: protocol.PageChecksums | None, *, index_pages: np.ndarray | None = None,
                 kv_on_index_pages: frozenset[int] = frozenset()) -> int:
    """Check a chunk's pages in decode's pool against the checksums prefill sent.

    ``request_pages`` are decode's page ids of the whole request (``index_pages`` its indexer's,
    where they differ: for the indexer buffers and the KV layers in ``kv_on_index_pages``,
    ``plan.on_index_pages``); the chunk covers those at ``[sums.offset, sums.offset + n)``.
    Returns the number of (buffer, page) checksums verified; raises ChecksumError naming the
    layer, cache and page of the first mismatch, or what is wrong with the message."""
    if sums is None:
        raise ChecksumError("prefill sent no checksums (is it running with --checksums?)")
    if sums.algorithm not in ALGORITHMS:
        raise ChecksumError(f"unknown checksum algorithm {sums.algorithm!r} "
                            f"(known: {', '.join(ALGORITHMS)})")
    unknown = [key for key in sums.buffers if key not in views]
    if unknown:
        raise ChecksumError(f"checksums name a buffer (layer {unknown[0][0]}, {unknown[0][1]}) "
                            f"that this pool does not hold")
    keys = list(sums.buffers)
    if len(set(keys)) != len(keys):
        raise ChecksumError("checksums list a buffer twice")
    if not keys or len(sums.values) % (8 * len(keys)):
        raise ChecksumError(f"{len(sums.values)} bytes of checksums do not divide into "
                            f"{len(keys)} buffers of 8-byte values")
    count = len(sums.values) // (8 * len(keys))
    if count == 0 or sums.offset < 0 or sums.offset + count > len(request_pages):
        raise ChecksumError(f"checksums of pages [{sums.offset}, {sums.offset + count}) do not fit "
                            f"the request's {len(request_pages)} pages")
    window = slice(sums.offset, sums.offset + count)
    pages = np.asarray(request_pages[window], dtype=np.int64)
    at_index = pages if index_pages is None else np.asarray(index_pages[window], dtype=np.int64)
    pages_of = [at_index if on_index_pages(key, kv_on_index_pages) else pages for key in keys]
    expected = np.frombuffer(sums.values, dtype="<u8").reshape(len(keys), count)
    actual = np.stack([page_checksums(views[key], at, sums.algorithm)
                       for key, at in zip(keys, pages_of, strict=True)])
    bad = np.argwhere(actual != expected)
    if bad.size:
        buffer, i = (int(x) for x in bad[0])
        layer, kind = keys[buffer]
        raise ChecksumError(f"checksum mismatch: layer {layer} {kind} cache, page "
                            f"{int(pages_of[buffer][i])} "
                            f"(page {sums.offset + i} of the request); {len(bad)} of "
                            f"{expected.size} checksums of the chunk differ")
    return expected.size


def check_coverage(verified: int, num_pages: int, num_buffers: int) -> None:
    """Once the last chunk is verified, every (buffer, page) of the request must have been."""
    if verified != num_pages * num_buffers:
        raise ChecksumError(f"checksums covered {verified} of the request's {num_pages} pages x "
                            f"{num_buffers} buffers = {num_pages * num_buffers}")
