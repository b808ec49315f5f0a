"""The row copies of the pool's token operations: a buffer's bytes as rows of one width
(``row_view``) and the rows covering byte ranges (``covering_rows``); a copy between row views,
planned once per set of row indices and applied to every layer (``plan_row_copy``: numpy on the
CPU, slice copies for long runs; index_select / index_copy_ on a device); and one part of one
layer moved between the pool and a host copy (``copy_rows_to_host``, ``copy_rows_from_host``).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable

import numpy as np
import torch

MIN_RUN_BYTES = 32 * 1024  # from this mean run size on, row runs are copied as slices


def row_view(t: torch.Tensor, width: int, align: int | None = None) -> torch.Tensor:
    """The bytes of contiguous ``t`` as rows of ``width`` bytes, in the widest integer dtype that
    divides ``align`` (default ``width``) and ``t``'s byte offset in its storage: copies then move
    words, not single bytes. A view: writes land in ``t``."""
    raw = t.view(torch.uint8).reshape(-1)
    basis = math.gcd(width if align is None else align, raw.storage_offset())
    word = next(d for d in (torch.int64, torch.int32, torch.int16, torch.uint8)
                if basis % d.itemsize == 0)
    return raw.view(word).view(-1, width // word.itemsize)


def covering_rows(byte_offsets: torch.Tensor, width: int, nbytes: int) -> torch.Tensor:
    """Indices of the ``width``-byte rows covering ``nbytes`` bytes at each offset, in order."""
    parts = torch.arange(nbytes // width, device=byte_offsets.device)
    return ((byte_offsets // width)[:, None] + parts).reshape(-1)


RowCopy = Callable[[torch.Tensor, torch.Tensor], None]


def plan_row_copy(dst_index: torch.Tensor | None, src_index: torch.Tensor | None,
                  row_bytes: int) -> RowCopy:
    """``copy(dst, src)``: ``dst[dst_index[i]] = src[src_index[i]]`` for every i (``None``: all
    rows, in order) between row views of ``row_bytes`` bytes; ``dst_index`` unique. Planned once
    for the indices, applied to every layer. Not a snapshot: the caller keeps source and target
    rows apart. Indices are checked by the caller.

    On the CPU through numpy, not torch: torch's CPU index kernels copy one element at a time
    and fan out to intra-op threads that stall on a busy machine (docs/benchmarks.md). Where the
    rows come in long runs (a request's tokens: whole pages) each run is one slice copy, a
    memcpy; otherwise numpy's row gather / scatter. On a device (either side), index_select /
    index_copy_."""
    index = src_index if dst_index is None else dst_index
    if index is None or index.device.type != "cpu":
        return functools.partial(_device_copy, dst_index, src_index)
    di = None if dst_index is None else dst_index.numpy()
    si = None if src_index is None else src_index.numpy()
    count = len(si if di is None else di)
    step = np.ones(max(count - 1, 0), dtype=bool)
    for ix in (di, si):
        if ix is not None:
            step &= np.diff(ix) == 1
    cuts = [0, *(np.flatnonzero(~step) + 1).tolist(), count]
    if (len(cuts) - 1) * MIN_RUN_BYTES <= count * row_bytes:
        runs = [(start if di is None else int(di[start]), start if si is None else int(si[start]),
                 end - start) for start, end in itertools.pairwise(cuts)]
        return functools.partial(_copy_runs, runs)
    return functools.partial(_copy_indexed, di, si)


def _numpy_pair(dst: torch.Tensor, src: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """numpy views of two row views; in the narrower word where they differ (a host tensor at
    an offset its word size does not divide), so a copy moves bytes, never converts values."""
    d, s = dst.numpy(), src.numpy()
    if d.dtype != s.dtype:
        word = min(d.dtype, s.dtype, key=lambda t: t.itemsize)
        d, s = d.view(word), s.view(word)
    return d, s


def _copy_runs(runs: list[tuple[int, int, int]], dst: torch.Tensor, src: torch.Tensor) -> None:
    d, s = _numpy_pair(dst, src)
    for at, frm, length in runs:
        d[at:at + length] = s[frm:frm + length]


def _copy_indexed(di: np.ndarray | None, si: np.ndarray | None, dst: torch.Tensor,
                  src: torch.Tensor) -> None:
    d, s = _numpy_pair(dst, src)
    if di is None:
        np.take(s, si, axis=0, out=d, mode="clip")  # clip: no buffered copy of ``out``
    else:
        d[di] = s if si is None else s[si]


def _device_copy(dst_index: torch.Tensor | None, src_index: torch.Tensor | None,
                 dst: torch.Tensor, src: torch.Tensor) -> None:
    rows = src if src_index is None else src.index_select(0, src_index)
    if rows.dtype != dst.dtype:  # the same bytes in dst's word
        rows = rows.contiguous().view(torch.uint8).view(dst.dtype)
    if dst_index is None:
        dst.copy_(rows)  # across devices for a host copy
    else:
        dst.index_copy_(0, dst_index, rows.to(dst.device))


def copy_rows_to_host(row_copy: RowCopy, view: torch.Tensor, values: torch.Tensor,
                      part: tuple[int, int]) -> None:
    """One part of one layer of a chunk of the pool (row view ``view``) into a host copy's
    ``values``."""
    row_copy(row_view(values, *part), view)


def copy_rows_from_host(row_copy: RowCopy, view: torch.Tensor, values: torch.Tensor,
                        part: tuple[int, int], dev: torch.device) -> None:
    """One part of one layer of a chunk of a host copy into the pool; moved to the pool's
    device here, so a device holds one such temporary at a time."""
    row_copy(view, row_view(values.to(dev).contiguous(), *part))

