"""The measurements of ``dsa-bridge bench``: transfers between two processes, the planner's cost
and the pool operations, each next to the baseline it is reported against.

Transfers: a real PrefillNode in a child process (``bench.child``), a real DecodeNode in the
bench process (``TransferSession``). End-to-end time is taken in the bench process from the first
``receiver.init`` to the moment the last request turned Success (its last ChunkDone handled):
control plane both ways, planning, the engine and the completion report. End-to-end,
end-to-end with checksums (both nodes), raw and memcpy runs are interleaved, their
order alternating between repeats. ``checksum_share`` is the time both nodes spent computing page
checksums during a checksummed run (prefill before each write, decode's verifier after each
chunk) over that same run's end-to-end time.

Planning is timed on hand-built buffers (the planner only does address math, so a 128K-token
request needs no memory); the pool operations on a real DeepSeek-V3.2 pool, against one memmove
of the same number of bytes and against memmoves of them in the pieces the pool holds them in.
"""

from __future__ import annotations

import ctypes
import functools
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from ...plugin import DSALayout, DSATokenToKVPool
from ...plugin.descriptors import BufferDescriptor
from ..backends import create_backend
from ..decode import DecodeNode, KVReceiver
from ..launcher.page_allocator import PageAllocator
from ..plan import pair_buffers, plan_writes
from ..request import TERMINAL, KVPoll
from ..staging import ROUTES, slice_groups
from .channel import Driven
from .child import (
    COMMAND_TIMEOUT_S,
    PAGE,
    WRITE_TIMEOUT_S,
    Geometry,
    start_child,
    trim_heap,
)
from .sizes import Sizes

PATTERNS = ("contiguous", "fragmented", "per_page")
LOC_PATTERNS = ("contiguous", "fragmented", "scattered")
POOL_REPEAT = 7  # pool operations are cheap: more pairs than --quick's 3 steady their median
CONCURRENCY_REPEAT = 21  # the concurrency target's points: their ratio is a median of pairs too


