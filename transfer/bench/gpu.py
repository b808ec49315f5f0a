"""The ``gpu`` section of ``dsa-bridge bench``: issue 31's ratios on a CUDA device, each measured
in the same run beside its baseline, each with its target (``GPU_TARGETS``):

- ``move_kv_cache`` against torch's own device copy of the same bytes (one block);
- ``get_cpu_copy`` / ``load_cpu_copy`` against torch's device-to-host / host-to-device copy of the
  same bytes through pinned host memory;
- the device checksum (``checksum.page_checksums`` of every page of a request in every buffer:
  ``wsum64`` on CUDA) against the device's copy of the same bytes (GB/s over GB/s), and
  ``checksum_share`` of an end-to-end transfer with checksums on;
- end to end, device pool to device pool between two processes, against the raw engine on the
  same bytes (``ratio_vs_raw``), per engine;
- one page per descriptor against the contiguous request of the same length, per route (the
  staged route gathers on the device), the target on ``auto``'s.

Where torch sees no CUDA device the section says so (``skipped``) and measures nothing;
``device="cpu"`` runs the same code on the host (the smoke test, tests/gpu/test_gpu_bench.py).
Each pool operation and its baseline run back to back, synchronised, ``repeat`` pairs: ratios are
medians of the pairs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from .sizes import SIZES

GPU_TARGETS = {"move_kv_cache_vs_copy": 0.8, "get_cpu_copy_vs_pinned": 0.8,
               "load_cpu_copy_vs_pinned": 0.8, "checksum_vs_copy": 0.5, "checksum_share": 0.05,
               "ratio_vs_raw": 0.9, "per_page_vs_contiguous": 0.8}
AT_MOST = ("checksum_share",)  # the targets met from below
GPU_REPEAT = 7


def device_facts(device: str) -> dict:
    """The device and the software the figures were taken with."""
    import torch

    facts = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda}
    if device.startswith("cuda"):
        facts["name"] = torch.cuda.get_device_name(device)
        facts["memory_gib"] = round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1)
    return facts


def paired(op: Callable[[], object], baseline: Callable[[], object], sync: Callable[[], None],
           repeat: int) -> dict:
    """Seconds of ``op`` and of ``baseline``, back to back, ``repeat`` pairs after one warm-up
    each: medians, and the median of baseline / op over the pairs."""
    op(), baseline()
    sync()
    ops, bases = [], []
    for _ in range(repeat):
        for run, into in ((op, ops), (baseline, bases)):
            start = time.perf_counter()
            run()
            sync()
            into.append(time.perf_counter() - start)
    return {"seconds": statistics.median(ops), "baseline_seconds": statistics.median(bases),
            "ratio": statistics.median(b / o for b, o in zip(bases, ops, strict=True))}


def pool_figures(device: str, tokens: int, repeat: int) -> dict:
    """The pool operations and the device checksum on ``tokens`` tokens of DeepSeek-V3.2 (61
    layers, fp8), against torch's copies of the same bytes."""
    import numpy as np
    import torch

    from ...plugin import DSALayout, DSATokenToKVPool
    from ..checksum import algorithm_for, page_checksums
    from .measure import token_locs

    cuda = device.startswith("cuda")
    layout = DSALayout.preset("deepseek-v3.2")
    pool = DSATokenToKVPool.from_layout(layout, size=2 * tokens, device=device)
    src, tgt = (t.to(device) for t in token_locs("contiguous", tokens))
    nbytes = tokens * layout.bytes_per_token
    block = torch.ones(nbytes, dtype=torch.uint8, device=device)
    into = torch.empty_like(block)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    copy = pool.get_cpu_copy(src)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    pages = np.unique(src.cpu().numpy() // layout.page_size)
    algorithm = algorithm_for(device)
    views = [pool.page_view(layer, kind) for layer, kind in pool.buffer_keys()]
    summed = len(pages) * sum(v.shape[1] for v in views)
    out = {
        "tokens": tokens, "bytes": nbytes, "checksum_algorithm": algorithm,
        "move_kv_cache_vs_copy": paired(lambda: pool.move_kv_cache(tgt, src),
                                        lambda: into.copy_(block), sync, repeat),
        "get_cpu_copy_vs_pinned": paired(lambda: pool.get_cpu_copy(src, out=copy),
                                         lambda: host.copy_(block), sync, repeat),
        "load_cpu_copy_vs_pinned": paired(lambda: pool.load_cpu_copy(copy, tgt),
                                          lambda: into.copy_(host), sync, repeat),
    }
    checksum = paired(lambda: [page_checksums(v, pages, algorithm) for v in views],
                      lambda: into[:summed].copy_(block[:summed]), sync, repeat)
    checksum["bytes"] = summed
    out["checksum_vs_copy"] = checksum
    return out


def transfer_figures(device: str, backends: list[str], tokens: int, repeat: int,
                     progress: Callable[[str], None]) -> dict:
    """Per engine, device pool to device pool between two processes: the contiguous request
    (``ratio_vs_raw``, ``checksum_share``) and one page per descriptor on each route against it."""
    from .child import PAGE, Geometry, start_child
    from .measure import Memcpy, TransferSession, measure, page_ids, pool_pages, trim_heap

    pages = tokens // PAGE
    geometry = Geometry("deepseek-v3.2", 61, "fp8", pool_tokens=pool_pages("per_page", pages) * PAGE,
                        device=device)
    out: dict[str, dict] = {}
    child = start_child()
    try:
        for backend in backends:
            session, memcpy = TransferSession(child, backend, geometry), Memcpy()
            try:
                base = measure(session, memcpy, page_ids("contiguous", pages), repeat)
                entry = {"transport": session.transport, "ratio_vs_raw": base["ratio_vs_raw"],
                         "checksum_share": base["checksum_share"], "e2e_gbps": base["e2e_gbps"],
                         "raw_gbps": base["raw_gbps"], "bytes": base["bytes"], "per_page": {}}
                for route in ("direct", "staged", "auto"):
                    row = measure(session, memcpy, page_ids("per_page", pages), repeat, route=route)
                    entry["per_page"][route] = {"vs_contiguous": row["e2e_gbps"] / base["e2e_gbps"],
                                                "route_taken": row["route_taken"],
                                                "e2e_gbps": row["e2e_gbps"]}
                out[backend] = entry
                progress(f"gpu {backend} ({session.transport}): end-to-end "
                         f"{entry['e2e_gbps']:.2f} GB/s, {entry['ratio_vs_raw']:.2f}x raw, "
                         f"checksum_share {entry['checksum_share']:.3f}, one page per "
                         f"descriptor on auto {entry['per_page']['auto']['vs_contiguous']:.2f}x")
            finally:
                session.close()
                memcpy.free()
                trim_heap()
    finally:
        child.stop()
    return out


def targets_met(pool: dict, transfers: dict) -> dict:
    """Each target, per engine where it is an engine's."""
    def meets(name: str, value: float) -> bool:
        target = GPU_TARGETS[name]
        return value <= target if name in AT_MOST else value >= target

    met = {name: meets(name, pool[name]["ratio"]) for name in
           ("move_kv_cache_vs_copy", "get_cpu_copy_vs_pinned", "load_cpu_copy_vs_pinned",
            "checksum_vs_copy")}
    for name in ("ratio_vs_raw", "checksum_share"):
        met[name] = {b: meets(name, e[name]) for b, e in transfers.items()}
    met["per_page_vs_contiguous"] = {
        b: meets("per_page_vs_contiguous", e["per_page"]["auto"]["vs_contiguous"])
        for b, e in transfers.items()}
    return met


def run_section(size: str, backends: list[str], progress: Callable[[str], None],
                device: str | None = None) -> dict:
    """The section on ``device`` (default: the first CUDA device; without one, skipped)."""
    import torch

    if device is None:
        if not torch.cuda.is_available():
            progress("gpu: skipped: no CUDA (torch.cuda.is_available() is False)")
            return {"skipped": "no CUDA"}
        device = "cuda:0"
    sizes = SIZES[size]
    repeat = max(sizes.repeat, 3)
    started = time.monotonic()
    pool = pool_figures(device, sizes.pool_tokens, max(repeat, GPU_REPEAT))
    progress(f"gpu pool on {device}: move_kv_cache {pool['move_kv_cache_vs_copy']['ratio']:.2f}x "
             f"copy, get_cpu_copy {pool['get_cpu_copy_vs_pinned']['ratio']:.2f}x, load_cpu_copy "
             f"{pool['load_cpu_copy_vs_pinned']['ratio']:.2f}x pinned, checksum "
             f"{pool['checksum_vs_copy']['ratio']:.2f}x copy")
    transfers = transfer_figures(device, backends, sizes.sweep_tokens, repeat, progress)
    return {"size": size, "repeat": repeat, "machine": device_facts(device),
            "seconds": round(time.monotonic() - started, 1), "pool": pool,
            "transfers": transfers, "targets": GPU_TARGETS,
            "targets_met": targets_met(pool, transfers)}


def print_section(section: dict) -> None:
    if "skipped" in section:
        print(f"\ngpu: skipped: {section['skipped']}")
        return
    facts = section["machine"]
    print(f"\ngpu ({section['size']}, {facts.get('name', facts['device'])}, torch {facts['torch']}, "
          f"CUDA {facts['cuda']}, {section['seconds']:.0f} s)")
    for name, figure in section["pool"].items():
        if isinstance(figure, dict):
            print(f"{name}: {figure['ratio']:.2f} (target {GPU_TARGETS[name]})")
    for backend, entry in section["transfers"].items():
        routes = ", ".join(f"{r} {v['vs_contiguous']:.2f}x ({v['route_taken']})"
                           for r, v in entry["per_page"].items())
        print(f"{backend} ({entry['transport']}): ratio_vs_raw {entry['ratio_vs_raw']:.2f}, "
              f"checksum_share {entry['checksum_share']:.3f}, one page per descriptor: {routes}")
    print(f"targets met: {section['targets_met']}")
