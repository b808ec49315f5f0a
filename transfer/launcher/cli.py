"""The ``dsa-bridge`` launcher: pool geometry, the prefill and decode roles, and the demo.

    dsa-bridge pool    --model deepseek-v3.2            geometry and sizing of a pool
    dsa-bridge prefill --listen HOST:PORT ...           a long-lived prefill node
    dsa-bridge decode  --prefill HOST:PORT ...          a decode node that runs N verified requests
    dsa-bridge demo                                     both, as two processes on this machine

Progress and logs go to stderr; ``--json`` output is the only thing written to stdout by us
(NIXL and UCX log to stdout, so child processes' stdout is sent to stderr).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading

import numpy as np

from ..auth import load_secret
from ..backends.base import BackendError
from ..bench.command import add_bench_parser, run_bench
from ..metrics import metrics_port
from ..staging import MIB, ROUTES
from . import options
from .demo import run_demo
from .options import (
    listen_endpoint,
    non_negative_int,
    output_file,
    peer_endpoints,
    positive_float,
    positive_int,
    power_of_two,
    request_count,
    secret_file,
    timeout_seconds,
)
from .summary import print_summary, write_json_atomic

DEFAULT_POOL_TOKENS = 65536
DEFAULT_REQUESTS = 32
log = logging.getLogger("dsa_bridge")


def add_pool_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="deepseek-v3.2",
                        help="preset (deepseek-v3.2, glm-5.2) or a path to a config.json")
    parser.add_argument("--kv-dtype", choices=("fp8", "fp8_raw", "bf16"),
                        help="MLA KV layout: fp8 = 656-byte FlashMLA row, fp8_raw = 576 bytes, bf16; "
                             "default: the preset's (fp8_raw for glm-5.2), else fp8")
    parser.add_argument("--indexer-layout", default="uniform", choices=("uniform", "compact"),
                        help="uniform: every layer holds an indexer (default); compact: only the "
                             "layers that produce their own top-k (GLM-5.2: 21 of 78)")
    parser.add_argument("--page-size", type=power_of_two, default=64)
    parser.add_argument("--pool-tokens", type=positive_int, default=DEFAULT_POOL_TOKENS,
                        help="token slots in the pool, a multiple of the page size "
                             f"(default {DEFAULT_POOL_TOKENS}: ~3.1 GB for DeepSeek-V3.2 fp8)")


def add_node_options(parser: argparse.ArgumentParser) -> None:
    add_pool_options(parser)
    parser.add_argument("--backend", default="mooncake", choices=("mooncake", "nixl"))
    parser.add_argument("--peer-timeout", type=timeout_seconds, default=5.0,
                        help="seconds without a heartbeat before a peer counts as dead")
    parser.add_argument("--request-timeout", type=timeout_seconds, default=60.0)
    parser.add_argument("--secret-file", type=secret_file,
                        help="shared secret (first line) that peers must prove; "
                             "default: $DSA_BRIDGE_SECRET")
    parser.add_argument("--checksums", action=argparse.BooleanOptionalAction, default=False,
                        help="end-to-end page checksums: prefill sends one per page of every "
                             "buffer, decode verifies them before a request succeeds")
    parser.add_argument("--staging-mib", type=non_negative_int,
                        help="staging area for the staged route, registered at start (default: "
                             "256, or the pool's size if smaller; 0: none, every chunk direct)")
    parser.add_argument("--verbose", action="store_true",
                        help="at exit, print the node's counters to stderr")


def add_metrics_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--metrics-port", type=metrics_port, default=0,
                        help="serve Prometheus metrics on this port (default 0: off)")
    parser.add_argument("--metrics-host", default="127.0.0.1",
                        help="address the metrics endpoint binds (default 127.0.0.1)")


def staging_bytes(mib: int | None) -> int | None:
    return None if mib is None else mib * MIB


def build_parser() -> argparse.ArgumentParser:
    parser = options.Parser(prog="dsa-bridge", description=__doc__.split("\n")[0])
    parser.add_argument("--log-level", type=options.log_level,
                        default=os.environ.get("DSA_BRIDGE_LOG_LEVEL", "WARNING"))
    sub = parser.add_subparsers(dest="command", required=True)

    pool = sub.add_parser("pool", help="print a pool's geometry and sizing")
    add_pool_options(pool)
    pool.add_argument("--budget-gib", type=positive_float, default=60.0)
    pool.add_argument("--json", action="store_true")

    prefill = sub.add_parser("prefill", help="run a prefill node until SIGTERM/SIGINT")
    add_node_options(prefill)
    prefill.add_argument("--listen", type=listen_endpoint, default="127.0.0.1:0",
                         help="control endpoint HOST:PORT (a host name is resolved to its address)")
    prefill.add_argument("--ready-file", type=output_file,
                         help="write {endpoint, pid} here once listening")
    prefill.add_argument("--insecure", action="store_true",
                         help="allow a non-loopback listener without a shared secret")
    prefill.add_argument("--chunk-pages", type=positive_int, default=64,
                         help="pages per chunk (a chunked prefill sends a request in pieces)")
    prefill.add_argument("--start-layer", type=non_negative_int,
                         help="first layer this node holds (a pipeline stage; default 0)")
    prefill.add_argument("--end-layer", type=positive_int,
                         help="one past the last layer this node holds (default: all)")
    prefill.add_argument("--summary-file", type=output_file,
                         help="at exit, write here the counters, the stand-in's fill time and "
                              "when each request's pages were ready (time.monotonic())")
    prefill.add_argument("--route", default="auto", choices=ROUTES,
                         help="auto (default): a chunk of many small descriptors goes through "
                              "both nodes' staging areas, others directly; or force either")
    add_metrics_options(prefill)

    decode = sub.add_parser("decode", help="run verified requests against a prefill node (SIGTERM/"
                            "SIGINT: no further request starts; those in flight finish)")
    add_node_options(decode)
    decode.add_argument("--prefill", type=peer_endpoints, required=True,
                        help="prefill control endpoint HOST:PORT, or the comma-separated endpoints "
                             "of the pipeline stages that together hold every layer")
    decode.add_argument("--indexer-reads", default="held", choices=("held", "producers"),
                        help="indexer layers this node's attention reads: every one it holds "
                             "(default), or only the producer layers (index sharing on)")
    decode.add_argument("--engine-host", type=options.engine_host,
                        help="address prefill reaches this node's engine at "
                             "(default: the local address routed to prefill)")
    decode.add_argument("--quarantine-timeout", type=options.quarantine_seconds, default=600.0,
                        help="upper bound, in seconds, on holding the pages of a request whose "
                             "prefill went silent while it may still write into them, without "
                             "proof that it cannot (a new handshake, or its process gone); "
                             "released then and counted as an expiry (default 600)")
    add_run_options(decode)
    decode.add_argument("--rooms", type=options.rooms_file,
                        help="run these requests instead of drawing --requests: a JSON list of a "
                             "prefill's answers, each with remote_room and remote_num_tokens (the "
                             "kv_transfer_params of a vLLM prefill with dsa-bridge's connector)")
    decode.set_defaults(requests=None)  # DEFAULT_REQUESTS unless --rooms names them
    decode.add_argument("--summary-file", type=output_file,
                        help="write the JSON summary here instead of printing, with each "
                             "request's init and Success times (time.monotonic())")
    add_metrics_options(decode)

    demo = sub.add_parser("demo", help="a real prefill and decode process on this machine")
    add_node_options(demo)
    add_run_options(demo)
    demo.add_argument("--timeout", type=timeout_seconds, default=900.0,
                      help="whole-run deadline, seconds")
    demo.set_defaults(checksums=True)  # --no-checksums to turn them off

    add_bench_parser(sub)
    return parser


def add_run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=request_count, default=DEFAULT_REQUESTS)
    parser.add_argument("--concurrency", type=positive_int, default=4, help="requests in flight")
    parser.add_argument("--max-tokens", type=positive_int, default=16384,
                        help="longest request (capped at --pool-tokens)")
    parser.add_argument("--seed", type=non_negative_int, default=0)
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")


def make_layout(args) -> tuple[dict, object]:
    """The model config and the pool layout the options describe."""
    from ...plugin import DSALayout
    from ...plugin.layout import load_model_config

    config = load_model_config(args.model)
    kv_dtype = args.kv_dtype or config.get("dsa_bridge_kv_dtype", "fp8")
    return config, DSALayout.from_hf_config(
        config, page_size=args.page_size, kv_dtype=kv_dtype, indexer_layout=args.indexer_layout,
        start_layer=getattr(args, "start_layer", None), end_layer=getattr(args, "end_layer", None))


def make_pool(args):
    from ...plugin import DSATokenToKVPool

    return DSATokenToKVPool.from_layout(make_layout(args)[1], size=args.pool_tokens)


def cmd_pool(args) -> int:
    from ...plugin import sizing

    config, layout = make_layout(args)
    budget = int(args.budget_gib * 2**30)
    info = {
        "model": args.model, "layers": layout.num_layers, "indexer_layout": layout.indexer_layout,
        "indexer_layers": len(layout.index_layer_ids), "kv_dtype": layout.kv_dtype,
        "page_size": layout.page_size, "kv_row_bytes": layout.kv_row_bytes,
        "kv_page_bytes": layout.kv_page_bytes, "index_row_bytes": layout.index_row_bytes,
        "index_page_bytes": layout.index_page_bytes,
        "bytes_per_token": sizing.bytes_per_token(layout),
        "budget_bytes": budget, "capacity_tokens": sizing.pool_capacity_tokens(layout, budget),
        "layout_hash": layout.layout_hash(),
        "index_sharing": sizing.index_sharing_report(config, layout),
    }
    if args.json:
        print(json.dumps(info))
    else:
        for key, value in info.items():
            print(f"{key:>18}: {value}")
    return 0


def stop_on_signals() -> threading.Event:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def cmd_prefill(args) -> int:
    from .. import metrics
    from ..backends import create_backend
    from ..control import parse_endpoint
    from ..prefill import PrefillNode
    from .drivers import PrefillReport, serve_prefill

    host, _ = parse_endpoint(args.listen, "--listen")
    stop = stop_on_signals()
    pool = make_pool(args)
    backend = create_backend(args.backend, host=host)
    node = PrefillNode(pool, backend, listen=args.listen,
                       request_timeout_s=args.request_timeout, peer_timeout_s=args.peer_timeout,
                       secret=load_secret(args.secret_file), allow_insecure=args.insecure,
                       checksums=args.checksums, route=args.route,
                       staging_bytes=staging_bytes(args.staging_mib))
    exporter = None
    # each room's ready time only for a summary file (the demo's): a long-lived node keeps none
    report = PrefillReport(ready_at={} if args.summary_file else None)
    try:
        exporter = metrics.serve(node, "prefill", args.metrics_host, args.metrics_port)
        if args.ready_file:
            write_json_atomic(args.ready_file, {"endpoint": node.endpoint, "pid": os.getpid(),
                                                "transport": node.backend.transport()})
        print(f"[prefill] listening on {node.endpoint} ({args.backend}, "
              f"{node.backend.transport()})", file=sys.stderr, flush=True)
        serve_prefill(node, stop, chunk_pages=args.chunk_pages, report=report)
    finally:
        counters = node.counters.snapshot()
        if args.verbose:
            print(f"[prefill] counters: {counters}", file=sys.stderr, flush=True)
        print(f"[prefill] stand-in model: filled {report.requests} requests, "
              f"{report.fill_bytes / 1e9:.2f} GB in {report.fill_seconds:.2f}s "
              f"({report.fill_gbps:.2f} GB/s)", file=sys.stderr, flush=True)
        if args.summary_file:
            write_json_atomic(args.summary_file, {
                "counters": counters, "requests_filled": report.requests,
                "fill_bytes": report.fill_bytes, "fill_seconds": report.fill_seconds,
                "ready_at": report.ready_at})
        if exporter is not None:
            exporter.close()
        node.close()
    return 0


def cmd_decode(args) -> int:
    from ...plugin import DSATokenToKVPool, index_layer_ids_for
    from .. import metrics
    from ..backends import create_backend
    from ..control import parse_endpoint
    from ..decode import DecodeNode
    from .drivers import drive_decode, request_lengths, reset_pages

    endpoints = args.prefill.split(",")
    prefill_host, _ = parse_endpoint(endpoints[0], "--prefill")
    config, layout = make_layout(args)
    reads = None if args.indexer_reads == "held" else index_layer_ids_for(
        config, layout.index_layer_ids, "compact")
    pool = DSATokenToKVPool.from_layout(layout, size=args.pool_tokens)
    reset_pages(pool, np.arange(pool.num_kv_pages))
    engine_host = args.engine_host or local_address_for(prefill_host)
    with DecodeNode(pool, create_backend(args.backend, host=engine_host), endpoints,
                    request_timeout_s=args.request_timeout, peer_timeout_s=args.peer_timeout,
                    quarantine_timeout_s=args.quarantine_timeout,
                    secret=load_secret(args.secret_file), index_reads=reads,
                    checksums=args.checksums,
                    staging_bytes=staging_bytes(args.staging_mib)) as node, \
            metrics.serving(node, "decode", args.metrics_host, args.metrics_port):
        if args.rooms is not None:  # a prefill's answers (a vLLM prefill's rooms): its requests
            rooms, lengths = [room for room, _, _ in args.rooms], [n for _, n, _ in args.rooms]
        else:
            rooms = None
            lengths = request_lengths(args.requests or DEFAULT_REQUESTS, pool.page_size,
                                      min(args.max_tokens, args.pool_tokens), args.seed)
        # room ids are global on a prefill node (as SGLang's bootstrap rooms): random, so that
        # several decode nodes can share one prefill node
        report = drive_decode(node, lengths, concurrency=args.concurrency, seed=args.seed + 1,
                              room_base=int.from_bytes(os.urandom(8), "big") >> 2, rooms=rooms,
                              stop=stop_on_signals())  # SIGTERM/SIGINT: finish those in flight
        summary = {
            "requests": report.requests, "requests_ok": report.requests_ok,
            "requests_failed": report.requests_failed, "bytes_verified": report.bytes_verified,
            "bytes_mismatched": report.bytes_mismatched, "sentinel_intact": report.sentinel_intact,
            "layers": pool.layout.num_layers, "indexer_layout": pool.layout.indexer_layout,
            "indexer_layers": len({lid for p in node.peers for lid, kind in p.keys if kind == "index"}),
            # when prefill's pages were ready, and how long its stand-in filled them, only the
            # prefill process knows: the demo joins them in (summary.join_prefill)
            "gbps": None, "transfer_seconds": None, "fill_gbps": None, "fill_seconds": None,
            "engine_gbps": round(report.engine_gbps, 3),
            "request_gbps": round(report.request_gbps, 3),
            "request_seconds": round(report.request_seconds, 3),
            "verify_gbps": round(report.verify_gbps, 3),
            "verify_seconds": round(report.verify_seconds, 3),
            "seconds": round(report.seconds, 3), "backend": args.backend,
            "transport": node.backend.transport(), "model": args.model,
            "kv_dtype": pool.layout.kv_dtype, "page_size": pool.page_size,
            "concurrency": args.concurrency, "failures": report.failures[:20],
            "checksums": args.checksums,
            "checksums_verified": node.counters.snapshot()["checksums_verified"],
            "counters": node.counters.snapshot(), "ok": report.ok,
        }
    if args.verbose:
        print(f"[decode] counters: {summary['counters']}", file=sys.stderr, flush=True)
    if args.summary_file:
        write_json_atomic(args.summary_file, {**summary, "request_times": report.times})
    else:
        print_summary(summary, as_json=args.json)
    return 0 if report.ok else 1


def local_address_for(peer_host: str) -> str:
    """The local address the kernel routes to ``peer_host`` (no packet is sent)."""
    import socket

    family = socket.AF_INET6 if ":" in peer_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((peer_host, 9))
        return probe.getsockname()[0]


def main(argv: list[str] | None = None) -> int:
    """Parse and check every option, then run the command; the process's exit code."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # a bad option (2) or --help (0), already printed
        return int(exc.code or 0)
    try:
        options.check_options(args, make_layout)
    except options.OptionError as exc:
        print(f"dsa-bridge {args.command}: error: {exc}", file=sys.stderr)
        return 2
    for warning in options.fixed_port_warnings(args):
        print(f"dsa-bridge {args.command}: warning: {warning}", file=sys.stderr)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    commands = {"pool": cmd_pool, "prefill": cmd_prefill, "decode": cmd_decode, "demo": run_demo,
                "bench": run_bench}
    try:
        return commands[args.command](args)
    except (ValueError, OSError, RuntimeError, BackendError) as exc:
        print(f"dsa-bridge {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
