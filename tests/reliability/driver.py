"""Test-only decode node process fed by several prefill nodes (``dsa-bridge decode`` takes one).

    python tests/reliability/driver.py --prefill A:P --prefill B:Q --engine-host ADDR ...

One ``DecodeNode`` handshakes with every ``--prefill`` endpoint; request i goes to endpoint
``i % count`` (``node.receiver(room, prefill=endpoint)``). Every received byte of every layer is
checked against the pattern, pages go back to the allocator only when ``can_release()``, and
pages no request owns must still hold the sentinel at the end. The JSON summary (per prefill:
requests ok and failed) goes to ``--summary-file``; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import collections
import math
import sys
import time

import numpy as np

from dsa_bridge.plugin import DSALayout, DSATokenToKVPool
from dsa_bridge.plugin.layout import load_model_config
from dsa_bridge.transfer.auth import load_secret
from dsa_bridge.transfer.backends import create_backend
from dsa_bridge.transfer.decode import DecodeNode
from dsa_bridge.transfer.launcher.drivers import (
    count_mismatches,
    release_settled,
    request_bytes,
    request_lengths,
    reset_pages,
    sentinel_intact,
)
from dsa_bridge.transfer.launcher.page_allocator import PageAllocator
from dsa_bridge.transfer.launcher.summary import write_json_atomic
from dsa_bridge.transfer.request import KVPoll


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefill", action="append", required=True)
    parser.add_argument("--backend", default="mooncake")
    parser.add_argument("--engine-host", default="127.0.0.1")
    parser.add_argument("--secret-file")
    parser.add_argument("--model", default="deepseek-v3.2")
    parser.add_argument("--indexer-layout", default="uniform", choices=("uniform", "compact"))
    parser.add_argument("--pool-tokens", type=int, default=64 * 64)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--room-base", type=int, default=1 << 32)
    parser.add_argument("--peer-timeout", type=float, default=5.0)
    parser.add_argument("--request-timeout", type=float, default=60.0)
    parser.add_argument("--deadline", type=float, default=240.0, help="whole-run deadline, s")
    parser.add_argument("--summary-file", required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    layout = DSALayout.from_hf_config(load_model_config(args.model), indexer_layout=args.indexer_layout)
    pool = DSATokenToKVPool.from_layout(layout, size=args.pool_tokens)
    reset_pages(pool, np.arange(pool.num_kv_pages))
    node = DecodeNode(pool, create_backend(args.backend, host=args.engine_host), args.prefill,
                      peer_timeout_s=args.peer_timeout, request_timeout_s=args.request_timeout,
                      secret=load_secret(args.secret_file))
    try:
        summary = drive(node, args)
    finally:
        node.close()
    write_json_atomic(args.summary_file, summary)
    return 0 if summary["ok"] else 1


def drive(node: DecodeNode, args: argparse.Namespace) -> dict:
    pool = node.pool
    allocator = PageAllocator(pool.num_kv_pages, seed=args.seed + 1)
    lengths = request_lengths(args.requests, pool.page_size, args.max_tokens, args.seed)
    per_prefill = {e: {"ok": 0, "failed": 0, "bytes": 0} for e in args.prefill}
    result = {"requests": len(lengths), "requests_ok": 0, "requests_failed": 0,
              "bytes_verified": 0, "bytes_mismatched": 0, "failures": []}
    pending = collections.deque(enumerate(lengths))
    active, held = {}, []
    deadline = time.monotonic() + args.deadline
    next_progress = 0.0
    while (pending or active or held) and time.monotonic() < deadline:
        while pending and len(active) < args.concurrency:
            index, tokens = pending[0]
            pages = allocator.alloc(math.ceil(tokens / pool.page_size))
            if pages is None:
                break
            pending.popleft()
            endpoint = args.prefill[index % len(args.prefill)]
            receiver = node.receiver(args.room_base + index, prefill=endpoint)
            receiver.init(pages, tokens)
            active[receiver.room] = (receiver, pages, endpoint)
        for room, (receiver, pages, endpoint) in list(active.items()):
            status = receiver.poll()
            if status not in (KVPoll.Success, KVPoll.Failed):
                continue
            if status == KVPoll.Success:
                bad = count_mismatches(pool, room, pages, receiver.components)
                nbytes = request_bytes(pool, pages.size, receiver.components)
                result["bytes_mismatched"] += bad
                result["bytes_verified"] += nbytes
                per_prefill[endpoint]["bytes"] += nbytes
                ok = bad == 0
                if not ok:
                    result["failures"].append(f"room {room}: {bad} bytes differ")
            else:
                ok = False
                result["failures"].append(f"{endpoint}: {receiver.failure_exception()}")
            result["requests_ok" if ok else "requests_failed"] += 1
            per_prefill[endpoint]["ok" if ok else "failed"] += 1
            del active[room]
            held.append((receiver, pages))
        release_settled(node, allocator, held)
        if time.monotonic() >= next_progress:
            next_progress = time.monotonic() + 0.5
            print(f"[driver] ok={result['requests_ok']} failed={result['requests_failed']}",
                  file=sys.stderr, flush=True)
        time.sleep(0.001)
    unfinished = len(pending) + len(active) + len(held)
    result.update(per_prefill=per_prefill, unfinished=unfinished,
                  sentinel_intact=sentinel_intact(pool, allocator.free_list()),
                  counters=node.counters.snapshot(), transport=node.backend.transport())
    result["ok"] = (result["requests_ok"] == result["requests"] and unfinished == 0
                    and result["sentinel_intact"])
    return result


if __name__ == "__main__":
    sys.exit(main())
