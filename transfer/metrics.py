"""Prometheus metrics of one node, built from its ``Counters`` and request states on each scrape.

``serve(node, role, host, port)`` starts an HTTP endpoint (``GET /metrics``) with the node's own
``CollectorRegistry`` — not the process-wide one, so one process may run several nodes — and
returns the ``MetricsServer`` to ``close``; ``serving`` is the same as a context manager. Port 0
means no endpoint. Every metric is prefixed ``dsa_bridge_``:

- ``requests_total{state="success"|"failed"}`` and ``request_failures_total{reason=...}``, the
  reason reduced to one of ``counters.CATEGORIES`` (a fixed set, so label cardinality is bounded);
- ``transfer_bytes_total``, ``transfer_descriptors_total``, ``transfer_chunks_total``,
  ``engine_write_seconds_total``, ``engine_failures_total``;
- ``transfer_latency_seconds`` (histogram): decode from ``receiver.init`` to Success, prefill from
  the request's first chunk handed to the writer to its last chunk's report;
- ``checksums_total{op="computed"|"verified"}`` ((buffer, page) checksums) and
  ``checksum_seconds_total``;
- ``handshakes_total{result="ok"|"refused"}``, ``bad_messages_total``;
- ``peers_connected`` (gauge): decode nodes paired with a prefill node, or prefill nodes a decode
  node still hears;
- ``pages_held`` (gauge, decode): pages of failed requests that may not go back to the allocator
  yet, because a write into them may still land; ``pages_quarantined`` (gauge, decode): those of
  them held because their prefill went silent (until it is proven gone);
- ``quarantines_total`` and ``quarantine_expiries_total`` (decode): requests quarantined, and
  those of them released by ``quarantine_timeout_s`` instead of a proof;
  ``quarantined_pages_total`` and ``expired_pages_total``, their pages; ``peer_recoveries_total``:
  prefill nodes marked dead that came back through a new handshake;
- ``node_info{role, name, backend}``.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)

from .counters import CATEGORIES, LATENCY_BUCKETS

ROLES = ("prefill", "decode")


def metrics_port(text: str) -> int:
    """``--metrics-port``: a TCP port, 0 for no endpoint."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in 0..65535 (0: off), got {text!r}")
    return port


class NodeCollector:
    """Reads a node's counters and request states whenever the registry is scraped."""

    def __init__(self, node, role: str):
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        self.node = node
        self.role = role

    def _peers(self) -> int:
        if self.role == "prefill":
            return len(self.node.peers())
        return sum(peer.alive for peer in self.node.peers)

    def collect(self):
        c = self.node.counters.snapshot()
        info = InfoMetricFamily("dsa_bridge_node", "This node.")
        info.add_metric([], {"role": self.role, "name": self.node.name,
                             "backend": self.node.backend.name})
        yield info

        requests = CounterMetricFamily("dsa_bridge_requests", "Requests by final state.",
                                       labels=["state"])
        requests.add_metric(["success"], c["requests_ok"])
        requests.add_metric(["failed"], c["requests_failed"])
        yield requests
        failures = CounterMetricFamily("dsa_bridge_request_failures",
                                       "Failed requests by reason category.", labels=["reason"])
        for category in CATEGORIES:
            failures.add_metric([category], c["failures"].get(category, 0))
        yield failures

        for name, key, doc in (
            ("transfer_bytes", "bytes", "Bytes written (prefill) or reported written (decode)."),
            ("transfer_descriptors", "descriptors", "Engine descriptors (src, dst, length)."),
            ("transfer_chunks", "chunks", "Chunks written or received."),
            ("engine_write_seconds", "write_seconds", "Seconds inside engine writes."),
            ("engine_failures", "engine_failures", "Engine writes that failed."),
            ("bad_messages", "bad_messages", "Control messages dropped as malformed."),
            ("checksum_seconds", "checksum_seconds", "Seconds spent computing page checksums."),
        ):
            yield CounterMetricFamily(f"dsa_bridge_{name}", doc, value=c[key])
        checksums = CounterMetricFamily("dsa_bridge_checksums", "(buffer, page) checksums.",
                                        labels=["op"])
        checksums.add_metric(["computed"], c["checksums_computed"])
        checksums.add_metric(["verified"], c["checksums_verified"])
        yield checksums
        handshakes = CounterMetricFamily("dsa_bridge_handshakes", "Handshakes by result.",
                                         labels=["result"])
        handshakes.add_metric(["ok"], c["handshakes_ok"])
        handshakes.add_metric(["refused"], c["handshakes_refused"])
        yield handshakes

        cumulative, buckets = 0, []
        for bound, count in zip((*LATENCY_BUCKETS, float("inf")), c["latency_counts"], strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        yield HistogramMetricFamily("dsa_bridge_transfer_latency_seconds",
                                    "Latency of successful requests.", buckets=buckets,
                                    sum_value=c["latency_seconds"])

        yield GaugeMetricFamily("dsa_bridge_peers_connected", "Peers this node is connected to.",
                                value=self._peers())
        if self.role == "decode":
            yield GaugeMetricFamily("dsa_bridge_pages_held", "Pages of failed requests that may "
                                    "not be reused yet (a write may still land).",
                                    value=self.node.held_pages())
            yield GaugeMetricFamily("dsa_bridge_pages_quarantined", "Pages held because their "
                                    "prefill went silent, until it is proven gone.",
                                    value=self.node.quarantined_pages())
            for name, key, doc in (
                    ("quarantines", "quarantines", "Requests whose pages were quarantined (silent prefill)."),
                    ("quarantine_expiries", "quarantine_expiries",
                     "Quarantined requests released by the upper bound, without proof."),
                    ("quarantined_pages", "pages_quarantined", "Pages that entered quarantine."),
                    ("expired_pages", "pages_expired", "Pages released by the quarantine's upper bound."),
                    ("peer_recoveries", "peer_recoveries",
                     "Dead prefill nodes back through a new handshake."),
            ):
                yield CounterMetricFamily(f"dsa_bridge_{name}", doc, value=c[key])


class MetricsServer:
    """An HTTP endpoint serving one registry; bound on construction."""

    def __init__(self, host: str, port: int):
        self.registry = CollectorRegistry(auto_describe=False)
        try:
            self._httpd, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise OSError(f"cannot serve metrics on {host}:{port}: {exc}") from exc
        self.endpoint = f"{host}:{self._httpd.server_port}"

    def watch(self, node, role: str) -> None:
        self.registry.register(NodeCollector(node, role))

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)


def serve(node, role: str, host: str, port: int) -> MetricsServer | None:
    """The node's metrics on ``host:port``; None when ``port`` is 0."""
    if not port:
        return None
    server = MetricsServer(host, port)
    server.watch(node, role)
    return server


@contextlib.contextmanager
def serving(node, role: str, host: str, port: int) -> Iterator[MetricsServer | None]:
    server = serve(node, role, host, port)
    try:
        yield server
    finally:
        if server is not None:
            server.close()
