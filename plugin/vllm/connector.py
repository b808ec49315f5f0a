"""The class vLLM loads for both roles: ``DSABridgeConnector``, a ``KVConnectorBase_V1``.

``--kv-transfer-config '{"kv_connector": "DSABridgeConnector", "kv_connector_module_path":
"dsa_bridge.plugin.vllm.connector", "kv_role": "kv_producer", "kv_connector_extra_config":
{"engine": "mooncake", "port": 7100}}'`` (docs/vllm.md). In vLLM's scheduler process it holds
the scheduler side (``scheduler.BridgeScheduler``), in each worker the worker side
(``worker.BridgeWorker``); every call goes to the one its role holds.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from .metadata import BridgeMetadata
from .options import BridgeOptions, tp_position
from .scheduler import BridgeScheduler
from .worker import BridgeWorker


def _parallel_state() -> tuple[int, int] | None:
    """This worker's (TP rank, TP world size) in vLLM's parallel state, which vLLM's executor
    initialises in each of its workers; None where it was not (a worker built outside one)."""
    from vllm.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
        model_parallel_is_initialized,
    )

    if not model_parallel_is_initialized():
        return None
    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


class DSABridgeConnector(KVConnectorBase_V1):
    """dsa-bridge's prefill→decode transfer of DSA caches (MLA + indexer, every layer)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        config = vllm_config.kv_transfer_config
        self.options = BridgeOptions.parse(config.kv_connector_extra_config,
                                           producer=config.is_kv_producer)
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        if len(groups) != 1:
            raise ValueError(f"dsa-bridge serves one KV cache group (MLA and indexer sharing a "
                             f"block table), vLLM made {len(groups)}")
        page_size = groups[0].kv_cache_spec.block_size
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._scheduler: BridgeScheduler | None = None
        self._worker: BridgeWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = BridgeScheduler(self.options, page_size=page_size, tp_size=tp_size)
            return
        hf = vllm_config.model_config.hf_text_config
        geometry = {"page_size": page_size, "kv_lora_rank": getattr(hf, "kv_lora_rank", 0),
                    "rope_dim": getattr(hf, "qk_rope_head_dim", 0),
                    "index_head_dim": getattr(hf, "index_head_dim", None)}
        if not geometry["kv_lora_rank"] or not geometry["rope_dim"]:
            raise ValueError(f"model {vllm_config.model_config.model!r} has no MLA cache "
                             "(kv_lora_rank, qk_rope_head_dim): dsa-bridge moves MLA/DSA caches")
        tp_rank, tp_size = tp_position(_parallel_state(), tp_size)
        self._worker = BridgeWorker(self.options, producer=config.is_kv_producer,
                                    consumer=config.is_kv_consumer, geometry=geometry,
                                    tp_rank=tp_rank, tp_size=tp_size)

    @property
    def bridge(self) -> BridgeWorker | None:
        """The worker side's dsa-bridge nodes (None on the scheduler side): what a bench or a
        test reads the nodes' counters and buffers from."""
        return self._worker

    # ---- scheduler side --------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> BridgeMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output) -> None:
        self._scheduler.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        return self._scheduler.has_pending_push_work()

    # ---- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict) -> None:
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self._worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return

    def wait_for_save(self) -> None:
        self._worker.wait_for_save(self._get_connector_metadata())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._worker.transfer_results()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self._worker.transfer_results()
        return sending or None, recving or None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
