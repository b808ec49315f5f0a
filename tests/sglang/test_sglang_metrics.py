"""dsa-bridge's counters on sglang's own metrics endpoint (``plugin/sglang/rank_metrics.py``).

sglang's ``--enable-metrics`` sets ``PROMETHEUS_MULTIPROC_DIR`` before its schedulers start and
serves ``/metrics`` merged over every process that wrote there (``add_prometheus_middleware``).
Here two prefill ranks and two decode ranks, each its own process with that directory (as
sglang's), run one request per pair on both engines (``pd_rank.py``): one moved byte-exact, one
refused by decode (a prefix that is not whole pages). sglang's own endpoint, built by its own
``add_prometheus_middleware``, then serves dsa-bridge's series merged over the ranks of each
role: two requests, one failed by reason, the bytes of the one moved, the fence's gauges.
``increments``, the pure step from one reading to the next, alone first.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import require_engine

from .conftest import SGLANG_MISSING

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from dsa_bridge.plugin.sglang.rank_metrics import RankReading, increments  # noqa: E402
from dsa_bridge.transfer.counters import Stats  # noqa: E402

from .test_sglang_conn import config, run_ranks  # noqa: E402

MODEL = {"layers": 4, "model_layers": 4, "kv_cache_dim": 656}
PAGE_BYTES = 64 * (656 + 132) * 4  # KV and indexer rows of a page, every layer


def test_increments_are_the_growth_and_a_node_made_anew_starts_again():
    before = RankReading(Stats(requests_ok=3, bytes=100, failures={"checksum": 1}), forced_releases=1)
    now = RankReading(Stats(requests_ok=5, bytes=100, failures={"checksum": 2}), forced_releases=1)
    assert increments(before, now) == {("requests", "success"): 2, ("request_failures", "checksum"): 1}
    anew = RankReading(Stats(requests_ok=1, bytes=40))  # the node closed and made anew
    assert increments(now, anew) == {("requests", "success"): 1, ("transfer_bytes",): 40}
    assert increments(now, now) == {}


def scrape(multiproc_dir: str, monkeypatch) -> dict:
    """``GET /metrics`` of sglang's own endpoint over ``multiproc_dir``: (name, labels) -> value."""
    from sglang.srt.utils.common import add_prometheus_middleware
    from starlette.applications import Starlette

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", multiproc_dir)
    app = Starlette()  # sglang's HTTP server's app is a FastAPI, a Starlette
    add_prometheus_middleware(app)
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/metrics", "raw_path": b"/metrics",
             "query_string": b"", "headers": [], "root_path": "", "scheme": "http",
             "server": ("127.0.0.1", 80), "http_version": "1.1"}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 200
    text = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_sglangs_endpoint_serves_dsa_bridge_counters_merged_over_ranks(engine, tmp_path, monkeypatch):
    require_engine(engine)
    moved, refused = config(engine, MODEL), config(engine, MODEL, prefix_tokens=32)
    (p_moved, d_moved, p_refused, d_refused) = run_ranks(
        [("prefill", [moved]), ("decode", [moved]), ("prefill", [refused]), ("decode", [refused])],
        env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    assert p_moved[0]["poll"] == d_moved[0]["poll"] == 4
    assert p_refused[0]["poll"] == d_refused[0]["poll"] == 0
    got = scrape(str(tmp_path), monkeypatch)

    def value(name: str, role: str, **labels) -> float:
        return got[(f"dsa_bridge_{name}", tuple(sorted({"role": role, **labels}.items())))]

    moved_bytes = 5 * PAGE_BYTES + d_moved[0]["aux_bytes"]
    for role in ("prefill", "decode"):
        assert value("requests_total", role, state="success") == 1
        assert value("requests_total", role, state="failed") == 1
        assert sum(v for (name, labels), v in got.items() if name == "dsa_bridge_request_failures_total"
                   and ("role", role) in labels) == 1
        assert value("transfer_bytes_total", role) == moved_bytes
        assert value("engine_failures_total", role) == 0
    assert value("request_failures_total", "prefill", reason="aborted") == 1  # decode's refusal
    assert value("forced_releases_total", "decode") == 0
    assert value("pages_held", "decode") == 0 and value("pages_quarantined", "decode") == 0
