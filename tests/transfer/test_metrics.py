"""Metrics: failure reasons reduced to fixed categories, the latency histogram, the per-write
histograms, one endpoint serving several ranks' merged stats, and each node's Prometheus endpoint
scraped over HTTP on 127.0.0.1 (nodes over the in-process engine; live ``dsa-bridge`` processes in
tests/integration/test_ops.py)."""

from __future__ import annotations

import argparse
import contextlib
import socket
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dsa_bridge.transfer import metrics
from dsa_bridge.transfer.counters import (
    CATEGORIES,
    LATENCY_BUCKETS,
    WRITE_BYTES_BUCKETS,
    WRITE_DESCRIPTORS_BUCKETS,
    Counters,
    Stats,
    failure_category,
    merge,
)
from dsa_bridge.transfer.decode import DecodeNode
from dsa_bridge.transfer.launcher.cli import main
from dsa_bridge.transfer.launcher.drivers import fill_request
from dsa_bridge.transfer.prefill import PrefillNode
from dsa_bridge.transfer.request import KVPoll

from .fake_backend import FakeBackend
from .helpers import make_pool, wait_for


@pytest.mark.parametrize(("reason", "category"), [
    ("prefill: engine write failed: mooncake write failed peer=x code=-1: boom", "engine"),
    ("timed out after 60s", "timeout"),
    ("prefill: aborted by decode: timed out after 60s", "timeout"),
    ("decode run deadline passed", "timeout"),
    ("prefill 127.0.0.1:7000 unreachable (no heartbeat for 5.0s)", "peer_lost"),
    ("decode re-handshaked", "peer_lost"),
    ("aborted by prefill", "aborted"),
    ("prefill: aborted by decode: client went away", "aborted"),
    ("checksum mismatch: layer 3 kv cache, page 9 (page 0 of the request); 1 of 8 differ", "checksum"),
    ("aborted by decode: checksum mismatch: layer 3 kv cache, page 9", "checksum"),
    ("prefill sent no checksums (is it running with --checksums?)", "checksum"),
    ("internal error verifying checksums: KeyError: 3", "internal"),
    ("prefill: bad pages: dst_pages contains page 5000, beyond the registered 97 pages", "bad_request"),
    ("page count mismatch: prefill has 3 pages, decode allocated 2", "bad_request"),
    ("prefill: duplicate room 7", "bad_request"),
    ("prefill: no prefill request for this room", "bad_request"),
    ("prefill: request needs 900 pages; the prefill pool has 95", "bad_request"),
    ("something nobody foresaw", "other"),
])
def test_failure_reasons_reduce_to_a_fixed_set(reason, category):
    assert failure_category(reason) == category
    assert category in CATEGORIES


def test_counters_record_latency_buckets_and_failures():
    counters = Counters()
    for seconds in (0.0005, 0.001, 0.3, 1000.0):
        counters.request_ok(seconds)
    counters.request_failed("timed out after 3s")
    counters.request_failed("prefill: timed out after 3s")
    snapshot = counters.snapshot()
    assert snapshot["requests_ok"] == 4 and snapshot["requests_failed"] == 2
    assert snapshot["failures"] == {"timeout": 2}
    expected = [0] * (len(LATENCY_BUCKETS) + 1)
    expected[0] = 2  # 0.0005 and 0.001 (le is inclusive)
    expected[LATENCY_BUCKETS.index(0.5)] = 1
    expected[-1] = 1  # past the last bound
    assert snapshot["latency_counts"] == expected
    assert snapshot["latency_seconds"] == pytest.approx(1000.3015)
    snapshot["failures"]["timeout"] = 99  # a copy
    assert counters.snapshot()["failures"] == {"timeout": 2}


def scrape(server) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://{server.endpoint}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture
def served():
    """Nodes over the fake engine, each with its own metrics endpoint; all closed afterwards."""
    closing = []

    def build(fail_every=0):
        prefill = PrefillNode(make_pool(), FakeBackend(fail_every=fail_every), peer_timeout_s=2.0,
                              heartbeat_s=0.1, checksums=True)
        closing.append(prefill)
        decode = DecodeNode(make_pool(size=64 * 24, sentinel=True), FakeBackend(),
                            prefill.endpoint, peer_timeout_s=2.0, heartbeat_s=0.1, checksums=True)
        closing.append(decode)
        servers = []
        for node, role in ((prefill, "prefill"), (decode, "decode")):
            server = metrics.MetricsServer("127.0.0.1", 0)
            server.watch(node, role)
            closing.append(server)
            servers.append(server)
        return prefill, decode, *servers

    yield build
    for thing in reversed(closing):
        thing.close()


