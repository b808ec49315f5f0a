"""One whole in-process vLLM ``LLM`` (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: engine core, scheduler
and worker in this process) with the dsa-bridge connector, a tiny MLA model with dummy weights
(a local ``config.json``: DeepSeek-V3's MLA without the DSA indexer, which runs on CPU) as
prefill or decode, in its own OS process. Run as ``python -m tests.vllm.llm_rank`` from the
repository root; prints one JSON summary on stdout.

- ``prefill``: generates the prompt locally (the reference tokens), then again with
  ``do_remote_decode`` (one token, the KV held), writes the reference and the request's
  ``kv_transfer_params`` to ``--answers`` and steps vLLM's engine until its transfer is done
  (``has_pending_push_work``);
- ``decode``: generates the prompt with those params: vLLM's own calls take its KV from the
  prefill, and the tokens must equal the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["prefill", "decode"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--extra", required=True)
    parser.add_argument("--answers", required=True)
    parser.add_argument("--timeout", type=float, default=150.0)
    args = parser.parse_args()
    deadline = time.monotonic() + args.timeout

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, skip_tokenizer_init=True, load_format="dummy", enforce_eager=True,
              max_model_len=512, gpu_memory_utilization=0.1, kv_cache_memory_bytes=1 << 26, seed=0,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="DSABridgeConnector",
                  kv_connector_module_path="dsa_bridge.plugin.vllm.connector",
                  kv_role="kv_producer" if args.role == "prefill" else "kv_consumer",
                  kv_connector_extra_config=json.loads(args.extra)))
    prompt = TokensPrompt(prompt_token_ids=PROMPT)

    def generate(tokens: int, params: dict | None):
        sampling = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True,
                                  extra_args={"kv_transfer_params": params} if params else None)
        return llm.generate([prompt], sampling, use_tqdm=False)[0]

    worker = get_kv_transfer_group()._worker
    if args.role == "prefill":
        reference = list(generate(TOKENS, None).outputs[0].token_ids)
        params = generate(1, {"do_remote_decode": True}).kv_transfer_params
        tmp = Path(args.answers + ".tmp")
        tmp.write_text(json.dumps({"reference": reference, "params": params}))
        tmp.rename(args.answers)
        core = llm.llm_engine.engine_core.engine_core
        while core.scheduler.has_requests() and time.monotonic() < deadline:
            llm.llm_engine.step()  # vLLM's engine loop keeps stepping while a push is pending
            time.sleep(0.002)
        summary = {"pending": core.scheduler.has_requests(),
                   "sent": worker.prefill.counters.snapshot()["bytes"]}
    else:
        while not Path(args.answers).exists():
            if time.monotonic() >= deadline:
                raise SystemExit(f"no answers in {args.answers}")
            time.sleep(0.05)
        answers = json.loads(Path(args.answers).read_text())
        output = generate(TOKENS, answers["params"])
        node = next(iter(worker.decode_nodes.values()))
        summary = {"tokens": list(output.outputs[0].token_ids), "reference": answers["reference"],
                   "received": node.counters.snapshot()["bytes"],
                   "layers": worker.pool.layout.num_layers, "page_size": worker.pool.layout.page_size}
    print(json.dumps(summary), flush=True)
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
