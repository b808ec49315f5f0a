"""``dsa-bridge bench``: how fast dsa-bridge moves DSA requests, against the engine and memcpy.

Every figure is taken in one run, side by side, and reported as a ratio to baselines measured in
that same run (medians of ``repeat`` interleaved runs; see ``measure`` for how):

- **end-to-end**: a real PrefillNode in a child process, a real DecodeNode here, from decode's
  ``receiver.init`` to Success: control plane, planning, engine, completion;
- **raw engine**: the node's own engine writing the same byte ranges from pre-built descriptors
  in one ``backend.write`` call (``ratio_vs_raw`` = raw seconds / end-to-end seconds);
- **memcpy**: one in-process ``memmove`` of the same number of bytes (the machine's limit);
- **checksums**: end-to-end again with page checksums on both nodes; ``checksum_share`` = the
  seconds both nodes spent computing checksums / that run's end-to-end seconds.

Sweeps, per backend: request length (DeepSeek-V3.2 with all 61 layers as far as memory allows,
then cut to a few layers up to 128K tokens), layers (GLM-5.2 cut to N layers), page patterns
(contiguous, fragmented, one page per descriptor) and concurrent requests. Without a transfer:
the planner's cost per request and the pool operations against memcpy. Layer sets: GLM-5.2 in the
compact layout against the uniform one, bytes on the wire and end-to-end time.

The ``sglang`` section (``sglang_pd``, where sglang is installed): the same requests through
sglang's own Mooncake connector and through dsa-bridge's, driven by the same sglang code on the
same pools; elsewhere it says why it is skipped. ``--sections`` runs only some sections.

This module is the command and its report (headline figures, targets, tables, plots); it loads
torch and the engines only when a bench runs. Progress goes to stderr. With ``--json`` the only
thing on stdout is the report: while the bench runs, file descriptor 1 points at stderr, where
NIXL and UCX write their logs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from importlib import metadata

from ..backends import BACKENDS
from ..launcher.options import choice_list, output_dir
from . import gpu as gpu_section
from . import routes as route_section
from . import vllm as vllm_section
from .routes import AUTO_VS_FASTER, print_routes, route_summary
from .sglang_pd import print_section, run_section
from .sizes import SIZES

REPORT_VERSION = 1
LONG_REQUEST_TOKENS = 8192  # the ratio_vs_raw target holds from this request length on
# per engine where issue 21 sets them apart: NIXL over CMA, where a gather, a scatter or a hash
# costs as much as the copy itself on two cores, is held to less
TARGETS = {"ratio_vs_raw": 0.9, "plan_share": 0.02, "pool_vs_memcpy": 0.5,
           "checksum_share": {"mooncake": 0.1, "nixl": 0.25},
           "concurrent_ratio_vs_raw": 0.9, "max_tick_gap_ms": 20.0,
           "vs_contiguous": {"mooncake": 0.8, "nixl": 0.65}, "staged_descriptors": 64,
           "auto_vs_faster": AUTO_VS_FASTER}
TARGET_CONCURRENCY = (16, 64)  # requests in flight the concurrent_ratio_vs_raw target covers
ENGINE_PACKAGES = ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine-cuda13",
                   "mooncake-transfer-engine", "nixl-cu12", "nixl-cu13")  # CPU and CUDA hosts' wheels
QUIET_ENV = {"MC_LOG_LEVEL": "ERROR", "NIXL_LOG_LEVEL": "ERROR", "UCX_LOG_LEVEL": "error"}
SECTIONS = ("core", "routes", "gpu", "sglang", "vllm")  # core: the figures of every section but these
DEFAULT_SECTIONS = ("core", "gpu", "sglang")  # routes: core's route sweeps alone


def machine() -> dict:
    """What the figures were measured on."""
    versions = {}
    for package in ("torch", *ENGINE_PACKAGES):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return {"cpus": os.cpu_count(), "memory_gib": round(memory / 2**30, 1),
            "platform": platform.platform(), "python": platform.python_version(), **versions}


def add_plan_shares(plan_rows: list[dict], transfers: list[dict], backends: list[str]) -> dict:
    """Each planning point's share of its request's transfer time at the backend's end-to-end
    rate (that of its contiguous single request with the most bytes: the fastest, so the largest
    share). Returns the headline: the largest share at the longest length, per backend."""
    longest = max(r["tokens"] for r in plan_rows)
    headline = {}
    for backend in backends:
        ref = max((r for r in transfers if r["backend"] == backend and r["requests"] == 1
                   and r["pattern"] == "contiguous"), key=lambda r: r["bytes"])
        for row in plan_rows:
            transfer_s = row["bytes"] / (ref["e2e_gbps"] * 1e9)
            row.setdefault("share", {})[backend] = row["seconds"] / transfer_s
        headline[backend] = max(r["share"][backend] for r in plan_rows if r["tokens"] == longest)
    return headline


def layer_sets_summary(transfers: list[dict], backends: list[str]) -> dict:
    """GLM-5.2, all 78 layers, one request: compact against uniform, per backend — bytes on the
    wire and end-to-end seconds, each as compact / uniform."""
    out = {}
    for backend in backends:
        rows = {r["indexer_layout"]: r for r in transfers
                if r["backend"] == backend and r["sweep"] == "layer_sets"}
        uniform, compact = rows["uniform"], rows["compact"]
        out[backend] = {"bytes_ratio": compact["bytes"] / uniform["bytes"],
                        "seconds_ratio": compact["e2e_s"] / uniform["e2e_s"],
                        "uniform_bytes": uniform["bytes"], "compact_bytes": compact["bytes"]}
    return out


def concurrency_summary(transfers: list[dict], backends: list[str]) -> dict:
    """Per backend, ``ratio_vs_raw`` of the concurrency sweep's points of ``TARGET_CONCURRENCY``
    requests in flight (those the run has): raw = the engine writing all of them in one batch."""
    return {backend: {str(r["requests"]): r["ratio_vs_raw"] for r in transfers
                      if r["backend"] == backend and r["sweep"] == "concurrency"
                      and r["requests"] in TARGET_CONCURRENCY}
            for backend in backends}


def tick_gap_summary(transfers: list[dict], backends: list[str]) -> dict:
    """Per backend, the prefill control thread's longest tick gap during its largest single
    request of the full 61 layers (788 MB at 16K tokens), and that request's bytes."""
    out = {}
    for backend in backends:
        row = max((r for r in transfers if r["backend"] == backend and r["sweep"] == "length"),
                  key=lambda r: r["bytes"])
        out[backend] = {"ms": row["max_tick_gap_ms"], "bytes": row["bytes"],
                        "idle_ms": row["idle_tick_gap_ms"]}
    return out


