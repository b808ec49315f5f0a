"""The decode side of the staged route: this node's registered staging area, each prefill node's
share of it, and the thread that scatters staged slices into the pool.

``SliceScatter`` allocates one staging area on the pool's device (``staging.staging_size``),
registered with the node's other regions, and splits it into one share per prefill node
(``staging.split_area``), offered in that node's Hello (``protocol.StagingArea``). A prefill
node writes a group of a request's pages (every buffer it writes, buffer-major:
``staging.slice_offsets``) into a slice of its share and reports it (``SliceWritten``); the
control thread checks the report against the share and the request (``slice_written_locked``: a
slice of the share, pages within the request; ProtocolError otherwise) and queues it. The scatter
thread, in arrival order, copies the slice into the request's pages (``slices.scatter``, on the
pool's device), hands the outcome forward to the request (``KVReceiver.slice_scattered_locked``),
then frees the slice (``SliceFree``). A request that has ended meanwhile gets nothing; its slice
is freed all the same.

While a scatter into a request's pages may run, the request counts it (``KVReceiver.scatters``)
and its pages are not released. The node's other messages keep their order behind the slices
(``hold_locked``, ``behind_slices.BehindSlices``): the scatter thread only says when a slice is
through, and the control thread handles what that releases (``release_locked``), woken by the
slice's ``SliceFree``. A staged chunk's report thus counts, and its checksums are verified, over
the pages as the scatter left them; the scatter thread never runs the node's handlers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch
import zmq

from ...plugin.descriptors import BufferDescriptor, raw_region
from .. import protocol
from ..plan import buffer_order
from ..request import TERMINAL
from ..slices import page_index, scatter, staging_for
from ..staging import slice_offsets, split_area, staging_size
from .behind_slices import BehindSlices
from .job_thread import JobThread
from .receiver import KVReceiver
from .sessions import PrefillPeer

log = logging.getLogger(__name__)


class SliceScatter:
    """Decode's staging area and its scatter thread (module docstring)."""

    def __init__(self, pool, name: str, lock: threading.Lock, *, peers: int,
                 send: Callable[[zmq.Socket, protocol.Message], None],
                 staging_bytes: int | None = None, slice_bytes: int | None = None):
        pool_bytes = sum(b.nbytes for b in pool.buffer_descriptors())
        self.nbytes, self.slice_bytes = staging_size(staging_for(pool, staging_bytes), pool_bytes,
                                                     slice_bytes, peers)
        self._pool = pool
        self._lock = lock
        self._send = send
        self._order = BehindSlices()  # node's lock
        self._views = {(d.layer_id, d.kind): pool.page_view(d.layer_id, d.kind)
                       for d in pool.buffer_descriptors()} if self.nbytes else {}
        self._area = torch.empty(self.nbytes, dtype=torch.uint8, device=pool.device) \
            if self.nbytes else None
        self.areas: list[protocol.StagingArea | None] = [None] * peers
        if self._area is not None:
            self.areas = [protocol.StagingArea(self._area.data_ptr() + offset, self.slice_bytes,
                                               slices)
                          for offset, slices in split_area(self.nbytes, self.slice_bytes, peers)]
        self._thread = JobThread(f"{name}-scatter", self._handle)

    def regions(self) -> list[BufferDescriptor]:
        """The staging area to register with the engine (none when staging is off)."""
        if self._area is None:
            return []
        return [raw_region(self._area.data_ptr(), self.nbytes, str(self._area.device))]

    # ---- the control thread (node's lock held) ----------------------------------------------

    def slice_written_locked(self, peer: PrefillPeer, receiver: KVReceiver | None,
                             written: protocol.SliceWritten) -> None:
        """``peer`` filled a slice for ``receiver`` (None: a request no longer known here)."""
        area = peer.staging
        if area is None or not 0 <= written.slice < area.slices:
            raise protocol.ProtocolError(f"slice {written.slice} is not one of prefill "
                                         f"{peer.endpoint}'s staging slices")
        if receiver is None or receiver.state.status in TERMINAL:
            self._queue_locked((peer, None, written))  # nothing to scatter: the slice to free
            return
        pages = receiver.page_ids.size if receiver.page_ids is not None else 0
        if not receiver.stageable:
            raise protocol.ProtocolError(f"room {written.room}: a staged slice from prefill "
                                         f"{peer.endpoint} for a request of shares or of two "
                                         "page lists")
        if (peer not in receiver.peers or written.pages < 1 or written.offset < 0
                or written.offset + written.pages > pages
                or written.pages * peer.page_bytes > area.slice_bytes):
            raise protocol.ProtocolError(
                f"room {written.room}: slice of pages {written.offset}+{written.pages} does not "
                f"fit the request's {pages} pages or the slice")
        receiver.scatters += 1
        self._queue_locked((peer, receiver, written))

    def hold_locked(self, message: object) -> bool:
        """True when ``message`` (a message, with what the node needs to handle it) must wait
        behind the slices queued before it: it is held until ``release_locked``. False: handle it
        now."""
        return self._order.hold(message)

    def release_locked(self) -> list:
        """The held messages that may be handled now, in the order they arrived."""
        return self._order.release()

    @property
    def holding(self) -> bool:
        """Messages are held (read by the control thread, the only one that holds or releases
        them, so without the lock)."""
        return self._order.held > 0

    def _queue_locked(self, job: tuple) -> None:
        self._order.slice_queued()
        self._thread.put(job)

    def close(self, timeout_s: float = 10.0) -> None:
        self._thread.close(timeout_s)

    # ---- the scatter thread -----------------------------------------------------------------

    def _handle(self, job: tuple) -> None:
        """Scatter a slice (unless its request is gone), hand the outcome forward to the request
        (``KVReceiver.slice_scattered_locked``: a failed scatter fails it), then free the slice:
        its ``SliceFree`` also wakes the control thread for the messages it releases."""
        peer, receiver, written = job
        try:
            if receiver is not None:
                problem = self._scatter(peer, receiver, written)
                with self._lock:
                    receiver.slice_scattered_locked(problem, time.monotonic())
        except Exception:  # a bug must not stop the thread, nor keep the slice
            log.exception("room %d: handing a scattered slice on failed", written.room)
        finally:
            with self._lock:
                self._order.slice_through()
            self._send(peer.socket, protocol.SliceFree([written.slice]))

    def _scatter(self, peer: PrefillPeer, receiver: KVReceiver,
                 written: protocol.SliceWritten) -> str:
        """Copy the slice into the request's pages (unless it ended meanwhile); why that failed,
        or ""."""
        try:
            with self._lock:
                if receiver.state.status in TERMINAL:
                    return ""
            pages = receiver.page_ids[written.offset:written.offset + written.pages]
            keys = sorted(peer.keys, key=buffer_order)
            offsets = slice_offsets([self._views[key].shape[1] for key in keys], pages.size)
            area = peer.staging
            offsets += area.ptr - self._area.data_ptr() + written.slice * area.slice_bytes
            index = page_index(pages, self._area.device)
            for i, key in enumerate(keys):
                scatter(self._area, int(offsets[i]), self._views[key], index)
            if self._area.is_cuda:  # the slice is read before prefill may write it again
                torch.cuda.current_stream(self._area.device).synchronize()
            return ""
        except Exception as exc:
            log.exception("room %d: scattering a staged slice failed", written.room)
            return f"internal error scattering a staged slice: {type(exc).__name__}: {exc}"
