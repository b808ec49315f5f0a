"""The connector's worker side: one dsa-bridge node set per vLLM worker over vLLM's caches.

``register_kv_caches`` makes vLLM's MLA and indexer caches a pool (``caches.VllmCaches``),
starts the worker's one transfer engine (``SharedEngine``: the caches registered once) and, on
a prefill, its ``PrefillNode`` listening on ``host:port + TP rank``. A decode worker makes a
``DecodeNode`` per prefill instance the first time a request names it (the handshake pairs
every layer's KV and indexer by global layer id, page sizes and dtypes, or refuses by name).

Each step: ``start_load_kv`` announces the decode blocks of the requests vLLM just allocated
(``KVReceiver.init``; the prefill's idle TP ranks are told they have nothing to send) and aborts
the ones vLLM finished meanwhile; ``wait_for_save`` gives the prefill's finished requests their
senders (``KVSender``: the pages go once the decode announced its blocks); ``get_finished``
reports a request once its blocks may go back to vLLM: a prefill's once its write is proven
(or failed and no longer running), a decode's once written and verified, or failed and fenced
(``failed_recving``: no late write can land; vLLM then fails or recomputes it by its
``kv_load_failure_policy``). Layer by layer there is nothing to do: prefill writes a request
whole after it finished, decode waits between steps, so ``save_kv_layer`` and
``wait_for_layer_load`` return at once.

While a request of this worker is in flight, each ``get_finished`` sleeps ``HANDOFF_S`` first
(``hand_over``). vLLM's engine core steps in a Python loop without pause while a request waits
for its KV (or, on prefill, while push work is pending), holding the GIL but at the interpreter's
forced switch: the nodes' control threads, woken by a message (decode's block announcement
to send, prefill's chunk report to read), would each wait up to that switch interval (5 ms) for
the GIL, at every hop of a transfer. The sleep hands it over once a step instead.
"""

from __future__ import annotations

import logging
import queue
import time

import numpy as np

from ...transfer import auth
from ...transfer.backends import create_backend
from ...transfer.backends.base import BackendError
from ...transfer.backends.shared import SharedEngine
from ...transfer.decode import DecodeNode, KVReceiver
from ...transfer.handshake import HandshakeError
from ...transfer.prefill import KVSender, PrefillNode
from ...transfer.request import TERMINAL, KVPoll
from .caches import VllmCaches
from .metadata import BridgeMetadata
from .options import BridgeOptions, PrefillAnswer, SourceRanks

log = logging.getLogger(__name__)

HANDOFF_S = 0.0002  # a step's sleep, while a transfer is in flight, for the nodes' threads