def summarize(transfers: list[dict], plan_share: dict, pool_rows: list[dict],
              backends: list[str]) -> dict:
    """The headline figures, and whether each target is met: the median over the points a
    target covers (single points are noisy on a shared machine), with the lowest point too."""
    lengths = [r for r in transfers if r["sweep"] in ("length", "length_long")]
    # a run without requests that long (--tiny) takes its longest ones
    from_tokens = min(LONG_REQUEST_TOKENS, max(r["tokens"] for r in lengths))
    ratio, lowest, share, share_highest = {}, {}, {}, {}
    for backend in backends:
        long = [r for r in lengths if r["backend"] == backend and r["tokens"] >= from_tokens]
        ratio[backend] = statistics.median(r["ratio_vs_raw"] for r in long)
        lowest[backend] = min(r["ratio_vs_raw"] for r in long)
        share[backend] = statistics.median(r["checksum_share"] for r in long)
        share_highest[backend] = max(r["checksum_share"] for r in long)
    bulk_rows = [r for r in pool_rows if r["pattern"] != "scattered"]
    bulk, bulk_lowest, bulk_pieces = {}, {}, {}
    for op in dict.fromkeys(r["op"] for r in pool_rows):
        ratios = [r["ratio_vs_memcpy"] for r in bulk_rows if r["op"] == op]
        bulk[op], bulk_lowest[op] = statistics.median(ratios), min(ratios)
        bulk_pieces[op] = statistics.median(r["ratio_vs_pieces_memcpy"] for r in bulk_rows
                                            if r["op"] == op)
    fresh = [r["ratio_vs_fresh_memcpy"] for r in bulk_rows if "ratio_vs_fresh_memcpy" in r]
    concurrent, tick_gap = concurrency_summary(transfers, backends), tick_gap_summary(transfers,
                                                                                      backends)
    routes = route_summary(transfers, backends)
    fragmented = {b: {p: by[p]["auto"]["vs_contiguous"] for p in ("fragmented", "per_page")}
                  for b, by in routes.items()}
    auto = route_section.auto_vs_faster(routes)
    staged = [r for r in transfers if r["route_taken"] == "staged" and r["requests"] == 1]
    return {
        "ratio_vs_raw": ratio,
        "ratio_vs_raw_lowest": lowest,
        "ratio_vs_raw_from_tokens": from_tokens,
        "plan_share": plan_share,
        "checksum_share": share,
        "checksum_share_highest": share_highest,
        "pool_vs_memcpy": bulk,
        "pool_vs_memcpy_lowest": bulk_lowest,
        "pool_vs_pieces_memcpy": bulk_pieces,
        "pool_threads": pool_rows[0]["threads"],
        "get_cpu_copy_vs_fresh_memcpy": statistics.median(fresh),
        "compact_vs_uniform": layer_sets_summary(transfers, backends),
        "concurrent_ratio_vs_raw": concurrent,
        "max_tick_gap_ms": {b: v["ms"] for b, v in tick_gap.items()},
        "max_tick_gap_bytes": {b: v["bytes"] for b, v in tick_gap.items()},
        "idle_tick_gap_ms": {b: v["idle_ms"] for b, v in tick_gap.items()},
        "routes": routes,
        "fragmented_vs_contiguous": fragmented,
        "auto_vs_faster_lowest": auto["lowest"],
        "staged_descriptors_per_request": max((r["descriptors"] for r in staged), default=0),
        "staged_tokens": max((r["tokens"] for r in staged), default=0),
        "staging_bytes": max(r["staging_bytes"] for r in transfers),
        "targets_met": {
            "vs_contiguous": {b: all(v >= TARGETS["vs_contiguous"][b] for v in by.values())
                              for b, by in fragmented.items()},
            "auto_vs_faster": auto["met"],
            "staged_descriptors": max((r["descriptors"] for r in staged), default=0)
            <= TARGETS["staged_descriptors"],
            "concurrent_ratio_vs_raw": {b: all(v >= TARGETS["concurrent_ratio_vs_raw"]
                                               for v in levels.values())
                                        for b, levels in concurrent.items()},
            "max_tick_gap_ms": {b: v["ms"] <= TARGETS["max_tick_gap_ms"]
                                for b, v in tick_gap.items()},
            "ratio_vs_raw": {b: v >= TARGETS["ratio_vs_raw"] for b, v in ratio.items()},
            "plan_share": {b: v <= TARGETS["plan_share"] for b, v in plan_share.items()},
            "checksum_share": {b: v <= TARGETS["checksum_share"][b] for b, v in share.items()},
            "descriptors_exact": all(r["descriptors_exact"] for r in transfers),
            "pool_vs_memcpy": {op: v >= TARGETS["pool_vs_memcpy"] for op, v in bulk.items()},
        },
    }


