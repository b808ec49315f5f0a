"""vLLM's real scheduler and worker lifecycle around the connector, without a model forward
(a DSA forward is refused on CPU): ``MiniEngine``.

It builds what vLLM's engine core builds: a ``VllmConfig`` from a local ``config.json`` (a tiny
DeepSeek-V3.2: ``write_model``), the KV cache specs vLLM's DSA layers report (``dsa_specs``:
``fp8_ds_mla`` MLA and the ``DeepseekV32IndexerCache``), the layout and ``KVCacheConfig``
(``resolve_kv_cache_layout``, ``get_kv_cache_configs``, the scheduler's
``generate_scheduler_kv_cache_config``), the caches (``allocate_kv_cache``), the
worker's connector (``KVConnectorFactory``, published as vLLM's transfer group) and the
``Scheduler``, whose own connector is the scheduler side. ``step`` runs one engine step: the
scheduler's output goes through ``KVConnectorModelRunnerMixin``'s connector lifecycle
(``start_load_kv``, ``wait_for_save``, ``get_transfer_results``) around the test's ``forward``
(which fills or checks the scheduled requests' pages) and back into the scheduler
(``transfer/bench/vllm_rank.py``'s ``engine_step``, which the bench's ``vllm`` section runs too).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import torch

PAGE = 64
MLA_ROW = 656  # fp8_ds_mla
INDEX_ROW = 132  # 128 fp8 values + one fp32 scale


def write_model(directory: Path, layers: int = 4) -> Path:
    config = {
        "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "hidden_size": 256,
        "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": layers,
        "first_k_dense_replace": 1, "q_lora_rank": 64, "kv_lora_rank": 512, "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 64, "v_head_dim": 32, "index_head_dim": 128, "index_n_heads": 4,
        "index_topk": 64, "vocab_size": 1024, "intermediate_size": 512, "moe_intermediate_size": 64,
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "max_position_embeddings": 4096, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6,
        "rope_theta": 10000, "tie_word_embeddings": False, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 1.0, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "norm_topk_prob": True, "hidden_act": "silu"}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def vllm_config(model: Path, role: str, extra: dict):
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(model), skip_tokenizer_init=True, load_format="dummy",
                      kv_cache_dtype="fp8_ds_mla", max_model_len=4096, enforce_eager=True,
                      enable_prefix_caching=False,
                      kv_transfer_config=KVTransferConfig(
                          kv_connector="DSABridgeConnector",
                          kv_connector_module_path="dsa_bridge.plugin.vllm.connector",
                          kv_role=role, kv_connector_extra_config=extra))
    config = args.create_engine_config()
    config.cache_config.block_size = PAGE  # the CPU MLA backend forces 16; DSA pages are 64
    return config


def dsa_specs(layers: int, *, mla_row: int = MLA_ROW, index: bool = True) -> dict:
    """The specs vLLM's DeepSeek-V3.2 layers report: ``MLAAttention`` with ``fp8_ds_mla`` and
    ``DeepseekV32IndexerCache`` (names as the model registers them)."""
    from vllm.model_executor.layers.attention.mla_attention import get_kv_quant_mode
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole

    specs = {}
    for layer in range(layers):
        specs[f"model.layers.{layer}.self_attn.attn"] = MLAAttentionSpec(
            block_size=PAGE, num_kv_heads=1, max_tp_shards=1, head_size=576, dtype=torch.uint8,
            cache_dtype_str="fp8_ds_mla", kv_quant_mode=get_kv_quant_mode("fp8_ds_mla"),
            state_content_bytes=mla_row, is_index_group_leader=index)
        if index:
            specs[f"model.layers.{layer}.self_attn.indexer.k_cache"] = MLAAttentionSpec(
                block_size=PAGE, num_kv_heads=1, max_tp_shards=1, head_size=INDEX_ROW,
                dtype=torch.uint8, cache_role=SparseCacheRole.INDEXER)
    return specs


def pattern(req_id: str, name: str, position: int, nbytes: int) -> np.ndarray:
    """The bytes prefill's forward writes into page ``position`` of request ``req_id`` in cache
    ``name`` (decode recomputes them to check)."""
    seed = [zlib.crc32(req_id.encode()), zlib.crc32(name.encode()), position]
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


class MiniEngine:
    """One vLLM instance's scheduler and worker, in this process (module docstring)."""

    def __init__(self, model: Path, role: str, extra: dict, *, blocks: int = 96,
                 specs: dict | None = None):
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend
        from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
        from vllm.v1.attention.backends.utils import (
            get_supported_kv_cache_layouts,
            resolve_kv_cache_layout,
        )
        from vllm.v1.core.kv_cache_utils import (
            generate_scheduler_kv_cache_config,
            get_kv_cache_configs,
        )
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        self.config = vllm_config(model, role, extra)
        layers = self.config.model_config.hf_text_config.num_hidden_layers
        specs = specs if specs is not None else dsa_specs(layers)
        supported = [layout.name for layout in get_supported_kv_cache_layouts(
            [FlashMLASparseBackend, DeepseekV32IndexerBackend])]
        layout = resolve_kv_cache_layout(self.config, [supported], list(specs.values()))
        per_block = sum(spec.page_size_bytes for spec in specs.values())
        self.kv_cache_config = get_kv_cache_configs(self.config, [specs], [blocks * per_block])[0]
        self.config.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks  # as the engine core
        self.caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), layout)
        self.worker = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER,
                                                          self.kv_cache_config)
        kv_transfer_state._KV_CONNECTOR_AGENT = self.worker  # vLLM's transfer group, as a worker's
        self.worker.register_kv_caches(self.caches)
        self.scheduler = Scheduler(self.config, generate_scheduler_kv_cache_config([self.kv_cache_config]),
                                   StructuredOutputManager(self.config), block_size=PAGE)

    @property
    def free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def block_ids(self, req_id: str) -> list[int]:
        return self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]

    def add(self, req_id: str, prompt: list[int], max_tokens: int, params: dict | None) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                  extra_args={"kv_transfer_params": params} if params else None)
        self.scheduler.add_request(Request(req_id, prompt, sampling, None))

    def fragment(self) -> None:
        """Shuffle the block pool's free list, so that a request's blocks are scattered."""
        pool = self.scheduler.kv_cache_manager.block_pool
        taken = pool.get_new_blocks(pool.get_num_free_blocks())
        order = np.random.default_rng(7).permutation(len(taken))
        pool.free_blocks([taken[i] for i in order])

    def step(self, forward=None) -> list:
        """One engine step; ``forward(scheduler_output)`` runs inside the worker's connector
        lifecycle (the bench's ``engine_step``). Returns the finished requests' outputs."""
        from dsa_bridge.transfer.bench.vllm_rank import engine_step

        return engine_step(self.scheduler, self.config, forward)[0]

    def close(self) -> None:
        self.worker.shutdown()
