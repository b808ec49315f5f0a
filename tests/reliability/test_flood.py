"""A control plane that cannot be starved: floods, oversized messages and enormous Hellos from a
separate process against a ``dsa-bridge prefill`` process, while a legitimate decode node (this
process, the same engine) keeps issuing requests through it.

- junk from four connections, with and without a shared secret, for 8 s and on until the
  legitimate decode has had 3 requests served during the flood (however slow a loaded machine
  makes them; the flood gives up after 2 minutes and the test fails): every request completes
  byte-exact, neither side ever declares the other dead, the prefill's heartbeats keep arriving
  (the decode never hears nothing for half the peer timeout), every junk message is counted once
  as a bad message (every refused Hello as a refused handshake);
- 100 MiB messages and one of the limit + 1 byte: ZMQ drops each before allocating it and closes
  its connection (the sender's ZMQ reconnects); the prefill's peak RSS grows by far less than one
  such message; a message of exactly the limit reaches the node and is counted;
- three 12 MB Hellos of 600,000 buffers (cut off at the socket), three of ``MAX_BUFFERS + 1``
  buffers (refused by the decoder before any buffer is decoded), three whose layout lists 100,000
  layers (refused by the handshake with an answer naming the count): the heartbeats keep
  arriving, as during the junk flood.

The prefill's ``max_tick_gap_s`` and the slowest request are printed, not asserted: they also
count stalls that are not the control plane's (the engine's first contact with a peer, start-up,
the machine's load).
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from dsa_bridge.transfer import protocol
from dsa_bridge.transfer import receive_limits as limits
from dsa_bridge.transfer.auth import load_secret
from dsa_bridge.transfer.backends import create_backend
from dsa_bridge.transfer.decode import DecodeNode
from dsa_bridge.transfer.handshake import pool_buffers
from dsa_bridge.transfer.launcher.drivers import count_mismatches, request_bytes
from dsa_bridge.transfer.request import KVPoll

from ..ports import free_port
from ..transfer.helpers import wait_for
from .helpers import DEEPSEEK, make_pool, settled
from .netns import loopback_hosts
from .procs import Hang, Node, Processes, listening, prefill, wait_file

CATEGORY = "bad inputs tried"
FLOODER = Path(__file__).with_name("flooder.py")
PREFILL_PAGES = 64
FLOOD_S = 8.0  # the junk flood's least length
MIN_SERVED = 3  # the legitimate decode's requests that must succeed (junk: during the flood)
PEER_TIMEOUT_S = 5.0  # both nodes' (the defaults, set explicitly here)
HEARTBEAT_S = 0.5  # both nodes' (the prefill's default; its command has no option for it)
# The decode must hear the prefill at least every half peer timeout: a longer silence is halfway to
# declaring a healthy peer dead. Healthy, the silence is one heartbeat period plus the scheduling
# delay (0.5-0.8 s measured with a load average of 16 on 2 cores); the rest of the half is the
# margin for load. A control plane starved by the flood falls silent for the whole flood (>= 8 s).
HEARD_WITHIN_S = PEER_TIMEOUT_S / 2
MIB = 1024 * 1024


def scrape(port: int) -> dict[str, float]:
    """The prefill's metrics without labels (``dsa_bridge_bad_messages_total`` ...)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if line and not line.startswith("#") and "{" not in name:
            values[name] = float(value)
    return values


