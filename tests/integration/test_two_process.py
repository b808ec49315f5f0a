"""Prefill and decode as separate OS processes over the real engines on 127.0.0.1.

The prefill node is a ``dsa-bridge prefill`` process that fills every requested page of all 61
DeepSeek-V3.2 layers (MLA KV and indexer) with the deterministic pattern; the decode node runs in
the test process and checks every byte, the sentinel of every untouched page, and the counters."""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest
import torch

from dsa_bridge.plugin import DSALayout
from dsa_bridge.transfer import protocol
from dsa_bridge.transfer.backends import BACKENDS, create_backend
from dsa_bridge.transfer.decode import DecodeNode
from dsa_bridge.transfer.handshake import HandshakeError
from dsa_bridge.transfer.launcher.drivers import count_mismatches, reset_pages, sentinel_intact
from dsa_bridge.transfer.request import KVPoll

from ..conftest import require_engine
from ..transfer.helpers import wait_for
from .processes import NODE_ENV, PrefillProcess, cli

POOL_TOKENS = 64 * 96
DEEPSEEK = DSALayout.preset("deepseek-v3.2")


def decode_pool(layout=DEEPSEEK, tokens=POOL_TOKENS):
    from dsa_bridge.plugin import DSATokenToKVPool

    pool = DSATokenToKVPool.from_layout(layout, size=tokens)
    reset_pages(pool, np.arange(pool.num_kv_pages))
    return pool


@pytest.fixture(scope="module")
def prefill(backend, tmp_path_factory):
    node = PrefillProcess(tmp_path_factory.mktemp("prefill"), backend, "--pool-tokens",
                          str(POOL_TOKENS), "--peer-timeout", "10", "--chunk-pages", "16")
    yield node
    node.stop()


@pytest.fixture(scope="module")
def decode(backend, prefill):
    node = DecodeNode(decode_pool(), create_backend(backend), prefill.endpoint,
                      peer_timeout_s=10.0, request_timeout_s=60.0)
    yield node
    node.close()


def run(decode, rooms_pages):
    receivers = []
    for room, pages in rooms_pages:
        receiver = decode.receiver(room)
        receiver.init(np.asarray(pages), num_tokens=len(pages) * 64)
        receivers.append((receiver, np.asarray(pages)))
    for receiver, _ in receivers:
        wait_for(lambda r=receiver: r.poll() in (KVPoll.Success, KVPoll.Failed), 60.0)
    return receivers


def assert_delivered(decode, receivers):
    layout = decode.pool.layout
    used = np.concatenate([pages for _, pages in receivers])
    for receiver, pages in receivers:
        assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
        assert count_mismatches(decode.pool, receiver.room, pages) == 0
        assert receiver.nbytes == pages.size * (layout.kv_page_bytes + layout.index_page_bytes) * 61
    free = np.setdiff1d(np.arange(1, decode.pool.num_kv_pages), used)
    assert sentinel_intact(decode.pool, free)
    for receiver, pages in receivers:
        reset_pages(decode.pool, pages)
        decode.forget(receiver)


def test_one_page(decode):
    assert_delivered(decode, run(decode, [(100, [7])]))


def test_many_contiguous_pages_in_chunks(decode):
    receivers = run(decode, [(101, list(range(1, 81)))])
    assert receivers[0][0].chunks == 5  # 80 pages in chunks of 16
    assert_delivered(decode, receivers)


def test_shuffled_and_fragmented_pages(decode):
    pages = np.random.default_rng(3).permutation(np.arange(1, 96))[:60]
    assert_delivered(decode, run(decode, [(102, pages.tolist())]))


def test_concurrent_requests(decode):
    order = np.random.default_rng(4).permutation(np.arange(1, 96))
    requests = [(110 + i, order[i * 11:(i + 1) * 11].tolist()) for i in range(8)]
    before = decode.counters.snapshot()
    receivers = run(decode, requests)
    after = decode.counters.snapshot()
    assert after["requests_ok"] - before["requests_ok"] == 8
    assert after["bytes"] - before["bytes"] == 88 * (DEEPSEEK.kv_page_bytes + DEEPSEEK.index_page_bytes) * 61
    assert_delivered(decode, receivers)