class BridgeWorker:
    """One vLLM worker's dsa-bridge nodes and requests (module docstring)."""

    def __init__(self, options: BridgeOptions, *, producer: bool, consumer: bool, geometry: dict,
                 tp_rank: int, tp_size: int):
        self.options = options
        self.producer, self.consumer = producer, consumer
        self.geometry = geometry  # page_size, kv_lora_rank, rope_dim, index_head_dim
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.secret = auth.load_secret()  # DSA_BRIDGE_SECRET, the same on prefill and decode
        self.pool: VllmCaches | None = None
        self.engine: SharedEngine | None = None
        self.prefill: PrefillNode | None = None
        self.decode_nodes: dict[tuple[str, int, int], DecodeNode] = {}
        self.senders: dict[str, KVSender] = {}
        self.receivers: dict[str, tuple[DecodeNode, KVReceiver]] = {}
        self.aborted: set[str] = set()  # decode requests vLLM finished while loading
        self.unsent: set[str] = set()  # prefill requests that never reached a node
        self.unloaded: set[str] = set()  # decode requests that never reached a node

    def register_kv_caches(self, kv_caches: dict) -> None:
        self.pool = VllmCaches(kv_caches, **self.geometry)
        self.engine = SharedEngine(create_backend(self.options.engine, host=self.options.host,
                                                   **self.options.backend_options()))
        if self.producer:
            try:
                self.prefill = PrefillNode(
                    self.pool, self.engine.user(), listen=self.options.endpoint(self.tp_rank),
                    name=f"vllm-prefill-tp{self.tp_rank}", secret=self.secret,
                    request_timeout_s=self.options.request_timeout_s,
                    peer_timeout_s=self.options.peer_timeout_s, checksums=self.options.checksums)
            except BaseException:
                self.engine.close()
                raise
        log.info("dsa-bridge: %d layers (%d indexers) of vLLM's caches on %s, engine %s",
                 self.pool.layout.num_layers, len(self.pool.layout.index_layer_ids),
                 self.pool.device, self.options.engine)

    # ---- decode ----------------------------------------------------------------------------

    def _decode_node(self, answer: PrefillAnswer, sources: SourceRanks) -> DecodeNode:
        key = (answer.host, answer.port, answer.tp_size)
        node = self.decode_nodes.get(key)
        if node is None:
            endpoints = [answer.endpoint(r) for r in (sources.source, *sources.idle)]
            node = DecodeNode(self.pool, self.engine.user(), endpoints,
                              name=f"vllm-decode-tp{self.tp_rank}", secret=self.secret,
                              handshake_timeout_s=self.options.handshake_timeout_s,
                              request_timeout_s=self.options.request_timeout_s,
                              peer_timeout_s=self.options.peer_timeout_s,
                              checksums=self.options.checksums)
            self.decode_nodes[key] = node
        return node

    def start_load_kv(self, meta: BridgeMetadata) -> None:
        for req_id, load in meta.loads.items():
            answer = load.answer
            try:
                sources = SourceRanks.of(self.tp_rank, self.tp_size, answer.tp_size)
                node = self._decode_node(answer, sources)
                receiver = node.receiver(answer.room, answer.endpoint(sources.source))
            except (ValueError, HandshakeError, BackendError, OSError) as exc:
                log.error("dsa-bridge: request %s: %s", req_id, exc)
                self.unloaded.add(req_id)
                continue
            self.receivers[req_id] = (node, receiver)
            try:
                receiver.init(np.asarray(load.block_ids, dtype=np.int64), answer.num_tokens,
                              prefix_tokens=load.prefix_tokens, copies=sources.copies)
            except ValueError as exc:
                log.error("dsa-bridge: request %s: %s", req_id, exc)
                receiver.abort(str(exc))
                continue
            if sources.idle:
                node.nothing_to_send(answer.room, [answer.endpoint(r) for r in sources.idle],
                                     prefix_tokens=load.prefix_tokens)
        for req_id in meta.aborts:
            self.aborted.add(req_id)
            entry = self.receivers.get(req_id)
            if entry is not None:
                entry[1].abort("aborted by vLLM")

    # ---- prefill ---------------------------------------------------------------------------

    def wait_for_save(self, meta: BridgeMetadata) -> None:
        """Senders for the requests vLLM finished. A room a decode announced before its sender
        exists waits in the node for it (offered on ``incoming``, which vLLM has no use for:
        dropped here, so that it stays bounded)."""
        while self.prefill is not None:
            try:
                self.prefill.incoming.get_nowait()
            except queue.Empty:
                break
        for req_id, send in meta.sends.items():
            if self.prefill is None:
                log.error("dsa-bridge: request %s: this worker runs no prefill node (kv_role)", req_id)
                self.unsent.add(req_id)
                continue
            sender = self.prefill.sender(send.room)
            self.senders[req_id] = sender
            try:
                sender.init(len(send.block_ids))
                sender.send(np.asarray(send.block_ids, dtype=np.int64))
            except ValueError as exc:
                log.error("dsa-bridge: request %s: %s", req_id, exc)
                sender.abort(str(exc))

    # ---- both ------------------------------------------------------------------------------

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving): the requests whose blocks
        may go back to vLLM now, each reported once."""
        self.hand_over()
        sending, recving, failed = set(), set(), set()
        for req_id, sender in list(self.senders.items()):
            if sender.poll() in TERMINAL and sender.can_release():
                if sender.poll() == KVPoll.Failed:
                    log.warning("dsa-bridge: request %s: %s", req_id, sender.failure_exception())
                sending.add(req_id)
                del self.senders[req_id]
        for req_id, (node, receiver) in list(self.receivers.items()):
            if receiver.poll() in TERMINAL and receiver.can_release():
                recving.add(req_id)
                if receiver.poll() == KVPoll.Failed and req_id not in self.aborted:
                    log.warning("dsa-bridge: request %s: %s", req_id, receiver.failure_exception())
                    failed.add(req_id)
                node.forget(receiver)
                del self.receivers[req_id]
                self.aborted.discard(req_id)
        sending |= self.unsent
        recving |= self.unloaded
        failed |= self.unloaded - self.aborted
        self.aborted -= self.unloaded
        self.unsent, self.unloaded = set(), set()
        return sending, recving, failed

    def hand_over(self) -> None:
        """Sleep ``HANDOFF_S`` where a transfer of this worker is in flight, so that its nodes'
        threads take the GIL now rather than at the interpreter's forced switch (module
        docstring)."""
        if self.senders or self.receivers:
            time.sleep(HANDOFF_S)

    def close(self) -> None:
        for node in [*self.decode_nodes.values(), *([self.prefill] if self.prefill else [])]:
            node.close()
        if self.engine is not None:
            self.engine.close()
