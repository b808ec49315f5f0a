"""One vLLM instance of ``dsa-bridge bench``'s ``vllm`` section, prefill or decode, in its own
process: ``python -m dsa_bridge.transfer.bench.vllm_rank --control ENDPOINT --role ROLE``.

Run only where vllm is installed. What vLLM's engine core builds, on the CPU: a ``VllmConfig``
from a local ``config.json`` (a tiny DeepSeek-V3.2 of ``layers`` layers: the caches are
DeepSeek-V3.2's, ``fp8_ds_mla`` MLA 656 bytes and the ``DeepseekV32IndexerCache`` 132 bytes per
token and layer, blocks of 64), the caches (``get_kv_cache_configs``, ``allocate_kv_cache``),
the connector for both roles (dsa-bridge's, or vLLM's own NixlConnector) through vLLM's
``KVConnectorFactory`` and vLLM's real ``Scheduler``; each step runs the connector's worker calls through
``KVConnectorModelRunnerMixin`` around a stand-in forward (a DSA forward does not run on CPU).
The bench process drives it over a ZMQ PAIR socket; each command gets one answer:

- ``setup``: the instance: ``model_dir`` (its ``config.json``, the same for every instance),
  ``blocks``, dsa-bridge's ``engine`` and prefill's ``port``; ``connector`` ``dsa-bridge``
  (dsa-bridge's connector) or ``nixl`` (vLLM's own NixlConnector, which needs
  ``vllm_nixl_on_cpu`` first and ``ports`` for its side channel and parallel state);
- ``prefill`` (prefill): the requests (id, tokens) with ``do_remote_decode``, each one's pages
  filled by the forward with the launcher's pattern of its number (every layer, both caches),
  stepped until all finished and once more (their senders made); answers their
  ``kv_transfer_params``; ``route`` is the prefill node's for them (``direct``, ``staged``, ``auto``);
- ``drain`` (prefill): stepped until every held block is back in vLLM's pool; the node's bytes
  and descriptors written since the last ``drain``;
- ``order``: vLLM's free block list reordered: ``sorted`` (a request's blocks one run) or
  ``stride2`` (every other block first, so that no two blocks of a request are adjacent: one
  block per run);
- ``load`` (decode): the answered requests added (``max_tokens`` 1), stepped until vLLM saw the
  last one's load finished (``finished_recving``): the timed window, from the first step to
  that one; then every page of every request compared with the pattern; answers the seconds,
  the bytes compared, the pages that differ, each request's blocks, and the process's CPU
  seconds in the window;
- ``peer`` (decode) / ``raw`` (prefill): the raw engine baseline. Decode gives its node's engine
  metadata and buffers; prefill pairs them as its node does (``handshake.pair_with_peer``), plans
  the given (prefill blocks, decode blocks) of each request with ``plan_writes`` and times one
  ``write`` of all of it on the node's own engine, as the core bench's raw baseline;
- ``quit``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import torch

from ...plugin.descriptors import BufferDescriptor
from ...plugin.vllm.caches import layer_of
from ..handshake import pair_with_peer, transfer_set
from ..launcher.page_pattern import expected_pages
from ..plan import plan_writes
from .channel import serve_commands

PAGE = 64
STEP_TIMEOUT_S = 120.0
WRITE_TIMEOUT_S = 120.0
# DeepSeek-V3.2's cache geometry (kv_lora_rank 512, rope 64, indexer head 128) on a model
# small enough that vLLM builds its config in seconds (no weights are ever loaded)
MODEL = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "hidden_size": 256,
    "num_attention_heads": 4, "num_key_value_heads": 4, "first_k_dense_replace": 1,
    "q_lora_rank": 64, "kv_lora_rank": 512, "qk_nope_head_dim": 32, "qk_rope_head_dim": 64,
    "v_head_dim": 32, "index_head_dim": 128, "index_n_heads": 4, "index_topk": 64,
    "vocab_size": 1024, "intermediate_size": 512, "moe_intermediate_size": 64,
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "max_position_embeddings": 16384, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6,
    "rope_theta": 10000, "tie_word_embeddings": False, "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 1.0, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "norm_topk_prob": True, "hidden_act": "silu"}


def max_model_len(blocks: int) -> int:
    """The longest request a cache of ``blocks`` blocks holds (one block kept free), within
    what the model's positions allow (vLLM refuses a config above them)."""
    return min((blocks - 1) * PAGE, MODEL["max_position_embeddings"])


def cpu_seconds() -> float:
    return time.process_time()  # every thread of the process: the engine's too