def page_ids(pattern: str, pages: int, requests: int = 1,
             seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """(src, dst) page ids of ``requests`` disjoint requests of ``pages`` pages each.

    contiguous: both sides 1, 2, 3, ... (one run per request); fragmented: each side's pages
    come from a ``PageAllocator`` (shuffled blocks of 1-16 pages, as a serving engine's free list
    looks after a while); per_page: prefill's pages 1, 3, 5, ... so that no two are adjacent and
    every page is its own descriptor (what an engine gets without coalescing); runs_N: prefill's
    pages in runs of N, one page apart, decode's contiguous (descriptors of N pages each)."""
    total = pages * requests
    if pattern == "contiguous":
        src = dst = np.arange(1, total + 1, dtype=np.int64)
    elif pattern == "fragmented":
        src = PageAllocator(total + 1, seed=seed).alloc(total)
        dst = PageAllocator(total + 1, seed=seed + 1).alloc(total)
    elif pattern == "per_page":
        src = np.arange(1, 2 * total, 2, dtype=np.int64)
        dst = np.arange(1, total + 1, dtype=np.int64)
    elif pattern.startswith("runs_") and pattern[5:].isdigit() and int(pattern[5:]) > 0:
        run = int(pattern[5:])
        order = np.arange(total, dtype=np.int64)
        src = 1 + order + order // run
        dst = np.arange(1, total + 1, dtype=np.int64)
    else:
        raise ValueError(f"pattern must be one of {', '.join(PATTERNS)}, got {pattern!r}")
    return [(src[i * pages:(i + 1) * pages], dst[i * pages:(i + 1) * pages])
            for i in range(requests)]


def pool_pages(pattern: str, total_pages: int) -> int:
    """Pages (padding page excluded) a pool needs for ``page_ids(pattern, ...)`` of that many."""
    if pattern.startswith("runs_"):
        return total_pages + total_pages // int(pattern[5:]) + 1
    return 2 * total_pages if pattern == "per_page" else total_pages


def runs(src: np.ndarray, dst: np.ndarray) -> int:
    """Runs of pages where both sides step by +1, counted apart from the planner: the oracle for
    its descriptor count (one write per run, per layer, per cache)."""
    return 1 + int(np.count_nonzero((np.diff(src) != 1) | (np.diff(dst) != 1)))


@dataclass(frozen=True)
class Transfer:
    """One end-to-end run of a set of requests, as the decode node saw it."""

    seconds: float
    nbytes: int
    descriptors: int
    checksum_seconds: float  # both nodes, computing page checksums (0 without them)
    max_tick_gap_ms: float  # the prefill control thread's longest interval between two ticks
    staged_chunks: int  # of these requests, on the staged route
    staging_slices: int


class TransferSession:
    """One geometry on one backend: the child's PrefillNode and this process's DecodeNode."""

    def __init__(self, child: Driven, backend: str, geometry: Geometry) -> None:
        self.child, self.geometry = child, geometry
        reply = child.call("setup", backend=backend, geometry=vars(geometry))
        self.transport = reply["transport"]
        self._room = 0
        self.node: DecodeNode | None = None
        try:
            self.node = DecodeNode(geometry.pool(), create_backend(backend, host="127.0.0.1"),
                                   reply["endpoint"], request_timeout_s=COMMAND_TIMEOUT_S)
            child.call("peer", metadata=self.node.backend.metadata(),
                       buffers=[list(msgspec.structs.astuple(b))
                                for b in self.node.buffers])
        except BaseException:
            self.close()
            raise

    def end_to_end(self, requests: list[tuple[np.ndarray, np.ndarray]], *,
                   checksums: bool = False, route: str = "direct") -> Transfer:
        """Move every request through the nodes at once, prefill's node on ``route``; time
        first init -> last Success."""
        rooms = range(self._room, self._room + len(requests))
        self._room += len(requests)
        self.node.checksums = checksums
        decode_before = self.node.counters.snapshot()["checksum_seconds"]
        before = self.child.call(
            "send", requests=[[room, src.tolist()] for room, (src, _) in zip(rooms, requests, strict=True)],
            checksums=checksums, route=route)
        receivers: list[KVReceiver] = []
        for room, (_, dst) in zip(rooms, requests, strict=True):
            receiver = self.node.receiver(room)
            receiver.init(dst, dst.size * self.geometry.page_size)
            receivers.append(receiver)
        deadline = time.monotonic() + WRITE_TIMEOUT_S
        while any(r.poll() not in TERMINAL for r in receivers):
            if time.monotonic() > deadline:
                for receiver in receivers:
                    receiver.abort("bench deadline passed")
                raise RuntimeError(f"{len(requests)} requests not done in {WRITE_TIMEOUT_S:.0f}s")
            time.sleep(0.005)
        failed = [r for r in receivers if r.poll() == KVPoll.Failed]
        if failed:
            raise RuntimeError(f"transfer failed: {failed[0].failure_exception()}")
        stats = self.child.call("stats")
        self.staging = {"prefill": stats["staging_bytes"], "slice_bytes": stats["slice_bytes"],
                        "decode": self.node.counters.snapshot()["staging_bytes"]}
        prefill_spent = stats["checksum_seconds"] - before["checksum_seconds"]
        result = Transfer(
            seconds=max(r.state.finished_at for r in receivers)
            - min(r.started_at for r in receivers),
            nbytes=sum(r.nbytes for r in receivers),
            descriptors=sum(r.descriptors for r in receivers),
            checksum_seconds=prefill_spent + self.node.counters.snapshot()["checksum_seconds"]
            - decode_before, max_tick_gap_ms=stats["max_tick_gap_ms"],
            staged_chunks=stats["staged_chunks"] - before["staged_chunks"],
            staging_slices=stats["staging_slices"] - before["staging_slices"])
        for receiver in receivers:
            self.node.forget(receiver)
        return result

    def staged_descriptors(self, requests: list[tuple[np.ndarray, np.ndarray]]) -> int:
        """Descriptors of these requests on the staged route (one chunk each): one per slice."""
        peer = self.node.peers[0]
        size = min(self.staging["slice_bytes"], peer.staging.slice_bytes)
        return sum(len(slice_groups(src.size, peer.page_bytes, size)) for src, _ in requests)

    def idle_gap(self, seconds: float) -> float:
        """The longest gap of a bare 2 ms poll loop in the child over ``seconds``, no write running."""
        return self.child.call("idle_gap", seconds=seconds)["max_gap_ms"]

    def raw(self, requests: list[tuple[np.ndarray, np.ndarray]]) -> dict:
        """The raw engine on the same pages: write and plan seconds, descriptors, bytes."""
        return self.child.call("raw", requests=[[s.tolist(), d.tolist()] for s, d in requests])

    def close(self) -> None:
        try:
            if self.node is not None:
                self.node.close()
        finally:
            self.node = None
            self.child.call("teardown")


# ---- measuring -------------------------------------------------------------------------------

def progress(text: str) -> None:
    print(f"[bench] {text}", file=sys.stderr, flush=True)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def timed(run: Callable[[], object], repeat: int, min_sample_s: float = 0.002) -> float:
    """Median seconds of one ``run()``, over samples of enough calls to last ``min_sample_s``."""
    calls, start = 0, time.perf_counter()
    while calls == 0 or time.perf_counter() - start < min_sample_s:
        run()
        calls += 1
    samples = []
    for _ in range(max(repeat, 3)):
        start = time.perf_counter()
        for _ in range(calls):
            run()
        samples.append((time.perf_counter() - start) / calls)
    return statistics.median(samples)


class Memcpy:
    """One ``memmove`` between two scratch buffers (written once, so no page faults when timed)."""

    def __init__(self) -> None:
        self._src = self._dst = np.zeros(0, dtype=np.uint8)

    def _buffers(self, nbytes: int) -> None:
        if nbytes > self._src.size:
            self.free()
            self._src = np.full(nbytes, 1, dtype=np.uint8)
            self._dst = np.full(nbytes, 2, dtype=np.uint8)

    def seconds(self, nbytes: int) -> float:
        """Seconds of the memmove."""
        self._buffers(nbytes)
        start = time.perf_counter()
        ctypes.memmove(self._dst.ctypes.data, self._src.ctypes.data, nbytes)
        return time.perf_counter() - start

    def pieces_seconds(self, pieces: list[int], *, fresh: bool = False) -> float:
        """Seconds of one memmove per piece, back to back: the same bytes cut as a pool holds
        them (per layer and cache part). glibc picks its copy method by size, so on some
        machines many pieces copy slower than one block of their sum. ``fresh``: into new torch
        allocations of those sizes, allocated while timed — what ``get_cpu_copy`` does for its
        result, so both get from the allocator what it gives (recycled memory or new pages that
        fault in)."""
        self._buffers(sum(pieces))
        src, dst, at, kept = self._src.ctypes.data, self._dst.ctypes.data, 0, []
        start = time.perf_counter()
        for nbytes in pieces:
            target = dst + at
            if fresh:
                kept.append(torch.empty(nbytes, dtype=torch.uint8))
                target = kept[-1].data_ptr()
            ctypes.memmove(target, src + at, nbytes)
            at += nbytes
        return time.perf_counter() - start

    def free(self) -> None:
        self._src = self._dst = np.zeros(0, dtype=np.uint8)


def measure(session: TransferSession, memcpy: Memcpy, requests: list, repeat: int, *,
            idle_probe: bool = False, route: str = "direct") -> dict:
    """End-to-end, end-to-end with checksums, raw engine and memcpy on the same requests,
    interleaved: medians of each, and ``ratio_vs_raw`` (and ``overhead_ms``, what dsa-bridge adds
    to a request) as the median of the ratios (differences) of back-to-back pairs, which a drift
    of the machine's load affects least; ``checksum_share`` as the median over the checksummed
    runs of each one's checksum seconds over its own end-to-end seconds; every sample is kept.
    ``idle_probe``: after each end-to-end run, the child's bare poll loop for as long as that
    run took (``idle_tick_gap_ms``, the machine's own gap next to ``max_tick_gap_ms``).
    ``route``: prefill's (``route_taken``: the route the timed runs' requests took, ``mixed`` if
    both, as ``auto`` may; ``staged_runs`` of them staged; with staged, the expected descriptors
    are one per staging slice)."""
    layers, buffers = session.geometry.layers, session.geometry.buffers
    run_e2e = functools.partial(session.end_to_end, requests, route=route)
    run_e2e()  # warm-up: the engine's paths, caches, the planner
    run_e2e(checksums=True)
    e2e, raw, copy, plan, summed, shares, gaps, idle = [], [], [], [], [], [], [], []
    staged_runs = 0
    for i in range(repeat):
        for kind in ("e2e", "sums", "raw") if i % 2 == 0 else ("raw", "sums", "e2e"):
            if kind == "e2e":
                transfer = run_e2e()
                e2e.append(transfer.seconds)
                staged_runs += transfer.staged_chunks > 0
                gaps.append(transfer.max_tick_gap_ms)
                if idle_probe:
                    idle.append(session.idle_gap(transfer.seconds))
            elif kind == "sums":
                checked = run_e2e(checksums=True)
                summed.append(checked.seconds)
                shares.append(checked.checksum_seconds / checked.seconds)
            else:
                reply = session.raw(requests)
                raw.append(reply["seconds"])
                plan.append(reply["plan_seconds"])
        copy.append(memcpy.seconds(transfer.nbytes))
    staged = transfer.staged_chunks > 0  # the descriptors reported are the last run's
    expected = (session.staged_descriptors(requests) if staged
                else sum(runs(src, dst) for src, dst in requests) * buffers)
    taken = {0: "direct", len(e2e): "staged"}.get(staged_runs, "mixed")
    e2e_s, raw_s, copy_s, plan_s = (statistics.median(x) for x in (e2e, raw, copy, plan))
    nbytes = transfer.nbytes
    return {
        "model": session.geometry.model, "layers": layers,
        "indexer_layout": session.geometry.indexer_layout, "buffers": buffers,
        "tokens": int(requests[0][0].size * PAGE),
        "requests": len(requests), "bytes": nbytes, "runs": expected // buffers,
        "descriptors": transfer.descriptors, "raw_descriptors": reply["descriptors"],
        "descriptors_expected": expected,
        "descriptors_exact": transfer.descriptors == expected
        and (staged or expected == reply["descriptors"]) and reply["nbytes"] == nbytes,
        "route": route, "route_taken": taken, "staged_runs": staged_runs,
        "staging_slices": transfer.staging_slices,
        "staging_bytes": session.staging["prefill"] + session.staging["decode"],
        "e2e_s": e2e_s, "raw_s": raw_s, "memcpy_s": copy_s, "plan_s": plan_s,
        "e2e_gbps": gbps(nbytes, e2e_s), "raw_gbps": gbps(nbytes, raw_s),
        "memcpy_gbps": gbps(nbytes, copy_s),
        "ratio_vs_raw": statistics.median(r / e for r, e in zip(raw, e2e, strict=True)),
        "overhead_ms": 1e3 * statistics.median(e - r for r, e in zip(raw, e2e, strict=True)),
        "ratio_vs_memcpy": copy_s / e2e_s, "raw_vs_memcpy": copy_s / raw_s,
        "plan_share": plan_s / e2e_s, "e2e_samples_s": e2e, "raw_samples_s": raw,
        "e2e_checksums_s": statistics.median(summed),
        "e2e_checksums_gbps": gbps(nbytes, statistics.median(summed)),
        "checksum_share": statistics.median(shares), "e2e_checksums_samples_s": summed,
        "checksum_share_samples": shares,
        "max_tick_gap_ms": max(gaps), "max_tick_gap_samples_ms": gaps, "repeat": repeat,
        **({"idle_tick_gap_ms": max(idle), "idle_tick_gap_samples_ms": idle} if idle else {}),
    }


def transfer_jobs(sizes: Sizes, indexer_layout: str = "uniform"
                  ) -> list[tuple[Geometry, list[tuple[str, str, int, int]]]]:
    """Per geometry (pool sized for its largest point): (sweep, pattern, pages per request,
    requests) points. Both sides hold one such pool; the bench process also two memcpy buffers.
    ``indexer_layout`` is the GLM-5.2 layer sweep's; the layer-sets sweep runs GLM-5.2, all 78
    layers, in both layouts."""
    deepseek = [("length", "contiguous", t // PAGE, 1, "direct") for t in sizes.lengths]
    deepseek += route_points(sizes)
    deepseek += [("concurrency", "contiguous", sizes.concurrency_tokens // PAGE, c, "direct")
                 for c in sizes.concurrency]
    jobs = [(("deepseek-v3.2", 61, "fp8"), deepseek),
            (("deepseek-v3.2", sizes.long_layers, "fp8"),
             [("length_long", "contiguous", t // PAGE, 1, "direct") for t in sizes.long_lengths])]
    jobs = [(*job, "uniform") for job in jobs]
    jobs += [(("glm-5.2", n, "fp8_raw"),
              [("layers", "contiguous", sizes.sweep_tokens // PAGE, 1, "direct")],
              indexer_layout) for n in sizes.layer_counts]
    jobs += [(("glm-5.2", 78, "fp8_raw"),
              [("layer_sets", "contiguous", sizes.sweep_tokens // PAGE, 1, "direct")],
              layout) for layout in ("uniform", "compact")]
    out = []
    for (model, layers, kv_dtype), points, layout in jobs:
        pages = max(pool_pages(pattern, n * k) for _, pattern, n, k, _ in points)
        out.append((Geometry(model, layers, kv_dtype, pool_tokens=pages * PAGE,
                             indexer_layout=layout), points))
    return out


def route_points(sizes: Sizes) -> list[tuple[str, str, int, int, str]]:
    """The route sweeps (page patterns, pages per descriptor) on each route, ``auto`` after the
    two forced ones: it weighs what the node timed of both (contiguous direct is the length
    sweep's point)."""
    order = (*ROUTES[1:], ROUTES[0])
    points = [("descriptors", p, sizes.sweep_tokens // PAGE, 1, route)
              for p in PATTERNS for route in order if p != "contiguous" or route != "direct"]
    return points + [("crossover", f"runs_{n}", sizes.sweep_tokens // PAGE, 1, route)
                     for n in sizes.crossover_runs for route in order]


def run_transfers(sizes: Sizes, backends: list[str], indexer_layout: str = "uniform"
                  ) -> tuple[list[dict], dict[str, str]]:
    """Every transfer point on every backend: rows, and the transport each backend used."""
    rows, transports = [], {}
    child = start_child()
    try:
        for backend in backends:
            for geometry, points in transfer_jobs(sizes, indexer_layout):
                transports[backend] = measure_geometry(child, backend, geometry, points,
                                                       sizes.repeat, rows)
    finally:
        child.stop()
    return rows, transports


def measure_geometry(child: Driven, backend: str, geometry: Geometry, points: list,
                     repeat: int, rows: list[dict]) -> str:
    """The points of one geometry, appended to ``rows``; returns the transport. Its pools and
    memcpy buffers are gone when it returns, before the next geometry allocates its own."""
    session = TransferSession(child, backend, geometry)
    memcpy = Memcpy()
    try:
        for sweep, pattern, pages, count, route in points:
            rounds = max(repeat, CONCURRENCY_REPEAT) if sweep == "concurrency" else repeat
            row = {"backend": backend, "sweep": sweep, "pattern": pattern,
                   **measure(session, memcpy, page_ids(pattern, pages, count), rounds,
                             idle_probe=sweep == "length", route=route)}
            rows.append(row)
            progress(f"{backend} {geometry.model} x{geometry.layers} {geometry.indexer_layout} "
                     f"{sweep} {row['tokens']} "
                     f"tokens x{count} {pattern} {route}: end-to-end {row['e2e_gbps']:.2f} GB/s, raw "
                     f"{row['raw_gbps']:.2f} ({row['ratio_vs_raw']:.2f}x), memcpy "
                     f"{row['memcpy_gbps']:.1f}")
        return session.transport
    finally:
        session.close()
        memcpy.free()
        trim_heap()


def hand_built_buffers(layout: DSALayout, pages: int, base: int) -> list[BufferDescriptor]:
    """Buffers of ``pages`` pages (plus padding) at made-up addresses: the planner only does math."""
    buffers, ptr = [], base
    for layer in layout.layer_ids:
        for kind, item_len in (("kv", layout.kv_page_bytes), ("index", layout.index_page_bytes)):
            nbytes = (pages + 1) * item_len
            buffers.append(BufferDescriptor(layer, kind, ptr, nbytes, item_len))
            ptr += nbytes + 4096
    return buffers


def plan_cost(sizes: Sizes) -> list[dict]:
    """``plan_writes`` of one DeepSeek-V3.2 request (61 layers, both caches), per page pattern."""
    layout = DSALayout.preset("deepseek-v3.2")
    most = pool_pages("per_page", max(sizes.plan_lengths) // PAGE)
    pairs = pair_buffers(hand_built_buffers(layout, most, 1 << 40),
                         hand_built_buffers(layout, most, 1 << 44))
    rows = []
    for tokens in sizes.plan_lengths:
        for pattern in PATTERNS:
            src, dst = page_ids(pattern, max(1, tokens // PAGE))[0]
            plan = plan_writes(pairs, src, dst)
            seconds = timed(lambda src=src, dst=dst: plan_writes(pairs, src, dst), sizes.repeat)
            rows.append({"tokens": tokens, "pattern": pattern, "pages": int(src.size),
                         "runs": plan.runs, "descriptors": plan.descriptors,
                         "bytes": plan.nbytes, "seconds": seconds})
    progress(f"planning: {len(rows)} points, at most {max(r['seconds'] for r in rows) * 1e3:.2f} ms")
    return rows


def token_locs(pattern: str, tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(source, target) token locations, disjoint, inside a pool of ``2 * tokens`` tokens."""
    pages = tokens // PAGE
    if pattern == "scattered":  # single tokens anywhere, as speculative decoding moves them
        perm = np.random.default_rng(seed).permutation(2 * tokens) + PAGE
        src, tgt = perm[:tokens], perm[tokens:]
    else:  # a request's tokens: whole pages, in one run or in allocator blocks
        src_pages, dst_pages = page_ids(pattern, pages)[0]
        offsets = np.arange(PAGE)
        src = (src_pages[:, None] * PAGE + offsets).ravel()
        tgt = ((dst_pages + pages)[:, None] * PAGE + offsets).ravel()
    return torch.from_numpy(src.astype(np.int64)), torch.from_numpy(tgt.astype(np.int64))


def pool_ops(sizes: Sizes) -> list[dict]:
    """Each pool operation on ``pool_tokens`` tokens of DeepSeek-V3.2 (61 layers), per pattern,
    against a memmove of the same bytes (the tokens' cache: KV and indexer, every layer)."""
    pool = DSATokenToKVPool.from_layout(DSALayout.preset("deepseek-v3.2"),
                                        size=2 * sizes.pool_tokens)
    memcpy = Memcpy()
    rows = []
    for pattern in LOC_PATTERNS:
        rows += pool_op_rows(pool, memcpy, pattern, sizes.pool_tokens, max(sizes.repeat, POOL_REPEAT))
    return rows


def pool_op_rows(pool: DSATokenToKVPool, memcpy: Memcpy, pattern: str, tokens: int,
                 repeat: int) -> list[dict]:
    """The three operations on one pattern of token locations, each after two warm-up calls and
    each call followed by a memmove of the same bytes, then by a memmove of them in the pool's
    pieces. Warm on both sides: the pool, the copy ``load_cpu_copy`` reads and the one
    ``get_cpu_copy`` writes into (``out=``, reused as a host cache pool does) and the memmove's
    buffers have all been written before. ``get_cpu_copy`` without ``out`` allocates its result,
    so it is also set against memmoves of the pieces into new allocations of theirs: fresh on
    both sides. Ratios are medians of the back-to-back pairs."""
    src, tgt = token_locs(pattern, tokens)
    copy = pool.get_cpu_copy(src)
    lay = pool.layout
    nbytes = tokens * lay.bytes_per_token
    pieces = [tokens * w for _ in lay.layer_ids
              for w in (lay.kv_row_bytes, lay.index_head_dim, lay.index_scale_bytes)]
    ops = {"move_kv_cache": lambda: pool.move_kv_cache(tgt, src),
           "get_cpu_copy": lambda: pool.get_cpu_copy(src, out=copy),
           "load_cpu_copy": lambda: pool.load_cpu_copy(copy, tgt)}
    rows = []
    for op, run in ops.items():
        run()
        run()
        seconds, copies, in_pieces, fresh, fresh_copies, faults = [], [], [], [], [], []
        for _ in range(repeat):
            start = time.perf_counter()
            run()
            seconds.append(time.perf_counter() - start)
            copies.append(memcpy.seconds(nbytes))
            in_pieces.append(memcpy.pieces_seconds(pieces))
            if op == "get_cpu_copy":
                before, start = minor_faults(), time.perf_counter()
                pool.get_cpu_copy(src)
                fresh.append(time.perf_counter() - start)
                middle = minor_faults()
                fresh_copies.append(memcpy.pieces_seconds(pieces, fresh=True))
                faults.append((middle - before, minor_faults() - middle))
        op_s = statistics.median(seconds)
        row = {"op": op, "pattern": pattern, "tokens": tokens, "layers": lay.num_layers,
               "threads": torch.get_num_threads(), "bytes": nbytes, "seconds": op_s,
               "gbps": gbps(nbytes, op_s),
               "memcpy_gbps": gbps(nbytes, statistics.median(copies)),
               "ratio_vs_memcpy": pair_ratio(copies, seconds),
               "pieces_memcpy_gbps": gbps(nbytes, statistics.median(in_pieces)),
               "ratio_vs_pieces_memcpy": pair_ratio(in_pieces, seconds),
               "samples_s": seconds, "memcpy_samples_s": copies}
        if fresh:
            row["fresh_gbps"] = gbps(nbytes, statistics.median(fresh))
            row["fresh_memcpy_gbps"] = gbps(nbytes, statistics.median(fresh_copies))
            row["ratio_vs_fresh_memcpy"] = pair_ratio(fresh_copies, fresh)
            # page faults per call (4 KiB pages: ~bytes / 4096 when the memory was new)
            row["fresh_faults"] = statistics.median(f for f, _ in faults)
            row["fresh_memcpy_faults"] = statistics.median(f for _, f in faults)
        rows.append(row)
        progress(f"pool {op} {pattern} {tokens} tokens: {row['gbps']:.2f} GB/s, "
                 f"{row['ratio_vs_memcpy']:.2f}x memcpy, {row['ratio_vs_pieces_memcpy']:.2f}x "
                 f"memcpy in pieces")
    return rows


def minor_faults() -> int:
    """This process's minor page faults so far (first touches of new memory)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def pair_ratio(baseline: list[float], measured: list[float]) -> float:
    """Median of baseline / measured over back-to-back pairs (a drift of the load cancels)."""
    return statistics.median(b / m for b, m in zip(baseline, measured, strict=True))

