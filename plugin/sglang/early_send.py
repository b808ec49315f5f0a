"""A prefill request's chunks held until the forward writing their pages finished.

sglang's early send of a cached prefix (``SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX``, on by
default) sends a chunk before the step's forward is enqueued; with overlap scheduling the previous
step's forward may still be writing those pages, so sglang records a CUDA event after it and sets
it on the sender (``_early_send_wait_event``, prefill.py ``maybe_send_cached_prefix_chunk``): the
chunk's pages may be read only once that event completed. sglang's own Mooncake worker waits on it
(``wait_event.synchronize()``) before reading. dsa-bridge does the same without blocking sglang's
scheduler thread and with a deadline:

- ``HeldChunks``, pure (the caller passes ``now`` and how to ask an event): one request's chunks in
  order, each with its event or None; ``release`` gives the chunks that may go now (in order, up
  to the first whose event has not completed), or the reason to fail the request once that
  chunk waited past its deadline;
- ``EarlySendDispatcher``, one per prefill manager: ``send`` hands a chunk to the node at once
  when nothing of its request is held and it has no event, else holds it; its thread (started at
  the first held chunk, idle while nothing is held) asks the held events every
  ``EVENT_POLL_S`` and hands the chunks to the node in order, or aborts the request with the
  reason. A request that failed meanwhile (aborted by sglang) has its chunks dropped unread.

sglang's other readiness signal, ``send(..., indices_event=...)``: a sender that declares
``supports_host_tensor_indices`` gets each chunk's page indices as a pinned host tensor still
being copied from the GPU, and the CUDA event after that copy (prefill.py ``_send_kv_chunk``),
so that sglang's scheduler thread never waits on a blocking ``.cpu()``. dsa-bridge's sender
declares it where the pool is on a GPU, and hands such a chunk on as a ``LazyChunk``: held here
until both events completed (``AllEvents``), and only then are its page indices read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ...transfer.request import TERMINAL

log = logging.getLogger(__name__)

EARLY_SEND_WAIT_S = 60.0  # a forward not finished this long after its early send fails the request
EVENT_POLL_S = 0.002  # how often held events are asked


@dataclass(frozen=True)
class HeldChunk:
    pages: object  # the chunk's page ids, as ``send`` got them
    event: object | None  # sglang's CUDA event (``query()``), or None: ready once those before are
    deadline: float
    wait_s: float


class HeldChunks:
    """One request's chunks, in order, until they may be read (module docstring)."""

    def __init__(self) -> None:
        self._chunks: deque[HeldChunk] = deque()

    @property
    def waiting(self) -> bool:
        return bool(self._chunks)

    def add(self, pages, event, *, now: float, wait_s: float) -> None:
        self._chunks.append(HeldChunk(pages, event, now + wait_s, wait_s))

    def release(self, now: float, completed: Callable[[object], bool]) -> tuple[list, str | None]:
        """The chunks that may go now, in order, and the reason to fail the request (None while
        none is past its deadline); ``completed(event)`` asks whether an event completed."""
        ready = []
        while self._chunks:
            head = self._chunks[0]
            if head.event is not None and not completed(head.event):
                if now > head.deadline:
                    self._chunks.clear()
                    return ready, (
                        f"the forward writing {len(head.pages)} page(s) sent early had not "
                        f"finished {head.wait_s:g}s after sglang's early send (its "
                        "_early_send_wait_event)" + (
                            ", or their page indices' copy to the host (its indices_event)"
                            if isinstance(head.pages, LazyChunk) else "")
                        + ": their pages were never read")
                break
            ready.append(self._chunks.popleft().pages)
        return ready, None


@dataclass(frozen=True)
class ShareChunk:
    """A chunk of a prefill rank's share of a request's pages (``KVSender.send_share``): its
    page ids, their positions in the request, and how far the request's pages are sent."""

    pages: np.ndarray
    positions: np.ndarray
    through: int

    def __len__(self) -> int:
        return len(self.pages)


@dataclass(frozen=True)
class LazyChunk:
    """A chunk whose page indices may be read only once its events completed (sglang's host
    copy of them): ``count`` pages; ``make()`` reads them and gives page ids, a ``ShareChunk``,
    or None (the request failed on them: nothing to hand on)."""

    count: int
    make: Callable[[], object]

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class AllEvents:
    """Several of sglang's CUDA events as one: completed once each has (``query()``)."""

    events: tuple

    def query(self) -> bool:
        return all(event.query() for event in self.events)


def joined(*events):
    """The events that are not None as one: None, the one, or ``AllEvents``."""
    given = tuple(event for event in events if event is not None)
    return None if not given else given[0] if len(given) == 1 else AllEvents(given)


def hand_on(sender, chunk) -> None:
    """Give the node's ``sender`` a chunk: a ``LazyChunk`` (read now), a ``ShareChunk``, or page
    ids."""
    if isinstance(chunk, LazyChunk):
        chunk = chunk.make()
        if chunk is None:
            return
    if isinstance(chunk, ShareChunk):
        sender.send_share(chunk.pages, chunk.positions, chunk.through)
    else:
        sender.send(chunk)


def event_completed(event) -> bool:
    """Whether sglang's CUDA event (``torch.cuda.Event``) completed: its ``query()``."""
    return bool(event.query())


class EarlySendDispatcher:
    """Hands a prefill manager's chunks to its node, holding those sglang sent early until their
    pages are written (module docstring)."""

    def __init__(self, name: str, wait_s: float = EARLY_SEND_WAIT_S,
                 completed: Callable[[object], bool] = event_completed):
        self.name = name
        self.wait_s = wait_s
        self._completed = completed
        self._held: dict[int, tuple[object, HeldChunks]] = {}  # room -> (node's KVSender, chunks)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def send(self, sender, pages, event=None) -> None:
        """``sender`` (the node's ``KVSender``) gets ``pages`` (page ids, or a ``ShareChunk``)
        now, or once they may be read."""
        with self._lock:
            held = self._held.get(sender.room)
            if event is None and held is None:
                hand_on(sender, pages)
                return
            if held is None:
                held = self._held[sender.room] = (sender, HeldChunks())
            held[1].add(pages, event, now=time.monotonic(), wait_s=self.wait_s)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name=f"dsa-bridge-{self.name}-early-send")
                self._thread.start()
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                idle = not self._held
                if idle:
                    self._wake.clear()
            if idle:
                self._wake.wait()
                continue
            self._release_ready()
            self._stop.wait(EVENT_POLL_S)

    def _release_ready(self) -> None:
        with self._lock:
            for room, (sender, chunks) in list(self._held.items()):
                if sender.state.status in TERMINAL:  # failed meanwhile: its chunks are never read
                    del self._held[room]
                    continue
                try:
                    ready, reason = chunks.release(time.monotonic(), self._completed)
                    for pages in ready:
                        hand_on(sender, pages)
                except (RuntimeError, ValueError) as exc:  # a CUDA error, or a chunk refused
                    ready, reason = [], f"an early-sent chunk could not be handed on: {exc}"
                if reason is not None:
                    log.warning("dsa-bridge: room %s: %s", room, reason)
                    sender.abort(reason)
                if reason is not None or not chunks.waiting:
                    del self._held[room]

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
