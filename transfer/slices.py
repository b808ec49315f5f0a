"""Copies between a pool's pages and a staging slice, for the staged route: ``gather`` (prefill:
pages -> slice) and ``scatter`` (decode: slice -> pages), one call per buffer.

Rows move as words: each (pages, item_len) uint8 view is seen in the widest integer type that
divides its row length and both addresses. On the CPU through numpy (``np.take``, a fancy
assignment: one memcpy per row): torch's CPU index kernels copy a uint8 tensor one byte at a time
(0.2 GB/s here, against 4-5 GB/s for words; docs/benchmarks.md). On a device, ``index_select`` /
``index_copy_`` with the page ids on that device (``device_pages``).

``staging_for`` says whether a pool can stage at all: one that shows no page views (``page_view``
and ``device``: SGLang's buffer infos alone) gets no staging area.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .staging import StagingError

WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def staging_for(pool, requested: int | None) -> int | None:
    """``requested`` staging bytes for a pool whose pages can be gathered and scattered; 0 for
    one that shows no page views, StagingError if staging was asked for it explicitly."""
    if hasattr(pool, "page_view") and hasattr(pool, "device"):
        return requested
    if requested:
        raise StagingError(f"staging_bytes is {requested} but this pool shows no page views "
                           "(page_view) to stage its pages from: set staging_bytes=0")
    return 0


def _as_words(view: torch.Tensor, other: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``view`` (rows) and the flat ``other`` as rows of the same widest common word."""
    basis = math.gcd(view.shape[1], view.data_ptr(), other.data_ptr())
    word = next(w for w in WORDS if basis % w.itemsize == 0)
    rows = view.view(word)
    return rows, other.view(word).view(-1, rows.shape[1])


def device_pages(pages: np.ndarray, device: torch.device) -> torch.Tensor | None:
    """The page ids as a tensor on ``device`` (None on the CPU: numpy takes the array)."""
    if device.type == "cpu":
        return None
    return torch.from_numpy(np.ascontiguousarray(pages)).to(device)


def gather(view: torch.Tensor, pages: np.ndarray, out: torch.Tensor,
           index: torch.Tensor | None = None) -> None:
    """``out`` (flat, ``pages.size`` rows of ``view``'s bytes) = ``view``'s rows ``pages``."""
    rows, target = _as_words(view, out)
    if index is None:
        np.take(rows.numpy(), pages, axis=0, out=target.numpy())
    else:
        torch.index_select(rows, 0, index, out=target)


def scatter(part: torch.Tensor, view: torch.Tensor, pages: np.ndarray,
            index: torch.Tensor | None = None) -> None:
    """``view``'s rows ``pages`` = ``part`` (flat, ``pages.size`` rows)."""
    rows, source = _as_words(view, part)
    if index is None:
        rows.numpy()[pages] = source.numpy()
    else:
        rows.index_copy_(0, index, source)
