"""The sglang KVReceiver of dsa-bridge: one request on a decode rank.

``DSABridgeKVReceiver``: ``init(prefill_dp_rank)`` (connects to that prefill; a refused
handshake fails the request, with the reason), ``send_metadata(kv_indices, aux_index,
state_indices, decode_prefix_len, destination, device_kv_indices)`` (the pages after decode's
radix-cache prefix, which prefill then skips; under HiSparse the DSA state indices are the
indexer's own pages, and with a draft model ``device_kv_indices``, equal to them, the draft
KV's; a refused call tells prefill at once), ``poll()``
(Failed, with the reason, once its prefill is refused), ``failure_exception()`` (sglang's
``KVTransferError``; a checksum failure in sglang's words, "KV checksum mismatch"),
``abort()``, ``ensure_abort_notified()``, ``clear()``. With sglang's ``prefill_complete`` policy it
reserves the request at ``init`` and polls Bootstrapping until the prefill is ready
(``prefill_ready``). ``fail_recompute(reason)`` when the
manager's rebootstrap request to the prefill failed (``submit_prefill_recompute``).
"""

from __future__ import annotations

import logging
import time

import numpy as np
from sglang.srt.disaggregation.base.conn import BaseKVReceiver, KVPoll, KVTransferDestination

from ...transfer.decode import DecodeNode, KVReceiver
from ...transfer.handshake import HandshakeError
from .bringup import PrefillGroup, backend_of, sglang_class
from .deferred_release import DEFERRED_RELEASE_ENV
from .failures import (
    ANOTHER_RANK_FAILED,
    TERMINAL,
    BridgeTransferError,
    FailedRequest,
    failure_reason,
    state_problem,
)
from .manager import DSABridgeKVManager
from .phases import PhaseClock

log = logging.getLogger(__name__)