def request(prefill, decode, room, src, dst):
    fill_request(prefill.pool, room, np.asarray(src))
    receiver = decode.receiver(room)
    receiver.init(dst)
    sender = prefill.sender(room)
    sender.init(len(src))
    sender.send(src)
    wait_for(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed) and sender.poll() in
             (KVPoll.Success, KVPoll.Failed), what="request end")
    return receiver


def test_both_nodes_export_exact_counts(served):
    prefill, decode, prefill_metrics, decode_metrics = served()
    page_bytes = decode.pool.layout.kv_page_bytes + decode.pool.layout.index_page_bytes
    for room, (src, dst) in enumerate([([1, 2, 3], [4, 5, 6]), ([9], [10]), ([7, 8], [2, 3])]):
        assert request(prefill, decode, room, src, dst).poll() == KVPoll.Success
    wrong = decode.receiver(3)
    wrong.init([11, 12])
    sender = prefill.sender(3)
    sender.init(3)  # prefill has 3 pages, decode allocated 2
    wait_for(lambda: wrong.poll() == KVPoll.Failed)

    for server, node, role in ((prefill_metrics, prefill, "prefill"),
                               (decode_metrics, decode, "decode")):
        got = scrape(server)
        assert got[("dsa_bridge_requests_total", (("state", "success"),))] == 3
        assert got[("dsa_bridge_transfer_bytes_total", ())] == 6 * page_bytes * 4
        assert got[("dsa_bridge_transfer_descriptors_total", ())] == 3 * 8  # 3 runs x 8 buffers
        assert got[("dsa_bridge_transfer_latency_seconds_count", ())] == 3
        assert got[("dsa_bridge_peers_connected", ())] == 1
        assert got[("dsa_bridge_handshakes_total", (("result", "ok"),))] == 1
        assert got[("dsa_bridge_checksum_seconds_total", ())] > 0
        assert got[("dsa_bridge_write_bytes_sum", ())] == 6 * page_bytes * 4
        assert got[("dsa_bridge_write_descriptors_sum", ())] == 3 * 8
        # one write per chunk in each histogram: the nodes record each write, not only its sums
        for histogram in ("seconds", "bytes", "descriptors"):
            assert got[(f"dsa_bridge_write_{histogram}_count", ())] == 3
        assert {labels for name, labels in got if name == "dsa_bridge_request_failures_total"} == {
            (("reason", category),) for category in CATEGORIES}
        assert got[("dsa_bridge_node_info", (("backend", "mooncake"), ("name", node.name),
                                             ("role", role)))] == 1
    assert scrape(prefill_metrics)[("dsa_bridge_checksums_total", (("op", "computed"),))] == 6 * 8
    got = scrape(decode_metrics)
    assert got[("dsa_bridge_checksums_total", (("op", "verified"),))] == 6 * 8
    assert got[("dsa_bridge_requests_total", (("state", "failed"),))] == 1
    assert got[("dsa_bridge_request_failures_total", (("reason", "bad_request"),))] == 1
    assert got[("dsa_bridge_pages_held", ())] == 0
    assert ("dsa_bridge_pages_held", ()) not in scrape(prefill_metrics)


def test_pages_a_failed_write_may_still_land_in_are_held(served):
    prefill, decode, _, decode_metrics = served(fail_every=1)
    receiver = request(prefill, decode, 1, [1, 2, 3], [4, 5, 6])
    assert receiver.poll() == KVPoll.Failed and not receiver.can_release()
    got = scrape(decode_metrics)
    assert got[("dsa_bridge_pages_held", ())] == 3
    assert got[("dsa_bridge_request_failures_total", (("reason", "engine"),))] == 1


def rank_stats(writes, oks=(), failures=()) -> Stats:
    counters = Counters()
    for seconds, nbytes, descriptors in writes:
        counters.record_write(seconds, nbytes, descriptors)
    for seconds in oks:
        counters.request_ok(seconds)
    for reason in failures:
        counters.request_failed(reason)
    counters.add(quarantines=1)
    return counters.stats()


