"""The sglang KVSender of dsa-bridge: one request on a prefill rank.

``DSABridgeKVSender``: ``init(num_kv_indices, aux_index)``, ``send(kv_indices, state_indices)``
(the DSA state indices, with the last chunk, must be the request's KV pages: one function
derives the indexer pages), ``poll()``, ``poll_pp_consensus()`` (every stage's status, on
pipeline stage 0), ``pop_decode_prefix_len()`` (decode's radix-cache prefix, from its pages),
``failure_exception()`` raising, ``abort()``, ``clear()``, ``mark_prefill_complete()`` (sglang's
``prefill_complete`` policy: decode may allocate now). A chunk sglang sends early (its
``_early_send_wait_event``) and the chunks after it wait in the manager's
``EarlySendDispatcher`` until the forward writing their pages finished (``early_send.py``).

On a prefill attention-CP rank other than 0 in sglang's default CP mode (``mgr.is_dummy_cp_rank``;
not with layer split, where every CP rank writes its layers) a sender is sglang's dummy
(``DummyCPRequest``): WaitingForInput at once, without a node request or a DP-rank registration,
Success once the request's last chunk is sent, writing nothing; CP rank 0 writes the request.

Where the request's pages are split among the prefill ranks (``mgr.page_share``: sglang's KV
sharding, prefill CP's page split) each chunk goes to the node as this rank's share of it
(``early_send.ShareChunk``: its page ids in this rank's pool, their positions in the request),
a chunk with none of its pages sent only when it is the last.
"""

from __future__ import annotations

import time

import numpy as np
from sglang.srt.disaggregation.base.conn import BaseKVSender, KVPoll, KVTransferMetric
from sglang.srt.environ import envs
from sglang.srt.runtime_context import get_parallel

from .bringup import backend_of, dp_route, sglang_class
from .early_send import LazyChunk, ShareChunk, joined
from .failures import ANOTHER_RANK_FAILED, TERMINAL, FailedRequest, state_problem
from .manager import DSABridgeKVManager
from .phases import PhaseClock


class DummyCPRequest:
    """A request on a prefill CP rank that writes nothing (``bringup.dummy_cp_rank``), as sglang's
    dummy CP senders: ``status`` WaitingForInput from the start, Success once the pages ``init``
    announced were all ``sent`` (the last chunk), Failed when ``abort``-ed first (``reason``)."""

    def __init__(self):
        self.status = KVPoll.WaitingForInput
        self.pages_left: int | None = None
        self.reason = ""

    def init(self, num_pages: int) -> None:
        self.pages_left = num_pages

    def sent(self, num_pages: int) -> None:
        if self.status in TERMINAL:
            return
        if self.pages_left is None:
            self.abort("send before init")
            return
        self.pages_left -= num_pages
        if self.pages_left <= 0:
            self.status = KVPoll.Success

    def abort(self, reason: str) -> None:
        if self.status not in TERMINAL:
            self.status, self.reason = KVPoll.Failed, reason


