"""The staged route's copies (``transfer/slices.py``): runs of pages, byte-exact gathers and
scatters over rows adjacent or strided, and the CPU copy holding the GIL throughout (a host
engine's busy Python loop would otherwise hold each copy up to its switch interval)."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsa_bridge.transfer.slices import gather, page_index, page_runs, scatter

page_lists = st.lists(st.integers(0, 39), min_size=1, max_size=40, unique=True).map(np.array)


@given(page_lists)
def test_runs_cover_the_pages_in_order_each_run_as_long_as_it_can_be(pages):
    runs = page_runs(pages)
    expanded = np.concatenate([np.arange(first, first + n) for _, first, n in runs])
    assert expanded.tolist() == pages.tolist()
    assert runs[:, 0].tolist() == np.cumsum([0, *runs[:-1, 2]]).tolist()  # slice rows in order
    ends = runs[:-1, 1] + runs[:-1, 2]
    assert not np.any(ends == runs[1:, 1]), f"two runs could have been one: {runs.tolist()}"


def _rows(width: int, padding: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A (40, width) uint8 view of random bytes, its rows ``width + padding`` apart."""
    base = torch.randint(0, 256, (40, width + padding), dtype=torch.uint8)
    return base, base[:, :width]


def _index(pages: np.ndarray, kind: str) -> np.ndarray | torch.Tensor:
    """The CPU's runs, or the page ids as a tensor: the path a device takes, run here on the CPU."""
    return page_index(pages, torch.device("cpu")) if kind == "runs" else torch.from_numpy(pages)


@settings(max_examples=60, deadline=None)
@given(pages=page_lists, width=st.sampled_from([1, 13, 64, 656]), padding=st.sampled_from([0, 3]),
       start=st.integers(0, 9), kind=st.sampled_from(["runs", "tensor"]))
def test_a_gather_then_a_scatter_moves_exactly_the_pages_bytes(pages, width, padding, start, kind):
    _, source = _rows(width, padding)
    area = torch.zeros(start + pages.size * width + 7, dtype=torch.uint8)
    gather(source, _index(pages, kind), area, start)
    expected = source.numpy()[pages].reshape(-1)
    assert area[start:start + expected.size].numpy().tolist() == expected.tolist()
    assert not area[:start].any() and not area[start + expected.size:].any(), "bytes outside the part"

    base, target = _rows(width, padding)
    before = base.clone()
    scatter(area, start, target, _index(pages, kind))
    after = base.numpy().copy()
    before.numpy()[pages, :width] = expected.reshape(-1, width)
    assert (after == before.numpy()).all(), "a byte other than the pages' rows changed, or one missed"


def test_rows_whose_bytes_are_not_contiguous_are_refused_by_name():
    view = torch.zeros(8, 16, dtype=torch.uint8)[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        gather(view, page_index(np.array([1]), view.device), torch.zeros(8, dtype=torch.uint8), 0)


@pytest.mark.parametrize("pages", [[39, 40], [-1], [0, -3]])
def test_pages_outside_the_buffer_are_refused_and_nothing_is_written(pages):
    base, view = _rows(16, 0)
    before = base.clone()
    area = torch.zeros(16 * len(pages), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"must lie in \[0, 40\)"):
        scatter(area, 0, view, page_index(np.array(pages), area.device))
    assert torch.equal(base, before)


def test_a_cpu_copy_holds_the_gil_while_a_python_loop_spins_beside_it():
    """A thread that wants to spin in Python gets the GIL during the copies only if they let go
    of it: with a switch interval (2 s) far longer than the copies, no thread can force it from
    them, so its count stays at 0 unless a copy released the GIL (every torch op and numpy's
    large copies do: the old path let it run at its first copy)."""
    pages = np.arange(0, 64, 2)  # one page per run: 32 runs per buffer
    views = [torch.randint(0, 256, (64, width), dtype=torch.uint8) for width in [41984, 8448] * 8]
    area = torch.zeros(pages.size * sum(v.shape[1] for v in views), dtype=torch.uint8)
    index = page_index(pages, area.device)
    count, go, stop = [0], threading.Event(), threading.Event()

    def spin() -> None:
        go.wait()
        while not stop.is_set():
            count[0] += 1

    interval = sys.getswitchinterval()
    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    sys.setswitchinterval(2.0)
    try:
        go.set()  # from here the spinner waits for the GIL, which this thread holds
        start = 0
        for view in views:
            gather(view, index, area, start)
            scatter(area, start, view, index)
            start += pages.size * view.shape[1]
            if count[0]:
                break
        during = count[0]
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        spinner.join(timeout=10)
    assert during == 0, f"the spinner ran {during} times while the copies held the GIL"
    assert not spinner.is_alive()