def test_one_endpoint_serves_the_merged_stats_of_several_ranks():
    ranks = [rank_stats([(0.002, 4096, 8), (0.004, 4096, 8)], oks=[0.3], failures=["timed out"]),
             rank_stats([(0.5, 4**10, 100)], oks=[0.3, 2.0]),
             rank_stats([], failures=["checksum mismatch: page 1", "timed out after 9s"])]
    blobs = {rank: stats.encode() for rank, stats in enumerate(ranks)}  # as the ranks would send them
    with contextlib.closing(metrics.MetricsServer("127.0.0.1", 0)) as server:
        server.watch_stats(lambda: merge(*(Stats.decode(blob) for blob in blobs.values())), "decode")
        got = scrape(server)
        blobs[3] = rank_stats([(0.001, 1, 1)]).encode()  # a rank that joins: the next scrape sees it
        later = scrape(server)
    assert got[("dsa_bridge_requests_total", (("state", "success"),))] == 3
    assert got[("dsa_bridge_requests_total", (("state", "failed"),))] == 3
    assert got[("dsa_bridge_request_failures_total", (("reason", "timeout"),))] == 2
    assert got[("dsa_bridge_request_failures_total", (("reason", "checksum"),))] == 1
    assert got[("dsa_bridge_transfer_chunks_total", ())] == 3
    assert got[("dsa_bridge_transfer_bytes_total", ())] == 2 * 4096 + 4**10
    assert got[("dsa_bridge_quarantines_total", ())] == 3
    assert got[("dsa_bridge_transfer_latency_seconds_count", ())] == 3
    assert got[("dsa_bridge_transfer_latency_seconds_bucket", (("le", "0.25"),))] == 0
    assert got[("dsa_bridge_transfer_latency_seconds_bucket", (("le", "0.5"),))] == 2
    assert got[("dsa_bridge_transfer_latency_seconds_bucket", (("le", "2.5"),))] == 3
    assert got[("dsa_bridge_write_seconds_count", ())] == 3
    assert got[("dsa_bridge_write_seconds_sum", ())] == pytest.approx(0.506)
    assert got[("dsa_bridge_write_seconds_bucket", (("le", "0.0025"),))] == 1
    assert got[("dsa_bridge_write_seconds_bucket", (("le", "0.005"),))] == 2
    assert got[("dsa_bridge_write_seconds_bucket", (("le", "0.5"),))] == 3
    bytes_buckets = {labels[0][1]: value for (name, labels), value in got.items()
                     if name == "dsa_bridge_write_bytes_bucket"}
    assert len(bytes_buckets) == len(WRITE_BYTES_BUCKETS) + 1
    assert bytes_buckets["4096.0"] == 2 and bytes_buckets["262144.0"] == 2
    assert bytes_buckets["1.048576e+06"] == bytes_buckets["+Inf"] == 3
    assert got[("dsa_bridge_write_bytes_sum", ())] == 2 * 4096 + 4**10
    descriptor_buckets = {labels[0][1]: value for (name, labels), value in got.items()
                          if name == "dsa_bridge_write_descriptors_bucket"}
    assert len(descriptor_buckets) == len(WRITE_DESCRIPTORS_BUCKETS) + 1
    assert descriptor_buckets["4.0"] == 0 and descriptor_buckets["16.0"] == 2
    assert descriptor_buckets["64.0"] == 2 and descriptor_buckets["256.0"] == 3
    assert got[("dsa_bridge_write_descriptors_sum", ())] == 116
    assert later[("dsa_bridge_write_seconds_count", ())] == 4
    assert later[("dsa_bridge_write_bytes_bucket", (("le", "4096.0"),))] == 3


def test_metrics_of_a_role_and_of_no_role():
    names = {family.name for family in metrics.stats_metrics(Stats(), "prefill")}
    assert {"dsa_bridge_write_seconds", "dsa_bridge_write_bytes", "dsa_bridge_write_descriptors",
            "dsa_bridge_transfer_latency_seconds", "dsa_bridge_requests"} <= names
    assert "dsa_bridge_quarantines" not in names  # decode's fence
    assert "dsa_bridge_quarantines" in {f.name for f in metrics.stats_metrics(Stats(), "decode")}
    with pytest.raises(ValueError, match="role must be one of prefill, decode"):
        metrics.stats_metrics(Stats(), "router")
    with pytest.raises(ValueError, match="role must be one of prefill, decode"):
        metrics.StatsCollector(Stats, "router")


def test_a_port_in_use_and_port_zero():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            metrics.MetricsServer("127.0.0.1", port)
    assert metrics.serve(object(), "prefill", "127.0.0.1", 0) is None
    with pytest.raises(ValueError, match="role must be one of prefill, decode"):
        metrics.NodeCollector(object(), "router")


@pytest.mark.parametrize("text", ["-1", "65536", "http", ""])
def test_metrics_port_must_be_a_port_number(text, capsys):
    with pytest.raises(argparse.ArgumentTypeError, match="0..65535"):
        metrics.metrics_port(text)
    assert main(["prefill", "--metrics-port", text]) == 2
    assert "--metrics-port: must be a port number in 0..65535" in capsys.readouterr().err
    assert metrics.metrics_port("0") == 0 and metrics.metrics_port("65535") == 65535
