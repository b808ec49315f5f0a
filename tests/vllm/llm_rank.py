"""One whole vLLM ``LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: engine core and scheduler in this
process; its worker too at ``--tp 1``, or ``--tp N`` workers of vLLM's own multiprocess executor,
each initialising vLLM's parallel state over gloo) with the dsa-bridge connector, a tiny MLA
model with dummy weights (a local ``config.json``: DeepSeek-V3's MLA without the DSA indexer,
which runs on CPU) as prefill or decode, in its own OS process. Run as
``python -m tests.vllm.llm_rank`` from the repository root; prints one JSON summary on stdout.

- ``prefill``: generates the prompt locally (the reference tokens), then again with
  ``do_remote_decode`` (one token, the KV held), writes the reference and the request's
  ``kv_transfer_params`` to ``--answers`` and steps vLLM's engine until its transfer is done
  (``has_pending_push_work``);
- ``decode``: generates the prompt with those params: vLLM's own calls take its KV from the
  prefill, and the tokens must equal the reference.

Each side then asks every worker (vLLM's ``collective_rpc``, ``probe``) for its TP rank as vLLM's
parallel state and the connector have it, the bytes its dsa-bridge node moved, and a checksum of
each layer's prompt rows read from vLLM's own cache tensors at the request's blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

PROMPT = [(i * 37) % 900 + 5 for i in range(100)]  # 7 pages of 16 (the CPU MLA backend's)
TOKENS = 6


def write_model(directory: Path) -> Path:
    from .harness import write_model as write_dsa

    config = json.loads((write_dsa(directory, layers=2) / "config.json").read_text())
    config.update({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"})
    for key in ("index_head_dim", "index_n_heads", "index_topk"):
        del config[key]
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def probe(worker, blocks: list[int], tokens: int) -> dict:
    """Run in each vLLM worker by ``collective_rpc`` (module docstring): ``rows``, per layer, the
    crc32 of KV rows ``[0, tokens)`` at ``blocks`` in vLLM's cache tensor (``model_runner.kv_caches``,
    layer order)."""
    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    bridge = get_kv_transfer_group().bridge
    nodes = [bridge.prefill] if bridge.prefill else list(bridge.decode_nodes.values())
    block_size = worker.vllm_config.cache_config.block_size
    rows, nonzero = [], 0
    for cache in worker.model_runner.kv_caches:
        pages = cache.reshape(cache.shape[0], -1).view(torch.uint8)[blocks]
        prompt = pages.reshape(len(blocks) * block_size, -1)[:tokens].numpy()
        rows.append(zlib.crc32(prompt.tobytes()))
        nonzero += int(prompt.any())
    return {"pid": os.getpid(), "vllm_rank": get_tensor_model_parallel_rank(),
            "rank": bridge.tp_rank, "size": bridge.tp_size, "rows": rows, "nonzero_layers": nonzero,
            "layers": bridge.pool.layout.num_layers, "page_size": bridge.pool.layout.page_size,
            "bytes": sum(node.counters.snapshot()["bytes"] for node in nodes)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["prefill", "decode"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--extra", required=True)
    parser.add_argument("--answers", required=True)
    parser.add_argument("--timeout", type=float, default=150.0)
    parser.add_argument("--tp", type=int, default=1, help="vLLM's tensor_parallel_size")
    args = parser.parse_args()
    deadline = time.monotonic() + args.timeout

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, skip_tokenizer_init=True, load_format="dummy", enforce_eager=True,
              max_model_len=512, gpu_memory_utilization=0.1, kv_cache_memory_bytes=1 << 26, seed=0,
              tensor_parallel_size=args.tp, kv_transfer_config=KVTransferConfig(
                  kv_connector="DSABridgeConnector",
                  kv_connector_module_path="dsa_bridge.plugin.vllm.connector",
                  kv_role="kv_producer" if args.role == "prefill" else "kv_consumer",
                  kv_connector_extra_config=json.loads(args.extra)))
    prompt = TokensPrompt(prompt_token_ids=PROMPT)

    def generate(tokens: int, params: dict | None):
        sampling = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True,
                                  extra_args={"kv_transfer_params": params} if params else None)
        return llm.generate([prompt], sampling, use_tqdm=False)[0]

    core = llm.llm_engine.engine_core.engine_core
    kv_manager = core.scheduler.kv_cache_manager
    tokens = len(PROMPT) - 1  # decode computes the last prompt token itself (vLLM's scheduler)
    if args.role == "prefill":
        reference = list(generate(TOKENS, None).outputs[0].token_ids)
        params = generate(1, {"do_remote_decode": True}).kv_transfer_params
        (held,) = core.scheduler.requests  # finished, its blocks held for the decode
        blocks = kv_manager.get_block_ids(held)[0]
        ranks = llm.collective_rpc(probe, args=(blocks, tokens))
        tmp = Path(args.answers + ".tmp")
        tmp.write_text(json.dumps({"reference": reference, "params": params}))
        tmp.rename(args.answers)
        while core.scheduler.has_requests() and time.monotonic() < deadline:
            llm.llm_engine.step()  # vLLM's engine loop keeps stepping while a push is pending
            time.sleep(0.002)
        after = llm.collective_rpc(probe, args=(blocks, tokens))
        summary = {"pending": core.scheduler.has_requests(),
                   "ranks": [{**rank, "bytes": later["bytes"]}
                             for rank, later in zip(ranks, after, strict=True)]}
    else:
        while not Path(args.answers).exists():
            if time.monotonic() >= deadline:
                raise SystemExit(f"no answers in {args.answers}")
            time.sleep(0.05)
        answers = json.loads(Path(args.answers).read_text())
        sampling = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True,
                                  extra_args={"kv_transfer_params": answers["params"]})
        llm.llm_engine.add_request("decode", prompt, sampling)
        blocks, output = [], None
        while output is None and time.monotonic() < deadline:
            for req_id in core.scheduler.requests:  # the one request, while vLLM holds it
                blocks = kv_manager.get_block_ids(req_id)[0] or blocks
            output = next((out for out in llm.llm_engine.step() if out.finished), None)
        if output is None:
            raise SystemExit(f"decode did not finish within {args.timeout}s")
        summary = {"tokens": list(output.outputs[0].token_ids), "reference": answers["reference"],
                   "ranks": llm.collective_rpc(probe, args=(blocks, tokens))}
    print(json.dumps(summary), flush=True)
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