def run(size: str, backends: list[str], indexer_layout: str = "uniform") -> dict:
    """Measure everything ``SIZES[size]`` asks for; the report as one JSON-ready dict."""
    from . import measure  # torch, the nodes and the engines

    sizes = SIZES[size]
    started, load = time.monotonic(), os.getloadavg()
    plan_rows = measure.plan_cost(sizes)
    transfers, transports = measure.run_transfers(sizes, backends, indexer_layout)
    pool_rows = measure.pool_ops(sizes)
    plan_share = add_plan_shares(plan_rows, transfers, backends)
    return {
        "version": REPORT_VERSION, "size": size, "repeat": sizes.repeat, "backends": backends,
        "indexer_layout": indexer_layout,
        "transports": transports, "machine": machine(),
        "load_average": {"start": load, "end": os.getloadavg()},
        "seconds": round(time.monotonic() - started, 1),
        **summarize(transfers, plan_share, pool_rows, backends),
        "targets": TARGETS,
        "transfer": transfers, "plan": plan_rows, "pool_ops": pool_rows,
    }


def print_tables(report: dict) -> None:
    load = report["load_average"]
    print(f"dsa-bridge bench ({report['size']}, median of {report['repeat']}, "
          f"{report['seconds']:.0f} s, load average {load['start'][0]:.1f} -> {load['end'][0]:.1f})")
    print(f"{'backend':8} {'sweep':11} {'model':13} {'L':>2} {'ix':>2} {'tokens':>6} {'req':>3} "
          f"{'pattern':10} {'route':6} {'MB':>6} {'desc':>6} {'e2e GB/s':>8} {'raw':>5} {'memcpy':>6} "
          f"{'e2e/raw':>7} {'+ms':>5} {'plan%':>5} {'sums GB/s':>9} {'sum%':>5}")
    for r in report["transfer"]:
        print(f"{r['backend']:8} {r['sweep']:11} {r['model']:13} {r['layers']:>2} "
              f"{r['buffers'] - r['layers']:>2} {r['tokens']:>6} "
              f"{r['requests']:>3} {r['pattern']:10} {r['route_taken']:6} "
              f"{r['bytes'] / 1e6:>6.0f} {r['descriptors']:>6} "
              f"{r['e2e_gbps']:>8.2f} {r['raw_gbps']:>5.2f} {r['memcpy_gbps']:>6.1f} "
              f"{r['ratio_vs_raw']:>7.2f} {r['overhead_ms']:>5.1f} {100 * r['plan_share']:>5.2f} "
              f"{r['e2e_checksums_gbps']:>9.2f} {100 * r['checksum_share']:>5.1f}")
    print(f"\n{'plan: tokens':>12} {'pattern':10} {'descriptors':>11} {'us':>9}  share of transfer")
    for r in report["plan"]:
        shares = ", ".join(f"{b} {100 * s:.3f}%" for b, s in r["share"].items())
        print(f"{r['tokens']:>12} {r['pattern']:10} {r['descriptors']:>11} "
              f"{r['seconds'] * 1e6:>9.1f}  {shares}")
    print(f"\n{'pool op':14} {'pattern':10} {'tokens':>6} {'GB/s':>6} {'memcpy':>6} {'ratio':>5} "
          f"{'pieces':>6} {'ratio':>5}  into new allocations (op, memcpy, ratio, page faults)")
    for r in report["pool_ops"]:
        fresh = (f"{r['fresh_gbps']:>5.2f} {r['fresh_memcpy_gbps']:>5.2f} GB/s "
                 f"{r['ratio_vs_fresh_memcpy']:>5.2f}x, faults {r['fresh_faults']:.0f} / "
                 f"{r['fresh_memcpy_faults']:.0f}" if "fresh_memcpy_gbps" in r else "")
        print(f"{r['op']:14} {r['pattern']:10} {r['tokens']:>6} {r['gbps']:>6.2f} "
              f"{r['memcpy_gbps']:>6.1f} {r['ratio_vs_memcpy']:>5.2f} {r['pieces_memcpy_gbps']:>6.1f} "
              f"{r['ratio_vs_pieces_memcpy']:>5.2f}  {fresh}")
    print(f"\nratio_vs_raw (length sweeps, requests >= {report['ratio_vs_raw_from_tokens']} tokens, "
          f"median of the points): {report['ratio_vs_raw']}; lowest point: "
          f"{report['ratio_vs_raw_lowest']}")
    print(f"plan_share (longest request, largest): {report['plan_share']}")
    print(f"checksum_share (time both nodes spent checksumming / end-to-end time of the same "
          f"checksummed run, the ratio_vs_raw points, median): {report['checksum_share']}; "
          f"highest: {report['checksum_share_highest']}")
    print(f"pool_vs_memcpy (bulk patterns, median, {report['pool_threads']} threads): "
          f"{report['pool_vs_memcpy']}; lowest: {report['pool_vs_memcpy_lowest']}; against "
          f"memcpy in the pool's pieces: {report['pool_vs_pieces_memcpy']}")
    print(f"get_cpu_copy into new host memory against memmoves into new allocations of the same "
          f"pieces (bulk, median): {report['get_cpu_copy_vs_fresh_memcpy']:.2f}")
    for backend, ratios in report["compact_vs_uniform"].items():
        print(f"GLM-5.2 compact / uniform, {backend}: bytes {ratios['bytes_ratio']:.3f}, "
              f"end-to-end seconds {ratios['seconds_ratio']:.3f}")
    print(f"concurrent_ratio_vs_raw (requests in flight: ratio, raw = one batch of all): "
          f"{report['concurrent_ratio_vs_raw']}")
    print_routes(report["routes"])
    print(f"staging_bytes (both nodes): {report['staging_bytes']}; descriptors of a staged "
          f"{report['staged_tokens']}-token request: {report['staged_descriptors_per_request']}")
    print(f"max_tick_gap_ms (prefill control thread, largest request "
          f"{report['max_tick_gap_bytes']} bytes): {report['max_tick_gap_ms']}; a bare poll loop "
          f"at the engine's tick_ms, no write (idle_tick_gap_ms): {report['idle_tick_gap_ms']}")
    print(f"targets met: {report['targets_met']}")


