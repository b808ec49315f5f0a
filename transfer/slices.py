"""Copies between a pool's pages and a staging slice, for the staged route: ``gather`` (prefill:
pages -> slice) and ``scatter`` (decode: slice -> pages), one call per buffer, with the slice's
page index made once per slice (``page_index``).

On the CPU, each run of consecutive pages moves as one memmove, a slice assignment between two
``memoryview``s over the buffers' addresses (``host_bytes``), which holds the GIL throughout:
these copies run in dsa-bridge's own threads (the gather thread, decode's scatter thread) beside
a host engine's Python loop (vLLM's engine core steps without pause while requests wait for
KV). A copy that releases the GIL (every torch op, numpy's large copies) waits to take it back
until that loop drops it, up to the interpreter's switch interval (5 ms) per call: a slice of
61 layers' pages took 2.4 s so, against about 0.1 s in runs of memmoves (docs/vllm.md). On a
device, ``index_select`` / ``index_copy_`` with the page ids on that device, each row seen in
the widest integer type that divides its length and both addresses (torch's index kernels copy
a uint8 tensor one byte at a time).

``staging_for`` says whether a pool can stage at all: one that shows no page views (``page_view``
and ``device``: SGLang's buffer infos alone) gets no staging area.
"""

from __future__ import annotations

import ctypes
import functools
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


def page_runs(pages: np.ndarray) -> np.ndarray:
    """(first slice row, first page, pages) of each run of consecutive page ids in ``pages``, in
    order: slice row ``r`` holds page ``pages[r]``."""
    pages = np.asarray(pages, dtype=np.int64).ravel()
    starts = np.flatnonzero(np.diff(pages, prepend=pages[:1] - 2) != 1)
    lengths = np.diff(starts, append=pages.size)
    return np.stack([starts, pages[starts], lengths], axis=1)


def page_index(pages: np.ndarray, device: torch.device) -> np.ndarray | torch.Tensor:
    """What ``gather`` and ``scatter`` take for ``pages``: their runs on the CPU
    (``page_runs``), the page ids as a tensor on a device."""
    if device.type == "cpu":
        return page_runs(pages)
    return torch.from_numpy(np.ascontiguousarray(pages)).to(device)


def host_bytes(tensor: torch.Tensor, nbytes: int) -> memoryview:
    """The ``nbytes`` bytes from ``tensor``'s first element, as a memoryview (no torch op: one
    would release the GIL)."""
    return _bytes_at(tensor.data_ptr(), nbytes)


@functools.lru_cache(maxsize=4096)
def _bytes_at(address: int, nbytes: int) -> memoryview:
    """A memoryview of ``nbytes`` bytes at ``address`` (made once: a slice's buffers are the
    same each time)."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B")


def _host_copies(view: torch.Tensor, area: torch.Tensor, start: int, runs: np.ndarray):
    """(``view``'s rows and ``area``'s bytes as memoryviews, and per run: its first byte in
    the rows, in the area, and its bytes), a CPU ``view``'s rows being ``view.stride(0)`` apart
    (rows not adjacent move one by one)."""
    width, stride = view.shape[1], view.stride(0)
    if view.stride(1) != 1:
        raise ValueError("a staged copy needs each page's bytes contiguous (stride 1)")
    first, end = (int(runs[:, 1].min()), int((runs[:, 1] + runs[:, 2]).max())) if len(runs) else (0, 0)
    if first < 0 or end > view.shape[0]:
        raise ValueError(f"a staged copy's pages must lie in [0, {view.shape[0]}), got runs "
                         f"from {first} to {end - 1}")
    if stride != width:
        pages = np.concatenate([np.arange(p, p + n) for _, p, n in runs])
        runs = np.stack([np.arange(pages.size), pages, np.ones_like(pages)], axis=1)
    rows = host_bytes(view, (view.shape[0] - 1) * stride + width)
    copies = zip((runs[:, 1] * stride).tolist(), (start + runs[:, 0] * width).tolist(),
                 (runs[:, 2] * width).tolist(), strict=True)
    return rows, host_bytes(area, area.shape[0]), copies


def _as_words(view: torch.Tensor, other: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``view`` (rows) and the flat ``other`` as rows of the same widest common word (one that
    divides the row's length, the rows' stride and both addresses)."""
    basis = math.gcd(view.shape[1], view.stride(0), view.data_ptr(), other.data_ptr())
    word = next(w for w in WORDS if basis % w.itemsize == 0)
    rows = view.view(word)
    return rows, other.view(word).view(-1, rows.shape[1])


def _part(area: torch.Tensor, start: int, view: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The bytes of ``area`` from ``start`` that ``index``'s rows of ``view`` fill."""
    return area[start:start + index.numel() * view.shape[1]]


def gather(view: torch.Tensor, index: np.ndarray | torch.Tensor, area: torch.Tensor,
           start: int) -> None:
    """``view``'s rows at ``index`` (``page_index``), in order, into the flat uint8 ``area``
    from byte ``start``."""
    if isinstance(index, torch.Tensor):
        rows, target = _as_words(view, _part(area, start, view, index))
        torch.index_select(rows, 0, index, out=target)
        return
    rows, part, copies = _host_copies(view, area, start, index)
    for at_rows, at_part, nbytes in copies:
        part[at_part:at_part + nbytes] = rows[at_rows:at_rows + nbytes]


def scatter(area: torch.Tensor, start: int, view: torch.Tensor,
            index: np.ndarray | torch.Tensor) -> None:
    """The flat uint8 ``area``'s bytes from ``start`` into ``view``'s rows at ``index``
    (``page_index``), in order."""
    if isinstance(index, torch.Tensor):
        rows, source = _as_words(view, _part(area, start, view, index))
        rows.index_copy_(0, index, source)
        return
    rows, part, copies = _host_copies(view, area, start, index)
    for at_rows, at_part, nbytes in copies:
        rows[at_rows:at_rows + nbytes] = part[at_part:at_part + nbytes]
