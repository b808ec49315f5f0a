"""The bench's ``gpu`` section: without CUDA it says so and measures nothing; its code path runs
on the CPU at the tiny size (``device="cpu"``: every figure there, positive, with its target and
whether it is met) and on CUDA where there is a device. Never how fast anything is."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from dsa_bridge.transfer.backends import BACKENDS
from dsa_bridge.transfer.bench.gpu import GPU_TARGETS, run_section

from ..conftest import engine_problem

POOL_FIGURES = ("move_kv_cache_vs_copy", "get_cpu_copy_vs_pinned", "load_cpu_copy_vs_pinned",
                "checksum_vs_copy")


def test_the_section_runs_every_figure(device):
    backends = [name for name in BACKENDS if engine_problem(name) is None]
    if not backends:
        pytest.skip("no transfer engine starts on this machine")
    section = run_section("tiny", backends, lambda text: None, device=device)
    assert section["machine"]["device"] == device and section["targets"] == GPU_TARGETS
    if device != "cpu":
        assert section["machine"]["name"]
    pool = section["pool"]
    for name in POOL_FIGURES:
        figure = pool[name]
        assert figure["ratio"] > 0 and figure["seconds"] > 0 and figure["baseline_seconds"] > 0
        assert isinstance(section["targets_met"][name], bool)
    assert pool["checksum_algorithm"] == ("xxh3_64" if device == "cpu" else "wsum64")
    assert set(section["transfers"]) == set(backends)
    for backend, entry in section["transfers"].items():
        assert entry["ratio_vs_raw"] > 0 and entry["checksum_share"] > 0 and entry["transport"]
        assert set(entry["per_page"]) == {"direct", "staged", "auto"}
        assert entry["per_page"]["staged"]["route_taken"] == "staged"
        assert all(v["vs_contiguous"] > 0 for v in entry["per_page"].values())
        for name in ("ratio_vs_raw", "checksum_share", "per_page_vs_contiguous"):
            assert isinstance(section["targets_met"][name][backend], bool)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_the_bench_says_so():
    result = subprocess.run(
        [sys.executable, "-m", "dsa_bridge.transfer.launcher.cli", "bench", "--tiny", "--json",
         "--sections", "gpu", "--backends", "nixl"],
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["gpu"] == {"skipped": "no CUDA"}
    assert "gpu: skipped: no CUDA" in result.stderr