def dsa_specs(layers: int) -> dict:
    """The specs vLLM's DeepSeek-V3.2 layers report (``MLAAttention`` with ``fp8_ds_mla``, the
    ``DeepseekV32IndexerCache``), named as the model registers them."""
    from vllm.model_executor.layers.attention.mla_attention import get_kv_quant_mode
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole

    specs = {}
    for layer in range(layers):
        specs[f"model.layers.{layer}.self_attn.attn"] = MLAAttentionSpec(
            block_size=PAGE, num_kv_heads=1, max_tp_shards=1, head_size=576, dtype=torch.uint8,
            cache_dtype_str="fp8_ds_mla", kv_quant_mode=get_kv_quant_mode("fp8_ds_mla"),
            state_content_bytes=656, is_index_group_leader=True)
        specs[f"model.layers.{layer}.self_attn.indexer.k_cache"] = MLAAttentionSpec(
            block_size=PAGE, num_kv_heads=1, max_tp_shards=1, head_size=132, dtype=torch.uint8,
            cache_role=SparseCacheRole.INDEXER)
    return specs


def vllm_nixl_on_cpu(side_channel_port: int) -> None:
    """What vLLM's own NixlConnector needs to run on this CPU build, before vllm is imported:
    ``nixl`` is the installed ``nixl_cu12``; the CPU MLA backend claims DSA's kernel block of
    64 tokens (it claims 16, and NixlConnector would cut each 64-token block into four pages
    the cache's regions are no multiple of; no attention kernel runs here); the side channel
    on its own port."""
    import importlib

    import nixl_cu12

    sys.modules.setdefault("nixl", nixl_cu12)
    for sub in ("_api", "_bindings"):
        sys.modules.setdefault(f"nixl.{sub}", importlib.import_module(f"nixl_cu12.{sub}"))
    os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    CPUMLABackend.get_supported_kernel_block_sizes = staticmethod(lambda spec=None: [PAGE])
    CPUMLABackend.supports_block_size = classmethod(lambda cls, size: size in (None, PAGE))


def parallel_state(config, port: int) -> None:
    """vLLM's parallel state of one rank (NixlConnector reads its TP rank and group)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    with set_current_vllm_config(config):
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                        distributed_init_method=f"tcp://127.0.0.1:{port}")
        ps.initialize_model_parallel(1, 1)


def engine_step(scheduler, config, forward=None) -> tuple[list, set]:
    """One step of vLLM's engine core on ``scheduler``, the worker's connector calls
    (``KVConnectorModelRunnerMixin``) around ``forward(scheduler_output)``, a token sampled for
    each request whose prompt is computed: the requests that finished, and those whose load
    vLLM saw finish (``finished_recving``)."""
    from vllm.forward_context import set_forward_context
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    out = scheduler.schedule()
    with set_forward_context(None, config), \
            KVConnectorModelRunnerMixin._get_kv_connector_output(out) as kv_output:
        if forward is not None:
            forward(out)
    req_ids = list(out.num_scheduled_tokens)
    sampled = [[7] if scheduler.requests[r].num_computed_tokens
               >= scheduler.requests[r].num_prompt_tokens else [] for r in req_ids]
    runner = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                               sampled_token_ids=sampled, kv_connector_output=kv_output)
    finished = [o for outputs in scheduler.update_from_output(out, runner).values()
                for o in outputs.outputs if o.finish_reason is not None]
    return finished, set(kv_output.finished_recving or ()) if kv_output else set()


class Instance:
    """One vLLM instance's scheduler and worker side, the connector in both (module docstring)."""

    def __init__(self, role: str, model_dir: str, blocks: int, extra: dict,
                 connector: str = "dsa-bridge", ports: tuple[int, int] = (0, 0)) -> None:
        if connector == "nixl":
            vllm_nixl_on_cpu(ports[0])
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.engine.arg_utils import EngineArgs
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

        layers = json.loads(Path(model_dir, "config.json").read_text())["num_hidden_layers"]
        args = EngineArgs(model=model_dir, skip_tokenizer_init=True, load_format="dummy",
                          kv_cache_dtype="fp8_ds_mla", max_model_len=max_model_len(blocks),
                          enforce_eager=True, enable_prefix_caching=False,
                          kv_transfer_config=KVTransferConfig(
                              kv_connector="DSABridgeConnector",
                              kv_connector_module_path="dsa_bridge.plugin.vllm.connector",
                              kv_role=role, kv_connector_extra_config=extra)
                          if connector == "dsa-bridge" else KVTransferConfig(
                              kv_connector="NixlConnector", kv_role=role, kv_buffer_device="cpu",
                              kv_connector_extra_config={"backends": ["UCX"]}))
        self.config = args.create_engine_config()
        if connector == "nixl":
            parallel_state(self.config, ports[1])
        self.config.cache_config.block_size = PAGE  # the CPU MLA backend forces 16; DSA's are 64
        specs = dsa_specs(layers)
        supported = [layout.name for layout in get_supported_kv_cache_layouts(
            [FlashMLASparseBackend, DeepseekV32IndexerBackend])]
        layout = resolve_kv_cache_layout(self.config, [supported], list(specs.values()))
        per_block = sum(spec.page_size_bytes for spec in specs.values())
        self.kv_cache_config = get_kv_cache_configs(self.config, [specs], [blocks * per_block])[0]
        self.config.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks
        self.caches = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), layout)
        self.views = {name: (*layer_of(name), t.view(t.shape[0], -1))  # (blocks, block bytes)
                      for name, t in self.caches.items()}
        self.connector = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER,
                                                             self.kv_cache_config)
        kv_transfer_state._KV_CONNECTOR_AGENT = self.connector  # vLLM's transfer group
        self.connector.register_kv_caches(self.caches)
        self.bridge = getattr(self.connector, "bridge", None)  # None: vLLM's own connector
        self.scheduler = Scheduler(self.config, generate_scheduler_kv_cache_config([self.kv_cache_config]),
                                   StructuredOutputManager(self.config), block_size=PAGE)
        handshake = self.connector.get_handshake_metadata()  # the engine core passes it on
        if handshake is not None:
            self.scheduler.get_kv_connector().set_xfer_handshake_metadata_pp_aware({(0, 0): handshake})

    @property
    def pool(self):
        return self.scheduler.kv_cache_manager.block_pool

    def block_ids(self, req_id: str) -> list[int]:
        return self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]

    def add(self, req_id: str, tokens: int, params: dict) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        prompt = [(sum(map(ord, req_id)) + i) % 1000 + 1 for i in range(tokens)]
        sampling = SamplingParams(max_tokens=1, ignore_eos=True,
                                  extra_args={"kv_transfer_params": params})
        self.scheduler.add_request(Request(req_id, prompt, sampling, None))

    def step(self, forward=None) -> tuple[list, set]:
        return engine_step(self.scheduler, self.config, forward)

    def pattern(self, number: int, blocks: list[int], check: bool = False) -> int:
        """Fill (or, ``check``: compare) the request ``number``'s ``blocks`` with the launcher's
        pattern, every layer and both caches; pages that differ."""
        index = torch.as_tensor(blocks, dtype=torch.int64)
        order = np.arange(len(blocks))
        differ = 0
        for layer, kind, view in self.views.values():
            want = expected_pages(number, layer, kind, order, view.shape[1])
            if check:
                differ += int((view.index_select(0, index) != want).any(dim=1).sum())
            else:
                view.index_copy_(0, index, want)
        return differ

    def close(self) -> None:
        self.connector.shutdown()


