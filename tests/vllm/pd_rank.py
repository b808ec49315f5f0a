"""One vLLM instance, prefill or decode, as its own OS process: vLLM's scheduler and worker
lifecycle around the dsa-bridge connector (``harness.MiniEngine``), the forward played by the
test (prefill fills each request's pages of every layer's MLA and indexer cache with a pattern;
decode checks them once its load finished). Run as ``python -m tests.vllm.pd_rank`` from the
repository root; prints one JSON summary on stdout.

- ``prefill``: runs ``--requests`` (id and prompt length each) with ``do_remote_decode``, writes
  their ``kv_transfer_params`` to ``--answers`` once all finished, then keeps stepping (its
  blocks held until written) until ``--stop`` exists;
- ``decode``: runs the answered requests with those params and checks every page; ``--abort``
  aborts one while it loads (``--abort-after`` s after its first step), and counts its free
  blocks ``HELD_AFTER_S`` later;
  ``--fragment`` scatters its free blocks first; ``--launcher``: the answers name a ``dsa-bridge
  prefill`` launcher node, whose pattern the pages are checked against (on a prefill: the decode
  is a ``dsa-bridge decode`` launcher node, so a finished request's held pages are refilled with
  that pattern for its room before its worker sends them, the step after); ``--tp R/S``: the
  worker is TP rank R of S (each rank of a TP group has its own scheduler here: decode ranks are
  fed the same answers, prefill ranks draw the same rooms, ``--room-seed``).
Engine writes go through ``tests/faulty.py`` when a ``DSA_BRIDGE_FAULT_*`` variable is set.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import types
from pathlib import Path

import numpy as np

from dsa_bridge.plugin.vllm import connector as bridge_connector
from dsa_bridge.plugin.vllm import scheduler as bridge_scheduler
from dsa_bridge.plugin.vllm import worker as bridge_worker
from dsa_bridge.plugin.vllm.caches import layer_of
from dsa_bridge.transfer.launcher.page_pattern import expected_pages

from ..faulty import wrap_from_env
from . import harness
from .harness import MiniEngine, pattern

_create_backend = bridge_worker.create_backend
HELD_AFTER_S = 0.3  # after an abort, when decode's free blocks are counted (its write still runs)


def _faulty_backend(name: str, **options):
    return wrap_from_env(_create_backend(name, **options))


def prompt_of(req_id: str, length: int) -> list[int]:
    start = sum(map(ord, req_id))
    return [(start + i) % 1000 + 1 for i in range(length)]


def page_bytes(engine: MiniEngine, req_id: str, pages: int):
    """(cache name, page position, the page's bytes) of every cache and page of the request."""
    blocks = engine.block_ids(req_id)[:pages]
    for name, tensor in engine.caches.items():
        view = tensor.reshape(tensor.shape[0], -1)  # (blocks, block bytes), vLLM's memory
        for position, block in enumerate(blocks):
            yield name, position, view[block].numpy()


def run_prefill(args, engine: MiniEngine) -> dict:
    requests = json.loads(args.requests)
    free_before = engine.free_blocks
    for req_id, length in requests:
        engine.add(req_id, prompt_of(req_id, length), 1, {"do_remote_decode": True})

    def forward(out) -> None:
        for req_id in out.num_scheduled_tokens:
            length = engine.scheduler.requests[req_id].num_prompt_tokens
            for name, position, page in page_bytes(engine, req_id, -(-length // 64)):
                page[:] = pattern(req_id, name, position, page.size)

    answers, deadline = {}, time.monotonic() + args.timeout
    while len(answers) < len(requests) and time.monotonic() < deadline:
        for output in engine.step(forward):
            params, length = output.kv_transfer_params, dict(requests)[output.request_id]
            answers[output.request_id] = {"params": params, "length": length}
            if args.launcher:  # the room is known now; the worker sends in the next step
                for name, position, page in page_bytes(engine, output.request_id, -(-length // 64)):
                    page[:] = launcher_pattern(params["remote_room"], name, position, page.size)
    held = engine.free_blocks
    tmp = Path(args.answers + ".tmp")
    tmp.write_text(json.dumps(answers))
    tmp.rename(args.answers)
    while not Path(args.stop).exists() and time.monotonic() < deadline:
        engine.step()
        time.sleep(0.002)
    return {"answered": len(answers), "free_before": free_before, "free_held": held,
            "free_after": engine.free_blocks, "pending": engine.scheduler.has_requests(),
            "total_blocks": engine.kv_cache_config.num_blocks}


def launcher_pattern(room: int, name: str, position: int, nbytes: int) -> np.ndarray:
    """What a ``dsa-bridge prefill`` launcher node writes into the request's page ``position``."""
    layer, kind = layer_of(name)
    return expected_pages(room, layer, kind, np.array([position]), nbytes)[0].numpy()


def run_decode(args, engine: MiniEngine) -> dict:
    deadline = time.monotonic() + args.timeout
    while not Path(args.answers).exists():  # the prefill's, written once it finished them all
        if time.monotonic() >= deadline:
            return {"error": f"no answers in {args.answers} within {args.timeout}s"}
        time.sleep(0.05)
    answers = json.loads(Path(args.answers).read_text())
    if args.fragment:
        engine.fragment()
    free_before = engine.free_blocks
    for req_id, answer in answers.items():
        engine.add(req_id, prompt_of(req_id, answer["length"]), 2, answer["params"])
    checked: dict[str, int] = {}  # request -> pages that differ
    blocks: dict[str, list[int]] = {}

    def forward(out) -> None:
        for req_id in out.num_scheduled_tokens:
            if req_id in checked:
                continue
            pages = -(-answers[req_id]["length"] // 64)
            blocks[req_id] = engine.block_ids(req_id)[:pages]
            room = answers[req_id]["params"]["remote_room"]
            checked[req_id] = sum(
                not np.array_equal(page, launcher_pattern(room, name, position, page.size)
                                   if args.launcher else pattern(req_id, name, position, page.size))
                for name, position, page in page_bytes(engine, req_id, pages))

    finished, held = {}, None
    abort_at = time.monotonic() + args.abort_after if args.abort else None
    while (len(finished) < len(answers) or engine.scheduler.has_requests()) \
            and time.monotonic() < deadline:
        now = time.monotonic()
        if abort_at is not None and now >= abort_at:
            from vllm.v1.request import RequestStatus

            engine.scheduler.finish_requests(args.abort, RequestStatus.FINISHED_ABORTED)
            finished[args.abort] = "abort"  # (vLLM's client, not its scheduler, reports it)
            abort_at, held_at = None, now + HELD_AFTER_S
        if held is None and args.abort and abort_at is None and now >= held_at:
            held = engine.free_blocks
        for output in engine.step(forward):
            finished[output.request_id] = str(output.finish_reason)
        time.sleep(0.002)
    return {"finished": finished, "differing_pages": checked, "blocks": blocks,
            "free_before": free_before, "free_after": engine.free_blocks, "free_after_abort": held,
            "pending": engine.scheduler.has_requests(),
            "layers": engine.worker._worker.pool.layout.num_layers,
            "indexers": len(engine.worker._worker.pool.layout.index_layer_ids)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["prefill", "decode"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--extra", required=True, help="kv_connector_extra_config, JSON")
    parser.add_argument("--answers", required=True)
    parser.add_argument("--requests", default="[]")
    parser.add_argument("--stop", default="")
    parser.add_argument("--fragment", action="store_true")
    parser.add_argument("--launcher", action="store_true",
                        help="the peer is a dsa-bridge launcher node: its pattern, by room")
    parser.add_argument("--abort", default="")
    parser.add_argument("--abort-after", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--tp", default="0/1", help="this worker's TP rank / TP size")
    parser.add_argument("--room-seed", type=int, default=None,
                        help="draw rooms from this seed (the prefill ranks of one TP group)")
    args = parser.parse_args()
    if args.room_seed is not None:  # vLLM's one scheduler gives every rank the same rooms
        bridge_scheduler.secrets = types.SimpleNamespace(randbits=random.Random(args.room_seed).getrandbits)
    if any(key.startswith("DSA_BRIDGE_FAULT_") for key in os.environ):
        bridge_worker.create_backend = _faulty_backend
    rank, size = map(int, args.tp.split("/"))
    if size > 1:  # one worker of a TP group, as vLLM's parallel state would name it
        bridge_connector._parallel_state = lambda: (rank, size)
        config_of = harness.vllm_config

        def tp_config(*a, **kw):
            config = config_of(*a, **kw)
            config.parallel_config.tensor_parallel_size = size
            return config

        harness.vllm_config = tp_config
    role = "kv_producer" if args.role == "prefill" else "kv_consumer"
    engine = MiniEngine(Path(args.model), role, json.loads(args.extra))
    try:
        summary = (run_prefill if args.role == "prefill" else run_decode)(args, engine)
    finally:
        engine.close()
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
