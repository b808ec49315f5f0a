"""sglang's early send on the device: a chunk handed to ``EarlySendDispatcher`` with the event of
the work still writing its pages goes to the engine only once that event completed. On CUDA the
work is a kernel still running when ``send`` is called (``torch.cuda._sleep``, then the pages'
bytes written on the same stream, then the event recorded); on the CPU a thread stands in for the
stream. Decode gets the finished bytes, not what the pages held before."""

from __future__ import annotations

import threading
import time

import numpy as np
import torch

from dsa_bridge.plugin.sglang.early_send import EarlySendDispatcher
from dsa_bridge.transfer.backends import create_backend
from dsa_bridge.transfer.decode import DecodeNode
from dsa_bridge.transfer.launcher.page_pattern import expected_pages
from dsa_bridge.transfer.prefill import PrefillNode
from dsa_bridge.transfer.request import KVPoll
from tests.transfer.helpers import wait_for

from .device_bytes import fill_pattern, mismatches, random_fill
from .test_device_pools import device_pool

SLEEP_CYCLES = 2_000_000_000  # about a second of one SM at 2 GHz
CPU_DELAY_S = 0.5


class ThreadEvent:
    """A CPU stand-in of a CUDA event recorded after work on a stream: ``query()`` turns True
    once ``work`` ran, ``delay_s`` after it was started."""

    def __init__(self, work, delay_s: float):
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(work, delay_s), daemon=True)
        self._thread.start()

    def _run(self, work, delay_s: float) -> None:
        time.sleep(delay_s)
        work()
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def join(self) -> None:
        self._thread.join(10.0)


def slow_write(pool, room: int, pages: np.ndarray):
    """Write request ``room``'s pattern into ``pages`` behind slow work; the event after it."""
    if torch.device(pool.device).type == "cuda":
        index = torch.as_tensor(pages, dtype=torch.int64, device=pool.device)
        writes = [(pool.page_view(layer, kind), expected_pages(
            room, layer, kind, np.arange(pages.size), pool.page_view(layer, kind).shape[1]
        ).to(pool.device)) for layer, kind in pool.buffer_keys()]  # a host copy waits: before
        torch.cuda.synchronize(pool.device)
        torch.cuda._sleep(SLEEP_CYCLES)
        for view, want in writes:  # queued behind the sleep on the same stream, device to device
            view.index_copy_(0, index, want)
        event = torch.cuda.Event()
        event.record()
        return event
    return ThreadEvent(lambda: fill_pattern(pool, room, pages), CPU_DELAY_S)


def test_a_chunk_is_read_only_once_its_event_completed(device, engine):
    src_pool, dst_pool = device_pool("deepseek-v3.2-fp8", device), device_pool(
        "deepseek-v3.2-fp8", device)
    random_fill(src_pool, 1)  # what the pages held before the forward wrote them
    pages = np.array([1, 2, 4])
    with PrefillNode(src_pool, create_backend(engine, host="127.0.0.1"), listen="127.0.0.1:0",
                     peer_timeout_s=10.0, checksums=True) as prefill, \
            DecodeNode(dst_pool, create_backend(engine, host="127.0.0.1"), prefill.endpoint,
                       peer_timeout_s=10.0, checksums=True) as decode:
        dispatcher, event = EarlySendDispatcher("gpu-tier", wait_s=30.0), None
        try:
            receiver = decode.receiver(7)
            receiver.init(pages, pages.size * 64)
            sender = prefill.sender(7)
            sender.init(pages.size)
            event = slow_write(src_pool, 7, pages)
            dispatcher.send(sender, pages, event)
            assert not event.query()  # the work is still running: the chunk is held
            wait_for(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), 60,
                     "the request's end")
            assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
            assert event.query()
            assert mismatches(dst_pool, 7, pages) == 0  # the written bytes, not the old ones
        finally:
            dispatcher.close()
            if isinstance(event, ThreadEvent):
                event.join()