def write_plots(report: dict, directory: str) -> list[str]:
    """GB/s against request length, and planning cost against length, as PNGs in ``directory``."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    os.makedirs(directory, exist_ok=True)
    note = (f"{report['machine']['cpus']} CPUs, loopback, median of {report['repeat']} "
            f"(dsa-bridge bench, {report['size']})")
    lengths = [r for r in report["transfer"] if r["sweep"] in ("length", "length_long")]
    fig, ax = plt.subplots(figsize=(11, 5))
    for backend in report["backends"]:
        for sweep, marker in (("length", "o"), ("length_long", "s")):
            rows = sorted((r for r in lengths if r["backend"] == backend and r["sweep"] == sweep),
                          key=lambda r: r["tokens"])
            if rows:
                label = f"{backend}, {rows[0]['layers']} layers"
                tokens = [r["tokens"] for r in rows]
                line = ax.plot(tokens, [r["e2e_gbps"] for r in rows], marker=marker,
                               label=f"{label}: dsa-bridge end-to-end")[0]
                ax.plot(tokens, [r["raw_gbps"] for r in rows], marker=marker, linestyle="--",
                        color=line.get_color(), alpha=0.5, label=f"{label}: raw engine")
    memcpy = {}
    for r in lengths:
        memcpy.setdefault(r["tokens"], []).append(r["memcpy_gbps"])
    ax.plot(sorted(memcpy), [max(memcpy[t]) for t in sorted(memcpy)], color="gray",
            linestyle=":", label="memcpy of the same bytes (machine limit)")
    ax.set(xscale="log", yscale="log", xlabel="request length (tokens)", ylabel="GB/s",
           title=f"DeepSeek-V3.2 request, prefill -> decode\n{note}")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.grid(True, which="both", alpha=0.3)
    paths = [os.path.join(directory, "bench_gbps_vs_length.png"),
             os.path.join(directory, "bench_plan_cost.png")]
    fig.tight_layout()
    fig.savefig(paths[0], dpi=110)
    plt.close(fig)

    fig, (cost, share) = plt.subplots(1, 2, figsize=(11, 4.5))
    for pattern in dict.fromkeys(r["pattern"] for r in report["plan"]):
        rows = [r for r in report["plan"] if r["pattern"] == pattern]
        tokens = [r["tokens"] for r in rows]
        cost.plot(tokens, [r["seconds"] * 1e6 for r in rows], marker="o", label=pattern)
        for backend in report["backends"]:
            share.plot(tokens, [100 * r["share"][backend] for r in rows], marker="o",
                       label=f"{pattern}, {backend}")
    share.axhline(100 * TARGETS["plan_share"], color="red", linestyle=":", label="target")
    cost.set(xscale="log", yscale="log", xlabel="request length (tokens)", ylabel="µs per request",
             title="plan_writes, DeepSeek-V3.2 (61 layers x 2 caches)")
    share.set(xscale="log", yscale="log", xlabel="request length (tokens)",
              ylabel="% of the request's transfer time", title="planning as a share of the transfer")
    for axis in (cost, share):
        axis.legend(fontsize=7)
        axis.grid(True, which="both", alpha=0.3)
    fig.suptitle(note, fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=110)
    plt.close(fig)
    return paths


def bench_progress(text: str) -> None:
    print(f"[bench] {text}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Point file descriptor 1 at stderr (the engines' C code logs to stdout) for the block."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="transfer speed against the raw engine and memcpy, "
                                         "planning cost, pool operations")
    size = bench.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="size", action="store_const", const="quick",
                      help="fewer points and repeats: about 3 minutes on 2 cores")
    size.add_argument("--tiny", dest="size", action="store_const", const="tiny",
                      help="every code path at the smallest sizes, in seconds (the smoke test); "
                           "the figures mean little")
    bench.set_defaults(size="full")
    bench.add_argument("--backends", type=choice_list(BACKENDS), default=",".join(BACKENDS),
                       help=f"comma-separated, of {', '.join(BACKENDS)} (default: all)")
    bench.add_argument("--indexer-layout", default="uniform", choices=("uniform", "compact"),
                       help="the GLM-5.2 layer sweep's pools (the layer-sets sweep runs both)")
    bench.add_argument("--sections", type=choice_list(SECTIONS),
                       default=",".join(DEFAULT_SECTIONS),
                       help="comma-separated, of core (dsa-bridge against the engine and memcpy), "
                            "routes (core's route sweeps alone: auto against both routes), "
                            "gpu (the pool, checksums and transfers on a CUDA device; skipped "
                            "without one) and sglang (sglang's own Mooncake connector against "
                            "dsa-bridge's, where sglang is installed), vllm (dsa-bridge's vLLM connector, "
                            "where vllm is installed) (default: core,gpu,sglang)")
    bench.add_argument("--json", action="store_true", help="print the report as one JSON object")
    bench.add_argument("--plots", metavar="DIR", type=output_dir,
                       help="write bench_gbps_vs_length.png and bench_plan_cost.png there "
                            "(matplotlib)")


def run_bench(args: argparse.Namespace) -> int:
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    core = "core" in args.sections
    with stdout_to_stderr() if args.json else contextlib.nullcontext():
        report = (run(args.size, args.backends, args.indexer_layout) if core
                  else {"version": REPORT_VERSION, "size": args.size, "machine": machine()})
        if args.plots and core:
            report["plots"] = write_plots(report, args.plots)
        if "routes" in args.sections:
            report["routes_section"] = route_section.run_section(args.size, args.backends,
                                                                 bench_progress)
        if "gpu" in args.sections:
            report["gpu"] = gpu_section.run_section(args.size, args.backends, bench_progress)
        if "sglang" in args.sections:
            report["sglang"] = run_section(args.size, bench_progress)
        if "vllm" in args.sections:
            report["vllm"] = vllm_section.run_section(args.size, bench_progress)
    if args.json:
        print(json.dumps(report), flush=True)
        return 0
    if core:
        print_tables(report)
    if "routes_section" in report:
        route_section.print_section(report["routes_section"])
    if "gpu" in report:
        gpu_section.print_section(report["gpu"])
    if "sglang" in report:
        print_section(report["sglang"])
    if "vllm" in report:
        vllm_section.print_section(report["vllm"])
    return 0
