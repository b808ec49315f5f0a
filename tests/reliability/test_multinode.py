"""Multi-node: every node its own OS process, in its own network namespace with its own address.

One prefill node serves two decode nodes while a second prefill node feeds one of them too, and
one GLM-5.2 prefill node serves a compact and a uniform decode node, over both engines, on the
authenticated path (non-loopback listeners need the shared secret). Where namespaces cannot be
made the same scenarios run on 127.0.0.1 (the ``netns`` variant skips with the reason). Peers
without the secret or with a stale layout are refused, and the refusal is logged by the prefill
node, which keeps serving.
"""

from __future__ import annotations

import pytest

from dsa_bridge.plugin import DSALayout
from dsa_bridge.transfer.backends import BACKENDS

from .procs import cli, decode, driver, listening, prefill, summary

CATEGORY = "multi-node"
DEEPSEEK = DSALayout.preset("deepseek-v3.2")
PAGE_BYTES = (DEEPSEEK.kv_page_bytes + DEEPSEEK.index_page_bytes) * DEEPSEEK.num_layers
NODE = ("--pool-tokens", str(64 * 48), "--peer-timeout", "10", "--request-timeout", "120")
RUN_S = 240.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_prefill_two_decodes_and_two_prefills_one_decode(backend, hosts, procs, secret_file,
                                                             ledger):
    p1_host, p2_host, d1_host, d2_host = hosts(4)
    secret = ("--secret-file", secret_file)
    p1 = prefill(procs, p1_host, backend, *secret, *NODE, "--chunk-pages", "4", name="prefill-1")
    p2 = prefill(procs, p2_host, backend, *secret, *NODE, name="prefill-2")
    listening(procs, p1, p2)
    rx_before = [h.received_bytes() for h in (d1_host, d2_host)]
    d1 = decode(procs, d1_host, backend, p1.endpoint, *secret, *NODE, "--requests", "8",
                "--max-tokens", "1024", "--concurrency", "3", name="decode-1")
    d2 = driver(procs, d2_host, backend, [p1.endpoint, p2.endpoint], *secret, *NODE,
                "--requests", "10", "--max-tokens", "1024", "--concurrency", "4", name="decode-2")
    one, two = summary(procs, d1, RUN_S), summary(procs, d2, RUN_S)
    assert p1.stop() == 0 and p2.stop() == 0
    c1, c2 = p1.counters(), p2.counters()
    ledger.record(tried=18, ok=one["requests_ok"] + two["requests_ok"],
                  failed=one["requests_failed"] + two["requests_failed"],
                  bytes_verified=one["bytes_verified"] + two["bytes_verified"],
                  bytes_lost=one["bytes_mismatched"] + two["bytes_mismatched"])

    assert one["ok"] and one["requests_ok"] == 8, one["failures"]
    assert one["layers"] == 61 and one["bytes_mismatched"] == 0 and one["sentinel_intact"]
    assert one["counters"]["bytes"] == one["bytes_verified"]
    assert two["ok"] and two["requests_ok"] == 10, two["failures"]
    assert two["bytes_mismatched"] == 0 and two["sentinel_intact"]
    via1, via2 = two["per_prefill"][p1.endpoint], two["per_prefill"][p2.endpoint]
    assert (via1["ok"], via2["ok"]) == (5, 5)
    assert two["counters"]["handshakes_ok"] == 2
    # prefill-1 served both decode nodes, prefill-2 one; nothing failed anywhere
    assert c1["handshakes_ok"] == 2 and c2["handshakes_ok"] == 1
    assert c1["requests_ok"] == 8 + 5 and c2["requests_ok"] == 5
    assert c1["requests_failed"] == c2["requests_failed"] == 0
    assert c1["bytes"] == one["bytes_verified"] + via1["bytes"] and c2["bytes"] == via2["bytes"]
    assert c1["chunks"] > c1["requests_ok"]  # prefill-1 sent requests in chunks of 4 pages
    if d1_host.netns:  # the pages crossed each decode node's own link
        assert f"listening on {p1_host.address}:" in p1.output()
        rx = [h.received_bytes() - before for h, before in zip((d1_host, d2_host), rx_before,
                                                              strict=True)]
        assert rx[0] >= one["bytes_verified"] and rx[1] >= two["bytes_verified"], rx
        if backend == "nixl":
            assert f"UCX_NET_DEVICES={d2_host.device}" in two["transport"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_uniform_prefill_feeds_a_compact_and_a_uniform_decode(backend, hosts, procs, secret_file,
                                                                   ledger):
    """GLM-5.2: the compact decode receives only the 21 producer layers' indexers, the uniform
    one all 78; both byte-exact, from one prefill node."""
    p_host, d1_host, d2_host = hosts(3)
    glm = ("--model", "glm-5.2", "--secret-file", secret_file, *NODE)
    node = prefill(procs, p_host, backend, *glm, name="prefill-glm")
    listening(procs, node)
    runs = {layout: decode(procs, host, backend, node.endpoint, *glm, "--indexer-layout", layout,
                           "--requests", "5", "--max-tokens", "1024", name=f"decode-{layout}")
            for layout, host in (("compact", d1_host), ("uniform", d2_host))}
    results = {layout: summary(procs, run, RUN_S) for layout, run in runs.items()}
    assert node.stop() == 0
    counters = node.counters()
    ledger.record(tried=10, ok=sum(r["requests_ok"] for r in results.values()),
                  failed=sum(r["requests_failed"] for r in results.values()),
                  bytes_verified=sum(r["bytes_verified"] for r in results.values()),
                  bytes_lost=sum(r["bytes_mismatched"] for r in results.values()))
    for layout, indexers in (("compact", 21), ("uniform", 78)):
        result = results[layout]
        assert result["ok"] and result["requests_ok"] == 5, result["failures"]
        shape = (result["indexer_layout"], result["layers"], result["indexer_layers"])
        assert shape == (layout, 78, indexers)
        assert result["bytes_mismatched"] == 0 and result["sentinel_intact"]
        assert result["counters"]["bytes"] == result["bytes_verified"]
    assert counters["handshakes_ok"] == 2 and counters["requests_ok"] == 10
    assert counters["bytes"] == sum(r["bytes_verified"] for r in results.values())


def test_peers_without_the_secret_or_with_a_stale_layout_are_refused(hosts, procs, secret_file,
                                                                     tmp_path, ledger):
    backend = "mooncake"
    p_host, d_host = hosts(2)
    tried = 3
    bare = None
    if p_host.netns:  # a listener on a real address refuses to start without a secret
        tried += 1
        bare = procs.start("prefill-open", cli("prefill", "--listen", f"{p_host.address}:0",
                                               "--backend", backend), p_host,
                           {"DSA_BRIDGE_SECRET": ""})
    node = prefill(procs, p_host, backend, "--secret-file", secret_file, *NODE)
    listening(procs, node)
    if bare is not None:
        assert bare.wait(RUN_S) == 2
        assert "refusing to listen on non-loopback" in bare.output()
    wrong = tmp_path / "wrong-secret"
    wrong.write_text("not-the-secret\n")
    bad = {
        "no-secret": ((), "authentication failed"),
        "wrong-secret": (("--secret-file", str(wrong)), "authentication failed"),
        "stale-layout": (("--secret-file", secret_file, "--kv-dtype", "bf16"),
                         "layout mismatch: kv_dtype"),
    }
    rogues = {name: decode(procs, d_host, backend, node.endpoint, *options, "--pool-tokens",
                           "256", name=name, env={"DSA_BRIDGE_SECRET": ""})
              for name, (options, _) in bad.items()}
    for name, rogue in rogues.items():
        assert rogue.wait(RUN_S) == 2, rogue.output()[-2000:]
        assert f"refused the handshake: {bad[name][1]}" in rogue.output()
    good = decode(procs, d_host, backend, node.endpoint, "--secret-file", secret_file, *NODE,
                  "--requests", "3", "--max-tokens", "512", name="good")
    result = summary(procs, good, RUN_S)
    assert node.stop() == 0
    log, counters = node.output(), node.counters()
    # tried: the refused peers (and the bare listener) and the good node's requests
    ledger.record(tried=tried + result["requests"], ok=result["requests_ok"],
                  failed=result["requests_failed"] + tried,
                  bytes_verified=result["bytes_verified"], bytes_lost=result["bytes_mismatched"])
    assert result["ok"] and result["requests_ok"] == 3, result["failures"]
    for name, rogue in rogues.items():  # each refusal is logged with the peer's name and why
        assert f"refused decode-{rogue.pid}: {bad[name][1]}" in log, name
    assert counters["handshakes_refused"] == 3 and counters["handshakes_ok"] == 1