def wait_steps(instance: Instance, done, what: str, forward=None) -> list:
    """Step until ``done()``; the finished outputs seen. Bounded by STEP_TIMEOUT_S."""
    deadline, finished = time.monotonic() + STEP_TIMEOUT_S, []
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not done in {STEP_TIMEOUT_S:.0f} s")
        finished += instance.step(forward)[0]
        time.sleep(0.0005)  # the other rank's process shares the cores
    return finished


class Rank:
    """The commands (module docstring)."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.instance: Instance | None = None
        self.pairs, self.peer = [], ""
        self.written = (0, 0)  # the prefill node's bytes and descriptors at the last drain

    def setup(self, model_dir: str, blocks: int, engine: str, port: int = 0,
              connector: str = "dsa-bridge", ports: tuple = (0, 0)) -> dict:
        extra = {"engine": engine, "request_timeout_s": WRITE_TIMEOUT_S}
        if self.role == "prefill":
            extra["port"] = port
        self.instance = Instance("kv_producer" if self.role == "prefill" else "kv_consumer",
                                 model_dir, blocks, extra, connector, tuple(ports))
        return {"blocks": self.instance.kv_cache_config.num_blocks}

    def prefill(self, requests: list, route: str) -> dict:
        instance = self.instance
        if instance.bridge is not None:
            instance.bridge.prefill.route = route
        numbers = {req_id: number for req_id, _, number in requests}
        for req_id, tokens, _ in requests:
            instance.add(req_id, tokens, {"do_remote_decode": True})

        def forward(out) -> None:
            for req_id in out.num_scheduled_tokens:
                instance.pattern(numbers[req_id], instance.block_ids(req_id))

        answers, blocks = {}, {}
        deadline = time.monotonic() + STEP_TIMEOUT_S
        while len(answers) < len(requests):
            if time.monotonic() > deadline:
                raise RuntimeError(f"prefill: {len(answers)} of {len(requests)} requests finished")
            for output in instance.step(forward)[0]:
                answers[output.request_id] = output.kv_transfer_params
                blocks[output.request_id] = instance.block_ids(output.request_id)
        instance.step()  # the worker makes their senders (wait_for_save)
        return {"answers": answers, "blocks": blocks}

    def drain(self) -> dict:
        instance = self.instance
        wait_steps(instance, lambda: not instance.scheduler.has_requests(), "prefill's held blocks")
        if instance.bridge is None:  # vLLM's own connector: no dsa-bridge counters
            return {"bytes": None, "descriptors": None, "free": instance.pool.get_num_free_blocks()}
        counters = instance.bridge.prefill.counters.snapshot()
        now = (counters["bytes"], counters["descriptors"])
        written, self.written = [a - b for a, b in zip(now, self.written, strict=True)], now
        return {"bytes": written[0], "descriptors": written[1], "free": instance.pool.get_num_free_blocks()}

    def order(self, kind: str) -> dict:
        pool = self.instance.pool
        taken = pool.get_new_blocks(pool.get_num_free_blocks())
        taken.sort(key=lambda b: b.block_id)
        if kind == "stride2":
            taken = taken[::2] + taken[1::2]
        elif kind != "sorted":
            raise ValueError(f"order must be sorted or stride2, got {kind!r}")
        pool.free_blocks(taken)
        return {}

    def load(self, answers: dict, numbers: dict) -> dict:
        instance = self.instance
        for req_id, params in answers.items():
            instance.add(req_id, params["remote_num_tokens"], params)
        loaded: set[str] = set()
        blocks: dict[str, list[int]] = {}
        cpu, start = cpu_seconds(), time.monotonic()
        end = start
        deadline = start + STEP_TIMEOUT_S
        def note_blocks() -> None:  # allocated by a step, freed once a request finished
            for req_id in answers:
                if req_id not in blocks and req_id in instance.scheduler.requests:
                    blocks[req_id] = instance.block_ids(req_id) or None
            for req_id in [r for r, ids in blocks.items() if ids is None]:
                del blocks[req_id]

        while len(loaded) < len(answers):
            if time.monotonic() > deadline:
                raise RuntimeError(f"decode: {len(loaded)} of {len(answers)} loads finished")
            note_blocks()
            finished, recving = instance.step()
            note_blocks()
            if recving:
                loaded |= recving
                end = time.monotonic()
            failed = [o for o in finished if str(o.finish_reason) not in ("length", "stop")]
            if failed:
                raise RuntimeError(f"decode: request {failed[0].request_id} ended "
                                   f"{failed[0].finish_reason}")
        cpu = cpu_seconds() - cpu
        wait_steps(instance, lambda: not instance.scheduler.has_requests(), "decode's requests")
        pages = {r: blocks[r][:-(-answers[r]["remote_num_tokens"] // PAGE)] for r in answers}
        differ = {r: instance.pattern(numbers[r], pages[r], check=True) for r in answers}
        nbytes = sum(len(p) for p in pages.values()) * sum(v.shape[1] for _, _, v in instance.views.values())
        return {"seconds": end - start, "cpu_s": cpu, "nbytes": nbytes, "differ": differ,
                "blocks": pages}

    def peer_info(self) -> dict:
        node = next(iter(self.instance.bridge.decode_nodes.values()))
        return {"metadata": node.backend.metadata(),
                "buffers": [list(msgspec.structs.astuple(b)) for b in node.buffers]}

    def raw(self, metadata: bytes, buffers: list, requests: list) -> dict:
        node = self.instance.bridge.prefill
        if not self.pairs:
            layout = node.layout
            self.pairs = pair_with_peer(layout, node.buffers, [BufferDescriptor(*b) for b in buffers],
                                        transfer_set(layout, layout, layout.index_layer_ids))
            self.peer = node.backend.connect(metadata)
        plans = [plan_writes(self.pairs, np.asarray(s, dtype=np.int64), np.asarray(d, dtype=np.int64))
                 for s, d in requests]
        src, dst, length = (np.concatenate([getattr(p, key) for p in plans])
                            for key in ("src", "dst", "length"))
        start = time.perf_counter()
        node.backend.write(self.peer, src, dst, length, timeout_s=WRITE_TIMEOUT_S)
        return {"seconds": time.perf_counter() - start, "descriptors": int(length.size),
                "nbytes": int(length.sum())}

    def close(self) -> None:
        if self.instance is not None:
            self.instance.close()


def serve(control: str, role: str) -> int:
    rank = Rank(role)
    try:
        return serve_commands(control, {
            "setup": rank.setup, "prefill": rank.prefill, "drain": rank.drain, "order": rank.order,
            "load": rank.load, "peer": rank.peer_info, "raw": rank.raw}, idle_exit_s=900.0)
    finally:
        rank.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="a vLLM instance of dsa-bridge bench")
    parser.add_argument("--control", required=True)
    parser.add_argument("--role", required=True, choices=("prefill", "decode"))
    args = parser.parse_args(argv)
    code = serve(args.control, args.role)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # not through the engines' library finalizers (UCX's can crash at exit)


if __name__ == "__main__":
    sys.exit(main())