class DSABridgeKVSender(BaseKVSender):
    """One request on a prefill rank (``mgr.node.sender(room)``)."""

    def __new__(cls, mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank=False):
        if isinstance(mgr, DSABridgeKVManager):
            return super().__new__(cls)
        return sglang_class(backend_of(mgr.server_args), "KVSender")(
            mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank)

    def __init__(self, mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank=False):
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = bootstrap_room
        self._sent: list[np.ndarray] = []  # each chunk's page ids, once read
        self._queued = 0  # the pages of the chunks ``send`` got (read or not yet)
        self._num_pages = 0  # ``init``'s: the request's pages (those after decode's prefix)
        self._early_send_wait_event = None  # sglang sets it before an early send (prefill.py)
        self._phases = PhaseClock("prefill", mgr.phase_limits, time.monotonic(),  # sglang's deadlines
                                  deferred=mgr.defer_allocation)
        self._failed: FailedRequest | None = None
        self._dummy: DummyCPRequest | None = None
        if mgr.is_dummy_cp_rank:  # CP rank 0 writes the request; nothing registered for decode
            self._sender, self._dummy = None, DummyCPRequest()
            mgr.stages.track(self)
            return
        mgr.drop_announcements()  # rooms decode announced first: informational only
        try:
            if mgr.memory_released:
                raise ValueError("this rank's cache memory is released (sglang's "
                                 "release_memory_occupation, not resumed yet)")
            self._sender = mgr.node.sender(bootstrap_room, deferred=mgr.defer_allocation)
        except ValueError as exc:
            self._sender = None
            self._failed = FailedRequest(bootstrap_room, str(exc))
        parallel = get_parallel()
        route = dp_route(bootstrap_room, mgr.attn_dp_rank, parallel.num_dp_ranks,
                         load_balance_method=parallel.load_balance_method,
                         force_query=bool(envs.SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK.get()),
                         given_dp_rank=req_has_disagg_prefill_dp_rank)
        if route.conflict and self._sender is not None:
            self._sender.abort(route.conflict)
        elif route.register:
            mgr.register_dp_rank(bootstrap_addr, bootstrap_room)
        mgr.stages.track(self)

    def mark_prefill_complete(self) -> None:
        """sglang's prefill finished computing the request (``prefill_complete`` policy, after
        the last chunk's forward): decode may allocate its pages now (the node tells decode, at
        once or when decode reserves the room), and the bootstrap phase starts."""
        self._phases.prefilled(time.monotonic())
        if self._sender is not None:
            self._sender.prefill_complete()

    def pop_decode_prefix_len(self) -> int:
        """The request's first tokens decode holds already (its radix cache), as decode's pages
        told this rank: sglang's prefill sends the request's pages from there
        (``finalize_bootstrap``: ``start_send_idx``, and ``init`` counts only the rest)."""
        return 0 if self._sender is None else self._sender.decode_prefix_tokens

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        """sglang's prefill asks before each chunk (prefill.py ``_send_kv_chunk``): a chunk with
        pages, and the last one even without (it carries the aux slot: the first token), as
        sglang's own senders answer (common/conn.py). A decode radix-cache hit covering the
        whole page-aligned prompt makes a request of no page: ``init(0)``, then that empty last
        chunk alone."""
        return num_pages > 0 or last_chunk

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        if self._dummy is not None:
            self._dummy.init(int(num_kv_indices))
        if self._sender is None:
            return
        self._num_pages = int(num_kv_indices)
        try:
            self._sender.init(int(num_kv_indices), aux_index=aux_index)
        except ValueError as exc:
            self._sender.abort(f"bad init: {exc}")

    @property
    def supports_host_tensor_indices(self) -> bool:
        """Whether sglang gives ``send`` each chunk's page indices as a pinned host tensor still
        being copied from the GPU, with the event after the copy (``indices_event``), instead of
        copying them on its scheduler thread with a blocking ``.cpu()``: where the pool is on a
        GPU (``mgr.host_tensor_indices``; on the CPU there is no copy to wait for)."""
        return self.kv_mgr.host_tensor_indices

    def send(self, kv_indices, state_indices=None, num_kv_tokens=None, indices_event=None) -> None:
        """A chunk of the request's page indices: handed to the node now, or, where sglang's
        events say its pages are still being written (an early send) or its indices still being
        copied to the host (``indices_event``), once those completed (``early_send``): never
        waited for on sglang's scheduler thread, and the indices read only then."""
        if self._dummy is not None:
            self._early_send_wait_event = None
            self._dummy.sent(len(kv_indices))
        if self._sender is None:
            return
        start, count = self._queued, len(kv_indices)
        self._queued += count
        event, self._early_send_wait_event = joined(self._early_send_wait_event, indices_event), None
        chunk = LazyChunk(count, lambda: self._chunk(kv_indices, state_indices, start))
        self.kv_mgr.early_sends.send(self._sender, chunk, event)

    def _chunk(self, kv_indices, state_indices, start: int):
        """The chunk the node gets, its page indices read now (they are ready): page ids, or this
        rank's share of them (``ShareChunk``); None where sglang's DSA state indices are not the
        request's pages (the request fails, naming why)."""
        pages = np.asarray(kv_indices, dtype=np.int64)
        self._sent.append(pages)
        if state_indices is not None:
            problem = state_problem(state_indices, np.concatenate(self._sent))
            if problem:
                self._sender.abort(problem)
                return None
        share = self.kv_mgr.page_share
        if share is not None:  # this rank's share of the chunk
            return ShareChunk(*share.of_chunk(pages, start, self._num_pages), start + pages.size)
        return pages

    def poll(self) -> KVPoll:
        """The request's status; a phase past its sglang bound (``phases``) fails it, naming the
        phase and the variable."""
        if self._dummy is not None:
            return int(self._dummy.status)
        if self._sender is None:
            return KVPoll.Failed
        status, now = self._sender.poll(), time.monotonic()
        if status in TERMINAL:
            self._phases.finish()
        elif status != KVPoll.Bootstrapping:  # decode's pages arrived
            self._phases.advance(now)
        expired = self._phases.expired(now)
        if expired is not None:
            self._sender.abort(expired)
            status = self._sender.poll()
        return int(status)

    def poll_pp_consensus(self) -> KVPoll:
        """The room's status over every pipeline stage, as sglang's prefill bootstrap queue polls
        it on stage 0 (``poll_and_all_reduce_prefill_pp``) before passing the verdict on to the
        later stages; with one stage, ``poll()``."""
        own = self.poll()
        if self.kv_mgr.stages.store is None:
            return own
        return self.kv_mgr.stages.verdict(self.bootstrap_room, own)

    def failure_exception(self):
        """Raise why the request failed. sglang calls this on every TP rank once any rank's poll
        failed: a rank whose own transfer did not fail stops it first (its writer writes no
        further chunk; decode hears of it once no write of it can land), before sglang frees the
        request's pages."""
        if self._failed is not None:
            raise self._failed.exception()
        if self._dummy is not None:
            if self._dummy.status == KVPoll.Failed:
                raise FailedRequest(self.bootstrap_room, self._dummy.reason).exception()
            self._dummy.abort(ANOTHER_RANK_FAILED)
            raise FailedRequest(self.bootstrap_room, ANOTHER_RANK_FAILED, from_another_rank=True).exception()
        exc = self._sender.failure_exception()
        if exc is None:
            if self._sender.poll() not in TERMINAL:
                self._sender.abort(ANOTHER_RANK_FAILED)
            raise FailedRequest(self.bootstrap_room, ANOTHER_RANK_FAILED, from_another_rank=True).exception()
        raise exc

    def abort(self) -> None:
        if self._dummy is not None:
            self._dummy.abort("aborted by sglang")
        if self._sender is not None:
            self._sender.abort("aborted by sglang")

    def clear(self) -> None:
        """sglang's prefill calls this once the transfer succeeded: the room leaves the stages'
        consensus. A transfer still running is stopped (sglang frees its pages next)."""
        if self._sender is not None and self._sender.poll() not in TERMINAL:
            self._sender.abort("cleared by sglang")
        self.kv_mgr.stages.forget(self.bootstrap_room)

    def get_transfer_metric(self) -> KVTransferMetric:
        """sglang's transfer metrics of the request (its prefill observes latency, MB and GB/s
        from them once the request leaves its inflight queue): the transfer's latency, from its
        first chunk handed to the engine to its end, and the bytes its engine writes wrote (into
        every decode rank that received it)."""
        state = self._sender.state if self._sender is not None else None
        if state is None or state.finished_at is None:
            return KVTransferMetric()
        started = state.transferring_at or state.created
        return KVTransferMetric(transfer_latency_s=state.finished_at - started,
                                transfer_total_bytes=self._sender.nbytes)