class DSABridgeKVReceiver(BaseKVReceiver):
    """One request on a decode rank, fed by the prefill DP group ``init`` names."""

    def __new__(cls, mgr, bootstrap_addr, bootstrap_room=None, **kwargs):
        if isinstance(mgr, DSABridgeKVManager):
            return super().__new__(cls)
        return sglang_class(backend_of(mgr.server_args), "KVReceiver")(
            mgr, bootstrap_addr, bootstrap_room, **kwargs)

    def __init__(self, mgr, bootstrap_addr, bootstrap_room=None):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self.conclude_state = None
        self.require_staging = False
        self.abort_notified = False  # sglang's: the prefill was told to stop (``ensure_abort_notified``)
        self.bootstrap_infos: list[str] | None = None  # the prefill ranks that may write (endpoints)
        self._dp_rank: int | None = None  # the prefill DP group, while its node is connecting
        self._node: DecodeNode | None = None
        self._group: PrefillGroup | None = None  # the prefill ranks the node talks to
        self._receiver: KVReceiver | None = None
        self._metadata_sent = False
        self._failed: FailedRequest | None = None
        self._forced = False  # a forced release of its pages was counted
        self._recompute_failure: str | None = None  # set by the manager's HTTP thread
        self._phases = PhaseClock("decode", mgr.phase_limits, time.monotonic(),  # sglang's deadlines
                                  deferred=mgr.defer_allocation)

    def fail(self, reason: str, *, logged: bool = False) -> None:
        """Fail the request; ``logged`` when the manager already logged the reason (once for
        every request of that prefill). The manager's parts call it too (sglang's memory saver
        releasing the cache: ``DeferredRelease.fail_all``)."""
        if self._failed is None:
            if not logged:
                log.warning("dsa-bridge: room %s failed: %s", self.bootstrap_room, reason)
            self._failed = FailedRequest(self.bootstrap_room, reason)
            self.conclude_state = KVPoll.Failed  # (read by sglang's prefill_complete path)
            if self._receiver is not None:
                self._receiver.abort(reason)

    def init(self, prefill_dp_rank: int) -> None:
        self._dp_rank = int(prefill_dp_rank)
        self._attach()

    def _attach(self) -> None:
        """Join the node of its prefill DP group once it is connected (on the manager's
        connector thread: until then the request stays Bootstrapping). A request that failed
        meanwhile (an abort) still tells its prefill, at once."""
        dp_rank = self._dp_rank
        try:  # the manager logs a refusal or a failed connection once, not per request
            connected = self.kv_mgr.decode_node_for(self.bootstrap_addr, dp_rank)
        except (HandshakeError, RuntimeError, ValueError, OSError) as exc:
            self._dp_rank = None
            self.fail(f"prefill {self.bootstrap_addr} (dp {dp_rank}): {exc}", logged=True)
            return
        if connected is None:
            return
        self._dp_rank = None
        self._node, self._group = connected
        self.kv_mgr.deferred_release.forget_released()  # a cleared request's room may be free again
        try:
            self._receiver = self._node.receiver(self.bootstrap_room, list(self._group.write),
                                                 reserve=self.kv_mgr.defer_allocation,
                                                 shares=self._group.shares)
        except ValueError as exc:
            self.fail(f"prefill {self.bootstrap_addr} (dp {dp_rank}): {exc}")
            return
        self.bootstrap_infos = [peer.endpoint for peer in self._receiver.peers]
        self.kv_mgr.deferred_release.track(self)
        if self._failed is not None:  # failed while connecting
            self._receiver.abort(self._failed.reason)

    def send_metadata(self, kv_indices, aux_index=None, state_indices=None, decode_prefix_len=None,
                      destination=KVTransferDestination.DEVICE, device_kv_indices=None) -> None:
        if self._receiver is None:
            self.fail("send_metadata before a successful init")
            return
        if self._failed is not None:
            return
        pages = np.asarray(kv_indices, dtype=np.int64)
        prefix = int(decode_prefix_len or 0)  # tokens of decode's radix cache: pages are the rest
        page_size = self.kv_mgr.kv_args.page_size
        problem = (
            f"decode_prefix_len {prefix} is not a whole number of {page_size}-token pages"
            if prefix % page_size
            else f"destination {destination} is not supported (device only)"
            if destination != KVTransferDestination.DEVICE
            else self._state_problem(state_indices, pages)
            or self._device_kv_problem(device_kv_indices, state_indices))
        if problem:
            self.fail(problem)  # prefill's sender is told at once (it fails, not times out)
            return
        index_pages = self._index_pages(state_indices)
        try:
            self._receiver.init(pages, aux_index=aux_index, prefix_tokens=prefix,
                                copies=self._group.copies, index_page_ids=index_pages)
        except ValueError as exc:
            self.fail(f"bad metadata: {exc}")
            return
        if self._group.idle:  # a wider prefill: its other ranks end the request writing nothing
            self._node.nothing_to_send(self.bootstrap_room, list(self._group.idle),
                                       prefix_tokens=prefix)
        self._metadata_sent = True
        self._phases.advance(time.monotonic())  # sglang's waiting timeout starts at send_metadata

    def _state_problem(self, state_indices, pages: np.ndarray) -> str | None:
        """Why sglang's DSA state indices cannot be taken: under HiSparse they must be given (the
        indexer's own pages), else they must be the KV pages (``state_problem``)."""
        if self.kv_mgr.hisparse:
            given = state_indices[0] if state_indices is not None and len(state_indices) == 1 else None
            return None if given is not None else (
                "HiSparse decode without the DSA state indices (the indexer's own pages)")
        return state_problem(state_indices, pages) if state_indices is not None else None

    def _device_kv_problem(self, device_kv_indices, state_indices) -> str | None:
        """Why sglang's ``device_kv_indices`` cannot be taken. Under HiSparse with a draft model
        they are the draft KV's device pages, which sglang allocates as the indexer's (its
        logical pages, the DSA state indices): dsa-bridge writes the draft's KV at the indexer's
        pages (``kv_on_index_pages``), so they must be given and equal those. Otherwise sglang
        sends none."""
        draft_on_device = bool(self.kv_mgr.kv_on_index_pages)
        if device_kv_indices is None:
            return ("HiSparse decode with a draft model without device_kv_indices (the draft "
                    "KV's device pages)") if draft_on_device else None
        if not draft_on_device:
            return ("device_kv_indices given, but this decode keeps no KV on the device apart "
                    "(HiSparse with a draft model)")
        device = np.asarray(device_kv_indices, dtype=np.int64).ravel()
        index = self._index_pages(state_indices)
        if not np.array_equal(device, index):
            return (f"device_kv_indices ({device.size} pages) differ from the DSA state indices "
                    f"({index.size} pages): dsa-bridge writes a draft model's KV at the "
                    "indexer's pages, as sglang allocates them with --disable-radix-cache")
        return None

    def _index_pages(self, state_indices) -> np.ndarray | None:
        """The indexer's own pages under HiSparse (its device pool's, beside the host pool's KV
        pages); None otherwise (the indexer's pages are the KV pages)."""
        if not self.kv_mgr.hisparse:
            return None
        return np.asarray(state_indices[0], dtype=np.int64).ravel()

    def poll(self) -> KVPoll:
        """The request's status; a phase past its sglang bound (``phases``) fails it, naming the
        phase and the variable."""
        status = self._status()
        if status in TERMINAL:
            self._phases.finish()
            return status
        expired = self._phases.expired(time.monotonic())
        if expired is None:
            return status
        self.fail(expired)
        return KVPoll.Failed

    def fail_recompute(self, reason: str) -> None:
        """The manager could not ask the prefill to compute this (rebootstrapped) request again
        (its HTTP thread): the request fails at its next poll, unless it has succeeded."""
        self._recompute_failure = reason

    def _status(self) -> KVPoll:
        self.kv_mgr.deferred_release.forget_released()
        if self._recompute_failure is not None:
            reason, self._recompute_failure = self._recompute_failure, None
            if self._receiver is None or self._receiver.poll() != KVPoll.Success:
                self.fail(reason)
        if self._dp_rank is not None:  # its node was being connected
            self._attach()
        if self._failed is None and self._receiver is None:
            refusal = self.kv_mgr.prefill_refusal(self.bootstrap_addr)
            if refusal is not None:  # sglang's queue never calls init for a refused prefill
                self.fail(refusal, logged=True)
                self.kv_mgr.tell_sglang_prefill(self.bootstrap_addr, self.bootstrap_room, refusal)
        if self._failed is not None:
            return KVPoll.Failed
        if self._receiver is None:
            return KVPoll.Bootstrapping
        status = self._receiver.poll()
        if not self._metadata_sent and status != KVPoll.Failed:
            if not self._receiver.prefill_ready:  # prefill_complete: allocate once it computed
                return KVPoll.Bootstrapping
            self._phases.prefilled(time.monotonic())
            return KVPoll.WaitingForInput  # connected: ready for the pages
        return int(status)

    def failure_exception(self):
        """Raise why the request failed. sglang calls this on every TP rank once any rank's poll
        failed: a rank whose own transfer did not fail stops it first (dsa-bridge's Abort to its
        prefill; the fence holds the pages until no write can land), before sglang frees them."""
        exc = self._receiver.failure_exception() if self._receiver is not None else None
        if self._failed is None and exc is None:
            self.fail(ANOTHER_RANK_FAILED, logged=True)
            self._failed.from_another_rank = True
        if self._failed is not None:
            raise self._failed.exception()
        raise BridgeTransferError(self.bootstrap_room, failure_reason(str(exc))) from exc

    def abort(self) -> None:
        """sglang's abort (a client's, or its own): fail the request and tell the prefill."""
        self.fail("aborted by sglang")
        self.ensure_abort_notified()

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """Tell the prefill ranks to stop writing, once, and arm sglang's hold of the pages (once
        the pages were sent, or ``force_arm``), as sglang's own receivers do. Without a
        dsa-bridge request (``bootstrap_infos`` None) nothing can write: nothing to notify, and
        sglang releases at once. The recorded failure reason is kept."""
        if self.abort_notified or self.bootstrap_infos is None or self._receiver is None:
            return
        if self.kv_mgr.enable_deferred_decode_kv_release and (force_arm or self._metadata_sent):
            self.kv_mgr.register_deferred_abort_room(self.bootstrap_room)
        self._receiver.abort("aborted by sglang")  # dsa-bridge's Abort (a no-op once failed)
        self.abort_notified = True

    def can_release(self) -> bool:
        """Whether the request's pages may go back to sglang's allocator (the fence)."""
        return self._receiver is None or self._receiver.can_release()

    def release_forced(self, how: str) -> None:
        """sglang releases the pages while the fence holds them: count it once (the manager)."""
        if not self._forced:
            self._forced = True
            self.kv_mgr.deferred_release.count_forced_release(self.bootstrap_room, how)

    def clear(self) -> None:
        """sglang is done with the request and its pages are going back to its allocator (every
        call site of sglang 0.5.23 releases them with it). A request still running is aborted;
        one whose fence still holds is a forced release (counted); the request leaves the node
        once its fence lifts."""
        if self._dp_rank is not None:  # connecting: a connection made now tells its prefill
            self.fail("cleared by sglang", logged=True)
            self._attach()
        if self._receiver is None:
            return
        if self._receiver.poll() not in TERMINAL:
            self._receiver.abort("cleared by sglang")
        if not self._receiver.can_release():
            self.release_forced(f"at once ({DEFERRED_RELEASE_ENV} off)"
                                if not self.kv_mgr.enable_deferred_decode_kv_release
                                else "without holding them until the fence lifted")
        self.kv_mgr.deferred_release.untrack(self, self._node, self._receiver)
        self._receiver = None
