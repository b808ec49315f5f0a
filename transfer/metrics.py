"""Prometheus metrics of one node, or of several ranks, built from ``Stats`` on each scrape.

``stats_metrics(stats, role)`` turns stats into metric families: one node's, or a ``merge`` of
several ranks' (so one endpoint can serve a multi-rank deployment: ``MetricsServer.watch_stats``
with a function that returns the merged stats). ``NodeCollector`` adds what only a live node
knows (its name, its peers, the pages it holds). ``serve(node, role, host, port)`` starts an HTTP
endpoint (``GET /metrics``) with the node's own ``CollectorRegistry`` — not the process-wide one,
so one process may run several nodes — and returns the ``MetricsServer`` to ``close``;
``serving`` is the same as a context manager. Port 0 means no endpoint. Every metric is prefixed
``dsa_bridge_``:

- ``requests_total{state="success"|"failed"}`` and ``request_failures_total{reason=...}``, the
  reason reduced to one of ``counters.CATEGORIES`` (a fixed set, so label cardinality is bounded);
- ``transfer_bytes_total``, ``transfer_descriptors_total``, ``transfer_chunks_total``,
  ``engine_write_seconds_total``, ``engine_failures_total``;
- ``transfer_latency_seconds`` (histogram): decode from ``receiver.init`` to Success, prefill from
  the request's first chunk handed to the writer to its last chunk's report;
- ``write_seconds``, ``write_bytes``, ``write_descriptors`` (histograms): per engine write (a
  chunk) done (prefill) or reported done (decode), over the ``counters.WRITE_*_BUCKETS``; their
  sums are the totals above;
- ``checksums_total{op="computed"|"verified"}`` ((buffer, page) checksums) and
  ``checksum_seconds_total``;
- ``route_chunks_total{route="direct"|"staged"}`` (the route each chunk took),
  ``staging_slices_total`` (the staging slices that carried the staged ones) and ``staging_bytes``
  (gauge: the registered staging area, its configured bound);
- ``handshakes_total{result="ok"|"refused"}``, ``bad_messages_total``;
- ``quarantines_total`` and ``quarantine_expiries_total`` (decode): requests quarantined, and
  those of them released by ``quarantine_timeout_s`` instead of a proof;
  ``quarantined_pages_total`` and ``expired_pages_total``, their pages; ``peer_recoveries_total``:
  prefill nodes marked dead that came back through a new handshake;

and from a live node only:

- ``peers_connected`` (gauge): decode nodes paired with a prefill node, or prefill nodes a decode
  node still hears;
- ``pages_held`` (gauge, decode): pages of failed requests that may not go back to the allocator
  yet, because a write into them may still land; ``pages_quarantined`` (gauge, decode): those of
  them held because their prefill went silent (until it is proven gone);
- ``node_info{role, name, backend}``.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from .counters import (
    CATEGORIES,
    LATENCY_BUCKETS,
    WRITE_BYTES_BUCKETS,
    WRITE_DESCRIPTORS_BUCKETS,
    WRITE_SECONDS_BUCKETS,
    Stats,
)

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


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")


def _histogram(name: str, doc: str, bounds: tuple, counts: tuple[int, ...], total: float) -> Metric:
    """A histogram family from per-bucket counts (one per bound, then the rest) and their sum."""
    cumulative, buckets = 0, []
    for bound, count in zip((*bounds, float("inf")), counts, strict=True):
        cumulative += count
        buckets.append((floatToGoString(bound), cumulative))
    return HistogramMetricFamily(f"dsa_bridge_{name}", doc, buckets=buckets, sum_value=total)


def stats_metrics(stats: Stats, role: str) -> list[Metric]:
    """The metric families ``stats`` determines, of one node or merged over several ranks of
    ``role`` (decode's fence counters only for decode)."""
    _check_role(role)
    families: list[Metric] = []
    requests = CounterMetricFamily("dsa_bridge_requests", "Requests by final state.", labels=["state"])
    requests.add_metric(["success"], stats.requests_ok)
    requests.add_metric(["failed"], stats.requests_failed)
    families.append(requests)
    failures = CounterMetricFamily("dsa_bridge_request_failures",
                                   "Failed requests by reason category.", labels=["reason"])
    for category in CATEGORIES:
        failures.add_metric([category], stats.failures.get(category, 0))
    families.append(failures)

    for name, key, doc in (
        ("transfer_bytes", "bytes", "Bytes written (prefill) or reported written (decode)."),
        ("transfer_descriptors", "descriptors", "Engine descriptors (src, dst, length)."),
        ("transfer_chunks", "chunks", "Chunks written or received."),
        ("engine_write_seconds", "write_seconds", "Seconds inside engine writes."),
        ("engine_failures", "engine_failures", "Engine writes that failed."),
        ("bad_messages", "bad_messages", "Control messages dropped as malformed."),
        ("checksum_seconds", "checksum_seconds", "Seconds spent computing page checksums."),
    ):
        families.append(CounterMetricFamily(f"dsa_bridge_{name}", doc, value=getattr(stats, key)))
    checksums = CounterMetricFamily("dsa_bridge_checksums", "(buffer, page) checksums.", labels=["op"])
    checksums.add_metric(["computed"], stats.checksums_computed)
    checksums.add_metric(["verified"], stats.checksums_verified)
    families.append(checksums)
    routes = CounterMetricFamily("dsa_bridge_route_chunks", "Chunks by the route they took.",
                                 labels=["route"])
    routes.add_metric(["direct"], stats.chunks - stats.staged_chunks)
    routes.add_metric(["staged"], stats.staged_chunks)
    families += [routes, CounterMetricFamily("dsa_bridge_staging_slices",
                                             "Staging slices that carried staged chunks.",
                                             value=stats.staging_slices),
                 GaugeMetricFamily("dsa_bridge_staging_bytes", "The registered staging area.",
                                   value=stats.staging_bytes)]
    handshakes = CounterMetricFamily("dsa_bridge_handshakes", "Handshakes by result.", labels=["result"])
    handshakes.add_metric(["ok"], stats.handshakes_ok)
    handshakes.add_metric(["refused"], stats.handshakes_refused)
    families.append(handshakes)

    families += [
        _histogram("transfer_latency_seconds", "Latency of successful requests.", LATENCY_BUCKETS,
                   stats.latency_counts, stats.latency_seconds),
        _histogram("write_seconds", "Seconds of each engine write (chunk).", WRITE_SECONDS_BUCKETS,
                   stats.write_seconds_counts, stats.write_seconds),
        _histogram("write_bytes", "Bytes of each engine write (chunk).", WRITE_BYTES_BUCKETS,
                   stats.write_bytes_counts, stats.bytes),
        _histogram("write_descriptors", "Descriptors of each engine write (chunk).",
                   WRITE_DESCRIPTORS_BUCKETS, stats.write_descriptors_counts, stats.descriptors),
    ]
    if role == "decode":
        for name, key, doc in (
                ("quarantines", "quarantines", "Requests whose pages were quarantined (silent prefill)."),
                ("quarantine_expiries", "quarantine_expiries",
                 "Quarantined requests released by the upper bound, without proof."),
                ("quarantined_pages", "pages_quarantined", "Pages that entered quarantine."),
                ("expired_pages", "pages_expired", "Pages released by the quarantine's upper bound."),
                ("peer_recoveries", "peer_recoveries", "Dead prefill nodes back through a new handshake."),
        ):
            families.append(CounterMetricFamily(f"dsa_bridge_{name}", doc, value=getattr(stats, key)))
    return families


class StatsCollector:
    """Exports ``read()``'s stats whenever the registry is scraped: one node's, or a merge of
    several ranks' (``read`` returns ``counters.merge`` of their latest ``Stats``)."""

    def __init__(self, read: Callable[[], Stats], role: str):
        _check_role(role)
        self.read = read
        self.role = role

    def collect(self) -> Iterator[Metric]:
        yield from stats_metrics(self.read(), self.role)


class NodeCollector:
    """Reads a node's stats and request states whenever the registry is scraped."""

    def __init__(self, node, role: str):
        _check_role(role)
        self.node = node
        self.role = role

    def _peers(self) -> int:
        if self.role == "prefill":
            return len(self.node.peers())
        return sum(peer.alive for peer in self.node.peers)

    def collect(self) -> Iterator[Metric]:
        info = InfoMetricFamily("dsa_bridge_node", "This node.")
        info.add_metric([], {"role": self.role, "name": self.node.name,
                             "backend": self.node.backend.name})
        yield info
        yield from stats_metrics(self.node.counters.stats(), self.role)
        yield GaugeMetricFamily("dsa_bridge_peers_connected", "Peers this node is connected to.",
                                value=self._peers())
        if self.role == "decode":
            yield GaugeMetricFamily("dsa_bridge_pages_held", "Pages of failed requests that may "
                                    "not be reused yet (a write may still land).",
                                    value=self.node.held_pages())
            yield GaugeMetricFamily("dsa_bridge_pages_quarantined", "Pages held because their "
                                    "prefill went silent, until it is proven gone.",
                                    value=self.node.quarantined_pages())


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
        """Serve ``node``'s metrics."""
        self.registry.register(NodeCollector(node, role))

    def watch_stats(self, read: Callable[[], Stats], role: str) -> None:
        """Serve the stats ``read()`` returns on each scrape (e.g. several ranks' merged)."""
        self.registry.register(StatsCollector(read, role))

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
