"""Load: hundreds of requests of mixed lengths, many in flight, from two decode nodes at once.

A ``dsa-bridge prefill`` process serves two ``dsa-bridge decode`` processes at once, 8 requests in
flight each. Every request must complete byte-exact, and the prefill's resident memory and open
file descriptors must stay flat under load: sampled once a quarter of the requests are done
(warm-up), then every 0.2 s while both decode nodes are busy, the peak RSS and the last fd count
are compared with the warm-up values. The short variant (Mooncake, an 8-layer DSA model, 250 requests)
runs by default; the long one (``-m soak``: DeepSeek-V3.2, 2,000 requests) on both engines.
"""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from dsa_bridge.transfer.backends import BACKENDS

from ..transfer.helpers import wait_for
from .netns import loopback_hosts
from .procs import decode, listening, prefill, summary

CATEGORY = "requests under load"
LO = loopback_hosts(1)[0]
RSS_SLACK = 64 << 20  # bytes: allocator and engine caches settle within this
FD_SLACK = 4
SMALL_MODEL = {"num_hidden_layers": 8, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
               "index_head_dim": 128}
PROGRESS = re.compile(r"\[decode\] (\d+)/\d+ ok")


def usage(pid: int) -> tuple[int, int]:
    """(resident bytes, open file descriptors) of a process."""
    with open(f"/proc/{pid}/status") as status:
        rss_kb = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return rss_kb << 10, len(os.listdir(f"/proc/{pid}/fd"))


def done(node) -> int:
    """Requests a running ``dsa-bridge decode`` has reported done (its progress line)."""
    found = PROGRESS.findall(node.output())
    return int(found[-1]) if found else 0


def model_options(tmp_path, model: str) -> tuple[str, ...]:
    if model == "small":
        path = tmp_path / "small-dsa.json"
        path.write_text(json.dumps(SMALL_MODEL))
        model = str(path)
    return ("--model", model)


def soak(backend: str, procs, ledger, tmp_path, *, model: str, requests: int,
         pool_pages: int) -> None:
    """Two decode nodes, ``requests`` each, 8 in flight each. Usage is sampled while both are
    connected and busy: at warm-up (a quarter of the requests done), at its peak, and last."""
    common = (*model_options(tmp_path, model), "--peer-timeout", "5", "--request-timeout", "120")
    server = prefill(procs, LO, backend, *common, "--pool-tokens", str(64 * pool_pages),
                     "--chunk-pages", "4")
    listening(procs, server)
    nodes = [decode(procs, LO, backend, server.endpoint, *common, "--pool-tokens",
                    str(64 * pool_pages // 2), "--requests", str(requests), "--concurrency", "8",
                    "--max-tokens", "768", "--seed", str(i), name=f"decode-{i}") for i in range(2)]
    wait_for(lambda: all(done(n) >= requests // 4 for n in nodes)
             or any(n.process.poll() is not None for n in nodes), 600, "the warm-up")
    warm = peak = last = usage(server.pid)
    while all(n.process.poll() is None for n in nodes):
        last = usage(server.pid)
        peak = (max(peak[0], last[0]), max(peak[1], last[1]))
        time.sleep(0.2)
    results = [summary(procs, node, 600) for node in nodes]
    assert server.stop() == 0
    counters = server.counters()
    total = sum(r["requests"] for r in results)
    ledger.record(tried=total, ok=sum(r["requests_ok"] for r in results),
                  failed=sum(r["requests_failed"] for r in results),
                  bytes_verified=sum(r["bytes_verified"] for r in results),
                  bytes_lost=sum(r["bytes_mismatched"] for r in results))
    for result in results:
        assert result["ok"] and result["bytes_mismatched"] == 0, result["failures"]
        assert result["sentinel_intact"]
    assert counters["requests_ok"] == total and counters["requests_failed"] == 0
    assert counters["bytes"] == sum(r["bytes_verified"] for r in results)
    mib = 1 << 20
    report = (f"rss warm {warm[0] / mib:.0f} MiB, peak {peak[0] / mib:.0f}, last "
              f"{last[0] / mib:.0f}; fds warm {warm[1]}, peak {peak[1]}, last {last[1]}")
    print(f"[soak {backend}] {total} requests; {report}")
    assert peak[0] <= warm[0] + RSS_SLACK and last[1] <= warm[1] + FD_SLACK, report


def test_short_soak(procs, ledger, tmp_path):
    soak("mooncake", procs, ledger, tmp_path, model="small", requests=125, pool_pages=256)


@pytest.mark.soak
@pytest.mark.parametrize("backend", BACKENDS)
def test_long_soak(backend, procs, ledger, tmp_path):
    soak(backend, procs, ledger, tmp_path, model="deepseek-v3.2", requests=1000, pool_pages=192)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_nodes_coming_and_going_leave_nothing_behind(backend, procs, ledger, tmp_path):
    """Decode nodes restart: after the second one leaves (and is dropped), the prefill holds as
    many descriptors as after the first one left."""
    common = (*model_options(tmp_path, "small"), "--pool-tokens", str(64 * 32), "--peer-timeout",
              "1")
    server = prefill(procs, LO, backend, *common)
    listening(procs, server)
    fds, results = [], []
    for round_no in range(2):
        node = decode(procs, LO, backend, server.endpoint, *common, "--requests", "2",
                      name=f"decode-{round_no}")
        results.append(summary(procs, node, 120))
        time.sleep(1.5)  # the prefill drops the departed node after 1 s of silence
        fds.append(usage(server.pid)[1])
    ledger.record(tried=sum(r["requests"] for r in results),
                  ok=sum(r["requests_ok"] for r in results),
                  bytes_verified=sum(r["bytes_verified"] for r in results),
                  bytes_lost=sum(r["bytes_mismatched"] for r in results))
    assert all(r["ok"] for r in results)
    assert fds[1] <= fds[0], f"open descriptors after each departure: {fds}"
