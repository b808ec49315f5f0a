"""The connector's scheduler side: which requests load their KV from a prefill (decode), which
finished requests keep their blocks until written (prefill), and what the workers are told.

Push, as vLLM's own NIXL push mode: a prefill request carrying ``do_remote_decode`` finishes
with its blocks held (``request_finished`` returns delay-free and a ``PrefillAnswer`` in its
``kv_transfer_params``: a fresh room and the prefill's control endpoints); the proxy passes
that to the decode, whose ``get_num_new_matched_tokens`` claims the prompt as loaded
asynchronously; once vLLM allocated its blocks (``update_state_after_alloc``) the decode worker
announces them to the prefill, which writes them. Each side's worker reports the request in
``get_finished`` once no write touching its blocks can still run; until then the prefill's
blocks stay held (``has_pending_push_work`` keeps vLLM stepping) and so do the decode's, an
aborted decode request included (``request_finished`` delays its free).

Pure bookkeeping: no socket, thread or clock.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

from vllm.v1.request import RequestStatus

from .metadata import BridgeMetadata, Load, Send
from .options import BridgeOptions, PrefillAnswer, pages_of

log = logging.getLogger(__name__)

_FINISHED_NORMALLY = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)


class BridgeScheduler:
    """The scheduler side's tables (module docstring)."""

    def __init__(self, options: BridgeOptions, *, page_size: int, tp_size: int):
        self.options = options
        self.page_size = page_size
        self.tp_size = tp_size
        self._matched: dict[str, tuple[PrefillAnswer, int]] = {}  # decode: answer, local prefix
        self._meta = BridgeMetadata()  # what the next step tells the workers
        self.sending: set[str] = set()  # prefill: held until the worker reports them
        self.loading: set[str] = set()  # decode: announced, until the worker reports them

    def answer_of(self, request) -> PrefillAnswer | None:
        """The prefill's answer in a decode request's params; None (logged) when it has none
        or one this decode cannot read: the request is then computed here."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        try:
            answer = PrefillAnswer.from_params(params)
        except ValueError as exc:
            log.error("dsa-bridge: request %s: %s; computed here instead", request.request_id, exc)
            return None
        prompt = len(request.prompt_token_ids or ())
        problem = (f"the prefill used engine {answer.engine!r}, this decode {self.options.engine!r}"
                   if answer.engine != self.options.engine else
                   f"the prefill holds {answer.num_tokens} prompt tokens, the request has {prompt}"
                   if answer.num_tokens != prompt else "")
        if problem:
            log.error("dsa-bridge: request %s: %s; computed here instead", request.request_id, problem)
            return None
        return answer

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        answer = self.answer_of(request)
        if answer is None or num_computed_tokens % self.page_size:
            return 0, False
        count = answer.num_tokens - num_computed_tokens
        if count <= 0:
            return 0, False
        self._matched[request.request_id] = (answer, num_computed_tokens)
        return count, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        matched = self._matched.pop(request.request_id, None)
        if matched is None or num_external_tokens <= 0:
            return
        answer, prefix = matched
        block_ids = blocks.get_block_ids()[0]
        first, end = prefix // self.page_size, pages_of(answer.num_tokens, self.page_size)
        if len(block_ids) < end:
            raise ValueError(f"request {request.request_id}: vLLM allocated {len(block_ids)} "
                             f"blocks for a prompt of {end} pages")
        self._meta.loads[request.request_id] = Load(answer, tuple(block_ids[first:end]), prefix)
        self.loading.add(request.request_id)
        request.kv_transfer_params["do_remote_prefill"] = False  # announced once

    def build_connector_meta(self, scheduler_output) -> BridgeMetadata:
        meta, self._meta = self._meta, BridgeMetadata()
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._matched.pop(req_id, None)
        if req_id in self.loading:
            if self._meta.loads.pop(req_id, None) is not None:  # never announced: nothing lands
                self.loading.discard(req_id)
                return False, None
            self._meta.aborts.append(req_id)  # freed once the worker proves no write can land
            return True, None
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode") or request.status not in _FINISHED_NORMALLY:
            return False, None
        num_tokens = len(request.prompt_token_ids or ())
        pages = pages_of(num_tokens, self.page_size)
        if not num_tokens or len(block_ids) < pages:
            log.error("dsa-bridge: request %s: %d blocks for %d prompt tokens; nothing sent",
                      req_id, len(block_ids), num_tokens)
            return False, None
        room = secrets.randbits(63)
        self._meta.sends[req_id] = Send(room, tuple(block_ids[:pages]))
        self.sending.add(req_id)
        answer = PrefillAnswer(room, self.options.host, self.options.port, self.tp_size, num_tokens,
                               self.options.engine)
        return True, answer.to_params()

    def update_connector_output(self, output) -> None:
        self.sending.difference_update(output.finished_sending or ())
        self.loading.difference_update(output.finished_recving or ())

    def has_pending_push_work(self) -> bool:
        return bool(self.sending or self.loading)
