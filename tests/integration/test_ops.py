"""Operability over real engines in real processes: end-to-end checksums catch a byte flipped
after the write, and the Prometheus endpoints of live ``dsa-bridge prefill`` and ``decode``
processes count what they ran."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dsa_bridge.transfer.backends import BACKENDS, create_backend
from dsa_bridge.transfer.decode import DecodeNode
from dsa_bridge.transfer.request import KVPoll
from tests.faulty import DELAY_ENV, FLIP_ENV

from ..conftest import require_engine
from ..ports import free_port
from ..transfer.helpers import wait_for
from .processes import NODE_ENV, PrefillProcess, cli
from .test_two_process import DEEPSEEK, POOL_TOKENS, decode_pool, run

BUFFERS = 2 * DEEPSEEK.num_layers
PAGE_BYTES = DEEPSEEK.kv_page_bytes + DEEPSEEK.index_page_bytes


@pytest.mark.parametrize("backend", BACKENDS)
def test_checksums_catch_a_byte_flipped_after_the_write(backend, tmp_path, monkeypatch):
    require_engine(backend)
    monkeypatch.setenv(FLIP_ENV, "1")  # every write of the prefill process flips one byte
    prefill = PrefillProcess(tmp_path, backend, "--pool-tokens", str(POOL_TOKENS), "--checksums",
                             "--chunk-pages", "16")
    try:
        with DecodeNode(decode_pool(), create_backend(backend), prefill.endpoint,
                        checksums=True) as node:
            [(one, _)] = run(node, [(1, [7])])
            assert one.poll() == KVPoll.Failed
            # the flipped byte is the last of the middle descriptor: of the 122 one-page
            # descriptors (61 layers, kv then index), the 62nd, layer 30's indexer page
            assert str(one.failure_exception()) == (
                "room 1: checksum mismatch: layer 30 index cache, page 7 (page 0 of the request); "
                f"1 of {BUFFERS} checksums of the chunk differ")
            pages = np.random.default_rng(6).permutation(np.arange(8, 96))[:40]
            [(many, _)] = run(node, [(2, pages.tolist())])
            assert many.poll() == KVPoll.Failed
            found = re.search(r"checksum mismatch: layer (\d+) (kv|index) cache, page (\d+) "
                              r"\(page (\d+) of the request\)", str(many.failure_exception()))
            assert found, many.failure_exception()
            layer, page, index = int(found[1]), int(found[3]), int(found[4])
            assert 0 <= layer < 61 and pages[index] == page
            wait_for(lambda: one.can_release() and many.can_release(), 15.0,
                     "pages released once prefill confirmed the aborts")
            snapshot = node.counters.snapshot()
            assert snapshot["requests_ok"] == 0
            assert snapshot["failures"] == {"checksum": 2}
    finally:
        prefill.stop()
    assert "TEST-ONLY fault: flipped the byte" in Path(prefill.log.name).read_text()


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of the endpoint: (name, sorted label items) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_live_prefill_node_exports_what_it_ran(tmp_path):
    require_engine("mooncake")
    port = free_port()
    prefill = PrefillProcess(tmp_path, "mooncake", "--pool-tokens", str(POOL_TOKENS), "--checksums",
                             "--peer-timeout", "2", "--metrics-port", str(port))
    try:
        before = scrape(port)
        assert before[("dsa_bridge_requests_total", (("state", "success"),))] == 0
        assert before[("dsa_bridge_peers_connected", ())] == 0
        result = subprocess.run(
            cli("decode", "--prefill", prefill.endpoint, "--requests", "5", "--pool-tokens",
                str(POOL_TOKENS), "--max-tokens", "2048", "--checksums", "--json"),
            capture_output=True, text=True, timeout=240, env={**os.environ, **NODE_ENV})
        assert result.returncode == 0, result.stderr[-3000:]
        summary = json.loads(result.stdout.strip().splitlines()[-1])
        assert summary["requests_ok"] == 5

        metrics = scrape(port)
        assert metrics[("dsa_bridge_requests_total", (("state", "success"),))] == 5
        assert metrics[("dsa_bridge_requests_total", (("state", "failed"),))] == 0
        assert metrics[("dsa_bridge_transfer_bytes_total", ())] == summary["bytes_verified"]
        assert (metrics[("dsa_bridge_transfer_descriptors_total", ())]
                == summary["counters"]["descriptors"])
        assert (metrics[("dsa_bridge_checksums_total", (("op", "computed"),))]
                == summary["checksums_verified"] == summary["bytes_verified"] // PAGE_BYTES * 2)
        assert metrics[("dsa_bridge_transfer_latency_seconds_count", ())] == 5
        assert metrics[("dsa_bridge_transfer_latency_seconds_bucket", (("le", "+Inf"),))] == 5
        assert metrics[("dsa_bridge_handshakes_total", (("result", "ok"),))] == 1
        assert all(metrics[("dsa_bridge_request_failures_total", (("reason", r),))] == 0
                   for r in ("timeout", "checksum", "engine", "other"))
        wait_for(lambda: scrape(port)[("dsa_bridge_peers_connected", ())] == 0, 15.0,
                 "the departed decode node dropped")
    finally:
        prefill.stop()


def test_a_live_decode_node_exports_its_metrics(tmp_path, monkeypatch):
    require_engine("mooncake")
    monkeypatch.setenv(DELAY_ENV, "400")  # slow writes keep the decode run alive to be scraped
    prefill = PrefillProcess(tmp_path, "mooncake", "--pool-tokens", str(POOL_TOKENS),
                             "--chunk-pages", "4")
    port = free_port()
    decode = subprocess.Popen(
        cli("decode", "--prefill", prefill.endpoint, "--requests", "4", "--concurrency", "1",
            "--pool-tokens", str(POOL_TOKENS), "--max-tokens", "1024", "--metrics-port", str(port),
            "--json"),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, stdin=subprocess.DEVNULL,
        env={**os.environ, **NODE_ENV})
    try:
        def live():
            try:
                return scrape(port)
            except OSError:
                assert decode.poll() is None, "decode exited before its metrics were scraped"
                time.sleep(0.05)
                return None

        metrics = wait_for(live, 120.0, "decode's metrics endpoint")
        assert metrics[("dsa_bridge_peers_connected", ())] == 1
        assert metrics[("dsa_bridge_pages_held", ())] == 0
        assert metrics[("dsa_bridge_requests_total", (("state", "failed"),))] == 0
        assert 0 <= metrics[("dsa_bridge_requests_total", (("state", "success"),))] <= 4
        assert ("dsa_bridge_node_info", (("backend", "mooncake"), ("name", f"decode-{decode.pid}"),
                                         ("role", "decode"))) in metrics
        out, _ = decode.communicate(timeout=240)
        assert decode.returncode == 0
        assert json.loads(out.strip().splitlines()[-1])["requests_ok"] == 4
    finally:
        if decode.poll() is None:
            decode.kill()
            decode.wait(10)
        prefill.stop()
