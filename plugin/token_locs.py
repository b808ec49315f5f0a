"""Checks of the token locations a pool's token operations are given, shared by dsa-bridge's
pool and its SGLang subclass: any locations (``check_token_locs``), locations written to
(``check_targets``), a request's tokens as a paged allocator lays them out
(``check_request_tokens``). Each raises TypeError / ValueError naming the argument.
"""

from __future__ import annotations

from typing import Any

import torch


def check_token_locs(name: str, locs: Any, *, device: torch.device, rows: int) -> torch.Tensor:
    """``locs`` as int64 if it is a 1-D integer tensor on ``device`` with every location in
    ``[0, rows)``; TypeError / ValueError naming ``name`` otherwise."""
    if not isinstance(locs, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(locs).__name__}")
    if locs.dtype == torch.bool or locs.dtype.is_floating_point or locs.dtype.is_complex:
        raise TypeError(f"{name} must have an integer dtype, got {locs.dtype}")
    if locs.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(locs.shape)}")
    if locs.device != device:
        raise ValueError(f"{name} is on {locs.device}, the pool is on {device}")
    locs = locs.long()
    if locs.numel():
        lo, hi = (int(v) for v in torch.aminmax(locs))
        if lo < 0 or hi >= rows:
            raise ValueError(f"{name} out of range: location {lo if lo < 0 else hi} not in [0, {rows})")
    return locs


def check_targets(name: str, locs: torch.Tensor, page_size: int) -> None:
    """Locations written to: none in padding page 0, none twice."""
    if locs.numel() == 0:
        return
    low = int(locs.min())
    if low < page_size:
        raise ValueError(f"{name} targets padding page 0: location {low} < page_size {page_size}")
    if torch.unique(locs).numel() != locs.numel():
        raise ValueError(f"{name} has duplicate locations")


def check_request_tokens(name: str, locs: torch.Tensor, page_size: int) -> None:
    """``locs`` (checked by ``check_token_locs``) must be one request's tokens as a paged
    allocator lays them out, as SGLang's retraction hands them to ``get_cpu_copy``: position
    ``i`` at offset ``i % page_size`` of the request's ``i // page_size``-th page — whole pages,
    each one's tokens in order, then at most one partial page (``seqlen - 1`` tokens); no page
    twice (so no location twice), none the padding page 0. ValueError naming the first
    offending position otherwise."""
    n = locs.numel()
    if n == 0:
        return
    firsts = locs[::page_size]
    misaligned = torch.nonzero(firsts % page_size).flatten()
    if misaligned.numel():
        i = int(misaligned[0]) * page_size
        raise ValueError(
            f"{name} must be a request's tokens (each page's tokens in order from offset 0; "
            f"whole pages but the last): position {i} holds location {int(locs[i])}, at offset "
            f"{int(locs[i]) % page_size} of its page")
    offsets = torch.arange(n, device=locs.device) % page_size
    expected = firsts.repeat_interleave(page_size)[:n] + offsets
    wrong = torch.nonzero(locs != expected).flatten()
    if wrong.numel():
        i = int(wrong[0])
        raise ValueError(
            f"{name} must be a request's tokens (each page's tokens in order from offset 0; "
            f"whole pages but the last): position {i} holds location {int(locs[i])}, expected "
            f"{int(expected[i])}")
    pages = firsts // page_size
    if int(pages.min()) == 0:
        raise ValueError(f"{name} includes padding page 0")
    unique, counts = torch.unique(pages, return_counts=True)
    if unique.numel() != pages.numel():
        raise ValueError(f"{name} has duplicate locations: page {int(unique[counts > 1][0])} "
                         "appears twice")