def test_bad_requests_fail_that_request_only(decode):
    with pytest.raises(ValueError, match="page 0 is padding"):
        decode.receiver(120).init([0, 1])
    rogue = decode.receiver(121)  # a decode node that skips its own checks: prefill refuses
    rogue.page_ids = np.array([5, 5000])
    rogue.state.advance(KVPoll.WaitingForInput, 0.0)
    decode._loop.send(decode.peers[0].socket, protocol.RequestPages(121, [5, 5000], 128))
    wait_for(lambda: rogue.poll() == KVPoll.Failed, 30.0)
    assert "beyond the registered" in str(rogue.failure_exception())
    assert_delivered(decode, run(decode, [(122, [3, 4])]))


def test_layout_mismatch_refused_and_prefill_keeps_serving(backend, prefill, decode):
    other = DSALayout.preset("deepseek-v3.2", page_size=32)
    with pytest.raises(HandshakeError, match="layout mismatch: page_size"):
        DecodeNode(decode_pool(other, 64 * 16), create_backend(backend), prefill.endpoint,
                   handshake_timeout_s=20)
    assert_delivered(decode, run(decode, [(130, [5, 6, 9])]))


def test_killing_prefill_mid_transfer_fails_decode_requests_in_time(backend, tmp_path):
    victim = PrefillProcess(tmp_path, backend, "--pool-tokens", str(POOL_TOKENS),
                            "--chunk-pages", "1")
    try:
        with DecodeNode(decode_pool(), create_backend(backend), victim.endpoint,
                        peer_timeout_s=2.0, request_timeout_s=30.0) as node:
            receivers = [node.receiver(room) for room in range(4)]
            for room, receiver in enumerate(receivers):
                receiver.init(np.arange(1 + room * 20, 21 + room * 20))
            wait_for(lambda: any(r.poll() == KVPoll.Transferring for r in receivers)
                     or any(r.poll() == KVPoll.Success for r in receivers), 30.0)
            victim.kill()
            wait_for(lambda: all(r.poll() in (KVPoll.Success, KVPoll.Failed) for r in receivers),
                     timeout_s=10.0, what="every request settled after the kill")
            failed = [r for r in receivers if r.poll() == KVPoll.Failed]
            assert failed, "the kill came after every request had finished"
            assert all("unreachable" in str(r.failure_exception()) for r in failed)
            wait_for(lambda: all(r.can_release() for r in failed), 5.0)
    finally:
        victim.stop()


def test_demo_command_verifies_every_byte(backend):
    result = subprocess.run(
        cli("demo", "--backend", backend, "--requests", "6", "--pool-tokens", "8192",
            "--max-tokens", "2048", "--json"),
        capture_output=True, text=True, timeout=300, env={**os.environ, **NODE_ENV})
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["requests_ok"] == 6 and summary["requests_failed"] == 0
    assert summary["layers"] == 61 and summary["bytes_verified"] > 0
    assert summary["sentinel_intact"] and summary["counters"]["bytes"] == summary["bytes_verified"]
    pages = summary["bytes_verified"] // ((DEEPSEEK.kv_page_bytes + DEEPSEEK.index_page_bytes) * 61)
    assert summary["checksums"] and summary["checksums_verified"] == pages * 61 * 2  # on by default


def test_both_engines_deliver_identical_bytes(tmp_path):
    for name in BACKENDS:
        require_engine(name)
    pages = np.random.default_rng(5).permutation(np.arange(1, 96))[:40]
    pools = {}
    for name in BACKENDS:
        prefill = PrefillProcess(tmp_path, name, "--pool-tokens", str(POOL_TOKENS))
        try:
            with DecodeNode(decode_pool(), create_backend(name), prefill.endpoint) as node:
                receivers = run(node, [(700, pages[:25].tolist()), (701, pages[25:].tolist())])
                assert all(r.poll() == KVPoll.Success for r, _ in receivers)
                pools[name] = node.pool
        finally:
            prefill.stop()
    first, second = (pools[name] for name in BACKENDS)
    for layer in DEEPSEEK.layer_ids:
        for kind in ("kv", "index"):
            assert torch.equal(first.page_view(layer, kind), second.page_view(layer, kind)), (layer, kind)
    assert count_mismatches(first, 700, pages[:25]) == 0