def peak_rss(pid: int) -> int:
    """The process's peak resident set (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


def serve(procs: Processes, backend: str, *extra: str) -> tuple[Node, int]:
    port = free_port()
    node = prefill(procs, loopback_hosts(1)[0], backend, "--pool-tokens",
                   str(PREFILL_PAGES * DEEPSEEK.page_size), "--metrics-port", str(port),
                   "--peer-timeout", str(PEER_TIMEOUT_S), *extra)
    listening(procs, node)
    return node, port


def flooder(procs: Processes, endpoint: str, mode: str, *extra: str,
            name: str = "flooder") -> tuple[Node, Path]:
    result = procs.tmp / f"{name}.json"
    node = procs.start(name, [sys.executable, str(FLOODER), "--endpoint", endpoint,
                                           "--mode", mode, "--result", str(result), *extra])
    return node, result


@dataclass
class Outcome:
    """What the legitimate decode saw while the flood ran."""

    ok: int = 0
    ok_under_attack: int = 0  # of them, started once the prefill had counted a bad message
    failures: list[str] = field(default_factory=list)
    mismatched: int = 0
    bytes_verified: int = 0
    dead: list[str] = field(default_factory=list)  # moments a side had lost the other
    slowest_s: float = 0.0
    longest_silence_s: float = 0.0  # the longest the decode heard nothing from the prefill


def keep_requesting(decode: DecodeNode, hostile: Node, done: Path | None, metrics_port: int,
                    room_base: int, served: Path | None = None, timeout_s: float = 240.0) -> Outcome:
    """Requests one after another, each checked byte by byte, until the hostile process is done
    (exited, or wrote ``done``) and at least MIN_SERVED have settled; after each, whether either
    side has lost the other. ``served`` is made once MIN_SERVED requests started under attack
    have succeeded (the junk flooder floods on until it appears)."""
    outcome = Outcome()
    deadline = time.monotonic() + timeout_s
    under_attack = False

    def heard(receiver) -> bool:
        silence = time.monotonic() - decode.peers[0].last_seen
        outcome.longest_silence_s = max(outcome.longest_silence_s, silence)
        return settled(receiver)

    def at_work() -> bool:
        return hostile.process.poll() is None and not (done and done.exists())

    i = 0
    while at_work() or outcome.ok + len(outcome.failures) < MIN_SERVED:
        if time.monotonic() > deadline:
            raise Hang(f"{hostile.name} still running after {timeout_s:.0f}s")
        room, pages = room_base + i, np.arange(1, 5) + 4 * (i % 4)
        i += 1
        receiver = decode.receiver(room)
        started = time.monotonic()
        receiver.init(pages, pages.size * DEEPSEEK.page_size)
        wait_for(lambda r=receiver: heard(r), 60, f"room {room}")
        outcome.slowest_s = max(outcome.slowest_s, time.monotonic() - started)
        if receiver.poll() == KVPoll.Success:
            outcome.ok += 1
            outcome.ok_under_attack += under_attack
            outcome.mismatched += count_mismatches(decode.pool, room, pages)
            outcome.bytes_verified += request_bytes(decode.pool, pages.size)
        else:
            outcome.failures.append(str(receiver.failure_exception()))
        wait_for(receiver.can_release, 60, f"room {room} releasable")
        decode.forget(receiver)
        if not decode.peers[0].alive:
            outcome.dead.append(f"decode lost the prefill after room {room}")
        metrics = scrape(metrics_port)
        if metrics.get("dsa_bridge_peers_connected") != 1:
            outcome.dead.append(f"prefill lost the decode after room {room}")
        under_attack = under_attack or metrics.get("dsa_bridge_bad_messages_total", 0) > 0
        if served is not None and outcome.ok_under_attack >= MIN_SERVED:
            served.touch()
    return outcome


def legitimate_decode(backend: str, endpoint: str, secret: bytes = b"") -> DecodeNode:
    return DecodeNode(make_pool(DEEPSEEK, 24), create_backend(backend), endpoint, secret=secret,
                      peer_timeout_s=PEER_TIMEOUT_S, heartbeat_s=HEARTBEAT_S)


def assert_served_throughout(outcome: Outcome, decode: DecodeNode) -> None:
    assert outcome.ok >= MIN_SERVED and not outcome.failures, outcome.failures[:3]
    assert outcome.mismatched == 0
    assert not outcome.dead, outcome.dead[:3]
    assert decode.peers[0].alive and decode.counters.snapshot()["bad_messages"] == 0
    assert outcome.longest_silence_s < HEARD_WITHIN_S, outcome.longest_silence_s


def assert_clean_log(node: Node) -> None:
    log = node.output()
    for sign in ("silent for", "Traceback", "handling a message failed", "tick failed"):
        assert sign not in log, f"{sign!r} in the prefill's log:\n{log[-3000:]}"


# The junk reaches the control plane (ZeroMQ), never the engine: each engine once, and the secret
# (which changes how a Hello is checked) off on one, on on the other.
@pytest.mark.parametrize(("backend", "secret"), [("mooncake", False), ("nixl", True)],
                         ids=["mooncake-no-secret", "nixl-secret"])
def test_a_junk_flood_does_not_starve_the_control_plane(backend, secret, procs, ledger, secret_file):
    extra = ("--secret-file", secret_file) if secret else ()
    node, port = serve(procs, backend, *extra)
    decode = legitimate_decode(backend, node.endpoint, load_secret(secret_file) if secret else b"")
    try:
        hold, served = procs.tmp / "hold", procs.tmp / "served"
        hostile, result = flooder(procs, node.endpoint, "junk", "--seconds", str(FLOOD_S),
                                  "--until", str(served), "--backend", backend, "--hold", str(hold),
                                  *(("--secret",) if secret else ()))
        outcome = keep_requesting(decode, hostile, result, port, room_base=1000, served=served)
        flood = wait_file(hostile, result)
        sent = flood["sent"]
        bad = sent["undecodable"] + sent["out_of_place"]
        wait_for(lambda: scrape(port)["dsa_bridge_bad_messages_total"] >= bad, 120,
                 "every junk message handled")
        hold.touch()
        assert hostile.wait(30) == 0, hostile.output()[-3000:]
        assert_served_throughout(outcome, decode)
        assert flood["until_seen"], (f"{outcome.ok_under_attack} requests served during "
                                     f"{flood['seconds']:.0f}s of flood, fewer than {MIN_SERVED}")
    finally:
        decode.close()
    assert node.stop() == 0
    counters = node.counters()
    ledger.record(tried=sum(sent.values()), ok=outcome.ok, failed=bad + sent["hello"],
                  bytes_verified=outcome.bytes_verified)
    assert counters["bad_messages"] == bad and bad > 10_000
    assert counters["handshakes_refused"] == sent["hello"] > 0 and counters["handshakes_ok"] == 1
    assert_clean_log(node)
    print(f"\n{backend} secret={secret}: {sum(sent.values())} junk messages in "
          f"{flood['seconds']:.0f}s, {outcome.ok} requests ok ({outcome.ok_under_attack} under "
          f"attack), slowest {outcome.slowest_s * 1000:.0f} ms, longest silence "
          f"{outcome.longest_silence_s * 1000:.0f} ms, prefill's longest tick gap "
          f"{counters['max_tick_gap_s'] * 1000:.1f} ms")


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_oversized_messages_are_cut_off_at_the_socket(backend, procs, ledger):
    node, port = serve(procs, backend)
    limit = limits.prefill_receive_bytes(DEEPSEEK, backend, pool_buffers(make_pool(DEEPSEEK, PREFILL_PAGES)))
    decode = legitimate_decode(backend, node.endpoint)
    try:
        warm, _ = flooder(procs, node.endpoint, "oversized", "--sizes", str(limit + 1), name="warm-up")
        keep_requesting(decode, warm, None, port, room_base=1000)  # the peak RSS of a serving node
        before = peak_rss(node.pid)
        hostile, result = flooder(procs, node.endpoint, "oversized", "--sizes",
                                  ",".join([str(100 * MIB)] * 3 + [str(limit + 1)]), "--exact", str(limit))
        outcome = keep_requesting(decode, hostile, None, port, room_base=2000)
        assert hostile.wait(10) == 0, hostile.output()[-3000:]
        grown = peak_rss(node.pid) - before
        wait_for(lambda: scrape(port)["dsa_bridge_bad_messages_total"] == 1, 30,
                 "the message of exactly the limit counted")
        assert_served_throughout(outcome, decode)
    finally:
        decode.close()
    cut = json.loads(result.read_text())["cut_off_seconds"]
    assert node.stop() == 0
    counters = node.counters()
    ledger.record(tried=6, ok=outcome.ok, failed=6, bytes_verified=outcome.bytes_verified)
    assert len(cut) == 4  # every oversized message closed its connection
    assert grown < 16 * MIB, f"peak RSS grew by {grown / MIB:.1f} MiB"
    assert counters["bad_messages"] == 1  # only the message of the limit itself was read
    assert_clean_log(node)
    print(f"\n{backend}: limit {limit} bytes; 3 x 100 MiB cut off in "
          f"{', '.join(f'{s * 1000:.0f}' for s in cut)} ms; peak RSS +{grown / MIB:.1f} MiB")


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_enormous_hellos_are_refused_without_blocking_the_control_thread(backend, procs, ledger):
    node, port = serve(procs, backend)
    decode = legitimate_decode(backend, node.endpoint)
    try:
        hostile, result = flooder(procs, node.endpoint, "hellos", "--backend", backend)
        outcome = keep_requesting(decode, hostile, None, port, room_base=1000)
        assert hostile.wait(10) == 0, hostile.output()[-3000:]
        wait_for(lambda: scrape(port)["dsa_bridge_bad_messages_total"] == 3, 30,
                 "the Hellos beyond the decoder's bound counted")
        assert_served_throughout(outcome, decode)
    finally:
        decode.close()
    seen = json.loads(result.read_text())
    assert node.stop() == 0
    counters = node.counters()
    ledger.record(tried=9, ok=outcome.ok, failed=9, bytes_verified=outcome.bytes_verified)
    assert all(size > 12_000_000 for size in seen["sizes"]) and len(seen["cut_off_seconds"]) == 3
    assert [r["ok"] for r in seen["refusals"]] == [False] * 3
    assert all("layer_ids lists 100000 layers, more than the "
               f"{protocol.MAX_LAYERS}" in r["reason"] for r in seen["refusals"])
    assert counters["bad_messages"] == 3 and counters["handshakes_refused"] == 3
    assert_clean_log(node)
    cuts = ", ".join(f"{s * 1000:.0f}" for s in seen["cut_off_seconds"])
    answers = ", ".join(f"{r['seconds'] * 1000:.1f}" for r in seen["refusals"])
    print(f"\n{backend}: 12 MB Hellos cut off in {cuts} ms; 100,000-layer Hellos refused in "
          f"{answers} ms; longest silence {outcome.longest_silence_s * 1000:.0f} ms; prefill's "
          f"longest tick gap {counters['max_tick_gap_s'] * 1000:.1f} ms")
