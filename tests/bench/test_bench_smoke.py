"""Smoke test of ``dsa-bridge bench``: the whole code path at its tiny size, in a real process.

Benchmarks are not timed tests: this checks that the report has every key, that every figure is
positive and every descriptor count exact, that stdout holds nothing but the JSON (NIXL and UCX
log to stdout), and that the plots are written — never how fast anything is. And that the quick
and full runs measure the pool on the request length the docs report.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dsa_bridge.transfer.backends import BACKENDS
from dsa_bridge.transfer.bench.measure import CONCURRENCY_REPEAT
from dsa_bridge.transfer.bench.sizes import SIZES

from ..conftest import require_engine

TIMEOUT_S = 240  # one engine took 46 s with the load average at 22

ROW_FIGURES = ("bytes", "descriptors", "e2e_s", "raw_s", "memcpy_s", "plan_s", "e2e_gbps",
               "raw_gbps", "memcpy_gbps", "ratio_vs_raw", "ratio_vs_memcpy", "raw_vs_memcpy",
               "plan_share", "e2e_checksums_s", "e2e_checksums_gbps", "checksum_share")


def test_quick_and_full_runs_measure_the_pool_on_the_requests_the_docs_report():
    """docs/benchmarks.md reports the pool operations on 8K tokens, from either run."""
    assert SIZES["quick"].pool_tokens == SIZES["full"].pool_tokens == 8192


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_bench_reports_every_figure(backend, tmp_path):
    """One engine a run, so that the two runs go side by side under ``-n``."""
    pytest.importorskip("matplotlib", reason="the plots need matplotlib (the dev extra)")
    require_engine(backend)
    backends = [backend]
    result = subprocess.run(
        [sys.executable, "-m", "dsa_bridge.transfer.launcher.cli", "bench", "--tiny", "--json",
         "--backends", backend, "--plots", str(tmp_path)],
        capture_output=True, text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)  # fails if anything but the report reached stdout

    for key in ("ratio_vs_raw", "ratio_vs_raw_lowest", "plan_share", "checksum_share",
                "checksum_share_highest"):
        assert set(report[key]) == set(backends), key
        assert all(value > 0 for value in report[key].values()), key
    for key in ("pool_vs_memcpy", "pool_vs_memcpy_lowest", "pool_vs_pieces_memcpy"):
        assert set(report[key]) == {"move_kv_cache", "get_cpu_copy", "load_cpu_copy"}, key
        assert all(value > 0 for value in report[key].values()), key
    assert report["get_cpu_copy_vs_fresh_memcpy"] > 0
    assert report["targets_met"]["descriptors_exact"] is True
    assert set(report["transports"]) == set(backends)
    for key in ("max_tick_gap_ms", "idle_tick_gap_ms", "concurrent_ratio_vs_raw"):
        assert set(report[key]) == set(backends), key
    for backend in backends:  # GLM-5.2: 78 KV + 21 indexer buffers against 78 + 78
        ratios = report["compact_vs_uniform"][backend]
        assert ratios["bytes_ratio"] == (78 * 36_864 + 21 * 8448) / (78 * 36_864 + 78 * 8448)
        assert ratios["seconds_ratio"] > 0

    sweeps = {"length", "length_long", "descriptors", "concurrency", "layers", "layer_sets",
              "crossover"}
    for backend in backends:
        rows = [r for r in report["transfer"] if r["backend"] == backend]
        assert {r["sweep"] for r in rows} == sweeps
        assert {r["pattern"] for r in rows} == {"contiguous", "fragmented", "per_page", "runs_2"}
        routes = report["routes"][backend]  # every pattern on each route, against contiguous
        assert set(routes) == {"contiguous", "fragmented", "per_page", "runs_2"}
        for entry in routes.values():
            assert all(entry[route]["vs_contiguous"] > 0 for route in ("direct", "staged", "auto"))
            assert entry["auto"]["route_taken"] in ("direct", "staged", "mixed")
            assert entry["faster"] in ("direct", "staged") and entry["auto_vs_faster"] > 0
        assert report["auto_vs_faster_lowest"][backend] > 0
        assert set(report["fragmented_vs_contiguous"][backend]) == {"fragmented", "per_page"}
    assert 0 < report["staged_descriptors_per_request"] <= 64
    assert report["staging_bytes"] > 0
    for row in report["transfer"]:
        assert all(row[key] > 0 for key in ROW_FIGURES), row
        if row["route"] != "auto":
            assert row["route_taken"] == row["route"]  # forced either way
        if row["route"] == "staged":  # one descriptor per slice
            assert row["descriptors"] == row["descriptors_expected"] == row["staging_slices"]
        elif row["route"] == "direct":
            assert row["descriptors"] == row["runs"] * row["buffers"]
        assert row["descriptors"] == row["descriptors_expected"]
        rounds = report["repeat"]
        if row["sweep"] == "concurrency":
            rounds = max(rounds, CONCURRENCY_REPEAT)
        assert len(row["e2e_samples_s"]) == len(row["raw_samples_s"]) == row["repeat"] == rounds
        assert len(row["checksum_share_samples"]) == rounds
        if row["sweep"] == "length":  # the machine's own tick gap, next to the control thread's
            assert len(row["idle_tick_gap_samples_ms"]) == rounds
            assert row["idle_tick_gap_ms"] == max(row["idle_tick_gap_samples_ms"])
            tick_ms = {"mooncake": 10, "nixl": 2}[row["backend"]]  # the engine's tick_ms
            assert min(row["idle_tick_gap_samples_ms"]) >= tick_ms * 0.95  # a wait each pass
    for row in report["plan"]:
        assert row["seconds"] > 0 and row["descriptors"] == row["runs"] * 61 * 2
        assert all(share > 0 for share in row["share"].values())
    assert report["pool_threads"] >= 1
    for row in report["pool_ops"]:
        assert row["seconds"] > 0 and row["gbps"] > 0 and row["ratio_vs_memcpy"] > 0
        assert row["ratio_vs_pieces_memcpy"] > 0 and row["threads"] == report["pool_threads"]
        assert len(row["samples_s"]) == len(row["memcpy_samples_s"]) >= 3
        if row["op"] == "get_cpu_copy":
            assert row["fresh_gbps"] > 0 and row["ratio_vs_fresh_memcpy"] > 0
            assert {"fresh_faults", "fresh_memcpy_faults"} <= row.keys()

    assert sorted(p.name for p in tmp_path.glob("*.png")) == [
        "bench_gbps_vs_length.png", "bench_plan_cost.png"]


def test_the_idle_cpu_script_reports_each_control_thread_of_a_real_node_pair():
    """``scripts/idle-cpu`` (docs/sglang.md's idle figures): a real prefill and decode node over
    Mooncake, idle for a second; one line with both threads' ms of CPU a second (not how many:
    that is a measurement, not a test)."""
    require_engine("mooncake")
    script = Path(__file__).resolve().parents[2] / "scripts" / "idle-cpu"
    done = subprocess.run([sys.executable, str(script), "--engines", "mooncake", "--seconds", "1"],
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-2000:]
    line, = [ln for ln in done.stdout.splitlines() if ln.startswith("mooncake:")]
    figures = re.fullmatch(r"mooncake: idle control thread CPU, ms a second: "
                           r"prefill (\d+\.\d), decode (\d+\.\d)", line)
    assert figures is not None, line
    assert all(0 <= float(f) < 1000 for f in figures.groups())
