"""The wire decoder, fuzzed through live nodes' real ZMQ sockets.

Malformed and truncated messages (every prefix of every message type, random bytes, bit flips,
fields of the wrong type, unknown tags, several frames, fields beyond their bounds, valid
messages out of place) go to a prefill node before and after a handshake, to a ``dsa-bridge
prefill`` process, and to a decode node from a fake prefill. Each undecodable one is dropped with
a clear error and counted in ``bad_messages`` exactly once (logged one by one up to a burst per
second, the rest summarised with their count); no message reaches a handler bug; every node
keeps serving afterwards, and the prefill process survives room ids that used to crash it.
Messages beyond a socket's size limit never reach the decoder: ``test_flood.py``.
"""

from __future__ import annotations

import logging
import re
import threading
import time

import msgspec
import numpy as np
import pytest
import zmq

from dsa_bridge.transfer import protocol
from dsa_bridge.transfer.backends import create_backend
from dsa_bridge.transfer.decode import DecodeNode
from dsa_bridge.transfer.handshake import pool_buffers
from dsa_bridge.transfer.launcher.drivers import count_mismatches, fill_request
from dsa_bridge.transfer.prefill import PrefillNode
from dsa_bridge.transfer.request import KVPoll

from ..transfer.fake_backend import FakeBackend
from ..transfer.helpers import wait_for
from .helpers import DEEPSEEK, make_pool, settled
from .netns import loopback_hosts
from .procs import Hang, listening, prefill

CATEGORY = "bad inputs tried"
CLEAR = re.compile(r"dropped a message: (bad message: .+|expected one payload frame, got \d+ "
                   r"frames|message of \d+ bytes exceeds \d+|\w+ before a handshake|"
                   r"chunk report for unknown room -?\d+|unexpected \w+ from (decode|prefill))")
SUMMARY = re.compile(r"dropped (\d+) more messages in [\d.]+s, not logged one by one; last: ")


def hello_for(pool, engine) -> protocol.Hello:
    layout = pool.layout
    return protocol.Hello(protocol.PROTOCOL_VERSION, "fuzzer", engine.name, layout.to_dict(),
                          layout.layout_hash(), engine.metadata(), pool_buffers(pool),
                          list(layout.index_layer_ids))


def valid_messages(hello: protocol.Hello) -> list[protocol.Message]:
    return [hello, protocol.HelloAck(1, True, "", "p", hello.layout, hello.layout_hash),
            protocol.RequestPages(5, [1, 2, 3], 192), protocol.Abort(5, "why"),
            protocol.ChunkDone(5, 0, ok=True, last=True, nbytes=10), protocol.Heartbeat(1.0)]


def undecodable(hello: protocol.Hello, rng: np.random.Generator) -> list[bytes | list[bytes]]:
    """Messages no decoder may accept; a list of bytes is one message of several frames."""
    out: list[bytes | list[bytes]] = []
    for message in valid_messages(hello):
        data = protocol.encode(message)
        cuts = np.unique(np.concatenate([np.arange(min(len(data), 64)),
                                         rng.integers(0, len(data), 40)]))
        out += [data[:int(n)] for n in cuts]
        out.append([data, data])
    out += [rng.bytes(int(n)) for n in rng.integers(1, 300, 300)]
    wrong = [
        {"type": "request", "room": "1", "dst_pages": [1], "num_tokens": 1},
        {"type": "request", "room": 1, "dst_pages": [1.5], "num_tokens": 1},
        {"type": "request", "room": 1, "dst_pages": [True], "num_tokens": 1},
        {"type": "request", "room": 1, "dst_pages": 7, "num_tokens": 1},
        {"type": "request", "room": 1},
        {"type": "abort", "room": None, "reason": "x"},
        {"type": "heartbeat", "sent_at": "now"},
        {"type": "chunk_done", "room": 1, "chunk": 0, "ok": "yes", "last": True},
        {"type": "hello", "version": 1},
        {"type": "no-such-message"},
        {"room": 1, "dst_pages": [1], "num_tokens": 1},
        [1, 2, 3], None, "hello", 12345, {}, [[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]],
    ]
    out += [msgspec.msgpack.encode(w) for w in wrong]
    out += [b"\xdb\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xc1"]
    beyond = [msgspec.structs.replace(hello, buffers=hello.buffers[:1] * (protocol.MAX_BUFFERS + 1)),
              msgspec.structs.replace(hello, index_reads=[1] * (protocol.MAX_LAYERS + 1)),
              msgspec.structs.replace(hello, nonce=b"n" * (protocol.MAX_TOKEN_BYTES + 1))]
    out += [msgspec.msgpack.encode(m) for m in beyond]
    out.append(msgspec.msgpack.encode({"type": "abort", "room": 1,
                                       "reason": "x" * (protocol.MAX_REASON_CHARS + 1)}))
    return out


def flipped(hello: protocol.Hello, rng: np.random.Generator, count: int) -> list[bytes]:
    """Valid messages with random bytes changed: some still decode, most do not."""
    encoded = [protocol.encode(m) for m in valid_messages(hello)]
    out = []
    for i in range(count):
        data = bytearray(encoded[i % len(encoded)])
        for at in rng.integers(0, len(data), int(rng.integers(1, 4))):
            data[int(at)] = int(rng.integers(0, 256))
        out.append(bytes(data))
    return out


class Client:
    """A raw DEALER socket to a node's control endpoint."""

    def __init__(self, endpoint: str):
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://{endpoint}")

    def send(self, message: bytes | list[bytes]) -> None:
        if isinstance(message, list):
            self.sock.send_multipart(message)
        else:
            self.sock.send(message)

    def handshake(self, hello: protocol.Hello) -> None:
        self.sock.send(protocol.encode(hello))
        assert self.sock.poll(10_000), "no HelloAck"
        assert protocol.decode(self.sock.recv()).ok

    def report(self, room: int, timeout_s: float = 60.0) -> protocol.ChunkDone:
        """The next ChunkDone for ``room`` (heartbeats and other answers are skipped)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                reply = protocol.decode(self.sock.recv())
                if isinstance(reply, protocol.ChunkDone) and reply.room == room:
                    return reply
        raise Hang(f"no report for room {room} within {timeout_s:.0f}s")

    def marker(self, room: int = 123_456_789) -> None:
        """Abort an unknown room and wait for prefill's refusal: messages are handled in order,
        so every message sent before has been handled by then."""
        self.sock.send(protocol.encode(protocol.Abort(room, "marker")))
        self.report(room)

    def close(self) -> None:
        self.sock.close(0)
        self.context.term()


def dropped(caplog) -> list[str]:
    """The drops logged one by one."""
    return [r.getMessage() for r in caplog.records if "dropped a message" in r.getMessage()]


def drops(text: str) -> int:
    """Every drop a log reports: one by one, and in the summaries of the rest."""
    return text.count("dropped a message") + sum(int(n) for n in SUMMARY.findall(text))


def logged_drops(caplog) -> int:
    return drops("\n".join(r.getMessage() for r in caplog.records))


def assert_no_handler_bug(caplog) -> None:
    bugs = [r.getMessage() for r in caplog.records
            if "handling a message failed" in r.getMessage() or "tick failed" in r.getMessage()]
    assert not bugs, bugs[:3]


def test_malformed_messages_to_a_live_prefill_node(caplog, ledger):
    caplog.set_level(logging.WARNING, logger="dsa_bridge.transfer")
    rng = np.random.default_rng(11)
    with PrefillNode(make_pool(pages=8, sentinel=False), FakeBackend(), heartbeat_s=0.1,
                     peer_timeout_s=60.0) as node:
        fuzzer_engine = FakeBackend()
        hello = hello_for(make_pool(pages=8), fuzzer_engine)
        client = Client(node.endpoint)
        try:
            bad = undecodable(hello, rng) + [protocol.encode(m) for m in valid_messages(hello)[1:]]
            for message in bad:  # before any handshake: valid messages are out of place too
                client.send(message)
            wait_for(lambda: node.counters.snapshot()["bad_messages"] == len(bad), 60,
                     "every malformed message counted")
            wait_for(lambda: logged_drops(caplog) == len(bad), 10, "every drop logged")
            logged = dropped(caplog)
            assert all(CLEAR.search(line) for line in logged), [x for x in logged if not CLEAR.search(x)][:3]
            client.handshake(hello)  # then as a paired decode node, flipped bytes and all
            mutated = flipped(hello, rng, 1500) + undecodable(hello, rng)
            for message in mutated:
                client.send(message)
            client.marker()  # answered after every message before it was handled
        finally:
            client.close()
        with DecodeNode(make_pool(pages=8), FakeBackend(), node.endpoint) as decode:
            fill_request(node.pool, 1000, np.array([2, 3]))
            sender = node.sender(1000)
            sender.init(2)
            sender.send([2, 3])
            receiver = decode.receiver(1000)
            receiver.init([4, 5])
            wait_for(lambda: settled(receiver), 30, "a request after the fuzz")
            assert receiver.poll() == KVPoll.Success
            assert count_mismatches(decode.pool, 1000, np.array([4, 5])) == 0
        assert all(CLEAR.search(line) for line in dropped(caplog))
        assert_no_handler_bug(caplog)
    ledger.record(tried=len(bad) + len(mutated), ok=1, failed=logged_drops(caplog))


class FakePrefill:
    """A ROUTER socket that answers one decode node's Hello, then sends whatever it is given."""

    def __init__(self):
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.identity = b""

    def answer_hello(self) -> None:
        assert self.sock.poll(20_000), "no Hello"
        self.identity, data = self.sock.recv_multipart()
        hello = protocol.decode(data)
        self.send(protocol.encode(protocol.HelloAck(protocol.PROTOCOL_VERSION, True, "", "fake",
                                                    hello.layout, hello.layout_hash)))

    def send(self, message: bytes | list[bytes]) -> None:
        frames = message if isinstance(message, list) else [message]
        self.sock.send_multipart([self.identity, *frames])

    def close(self) -> None:
        self.sock.close(0)
        self.context.term()


def test_malformed_messages_to_a_live_decode_node(caplog, ledger):
    caplog.set_level(logging.WARNING, logger="dsa_bridge.transfer")
    rng = np.random.default_rng(12)
    fake = FakePrefill()
    answering = threading.Thread(target=fake.answer_hello)
    answering.start()
    try:
        with DecodeNode(make_pool(pages=8), FakeBackend(), fake.endpoint) as node:
            answering.join(30)
            receiver = node.receiver(9)
            receiver.init([1, 2])
            bad = undecodable(hello_for(node.pool, node.backend), rng)
            bad += [protocol.encode(protocol.ChunkDone(77, 0, ok=True, last=True)),
                    protocol.encode(protocol.RequestPages(9, [1], 64))]
            for message in bad:
                fake.send(message)
            wait_for(lambda: node.counters.snapshot()["bad_messages"] == len(bad), 60,
                     "every malformed message counted")
            wait_for(lambda: logged_drops(caplog) == len(bad), 10, "every drop logged")
            part = 2 * node.peers[0].page_bytes  # the request's two pages, every buffer
            fake.send(protocol.encode(protocol.ChunkDone(9, 0, ok=True, last=True, nbytes=part)))
            wait_for(lambda: settled(receiver), 10, "the request after the fuzz")
            assert receiver.poll() == KVPoll.Success  # still serving
    finally:
        answering.join(30)
        fake.close()
    logged = dropped(caplog)
    ledger.record(tried=len(bad), failed=logged_drops(caplog))
    assert logged_drops(caplog) == len(bad) and all(CLEAR.search(line) for line in logged)
    assert_no_handler_bug(caplog)


@pytest.mark.parametrize("backend", ["mooncake"])
def test_malformed_messages_to_a_prefill_process(backend, procs, ledger):
    """``dsa-bridge prefill`` drops and counts every malformed message, refuses room ids it used
    to crash on (a uint64 room overflowed the pattern's int64 stamp), and keeps serving."""
    rng = np.random.default_rng(13)
    node = prefill(procs, loopback_hosts(1)[0], backend, "--pool-tokens", str(64 * 16))
    listening(procs, node)
    engine = create_backend(backend)
    hello = hello_for(make_pool(DEEPSEEK, 8), engine)
    client = Client(node.endpoint)
    try:
        bad = undecodable(hello, rng)
        for message in bad:
            client.send(message)
        client.handshake(hello)
        for room in (2**64 - 1, 2**63, -1):
            client.send(protocol.encode(protocol.RequestPages(room, [1], 64)))
            refusal = client.report(room)
            assert not refusal.ok and "is not in 0..2**63-1" in refusal.reason
    finally:
        client.close()
        engine.close()
    with DecodeNode(make_pool(DEEPSEEK, 16), create_backend(backend), node.endpoint) as decode:
        receiver = decode.receiver(3)
        receiver.init(np.arange(1, 9))
        wait_for(lambda: settled(receiver), 60, "a request after the fuzz")
        lost = count_mismatches(decode.pool, 3, np.arange(1, 9))
    assert node.stop() == 0
    counters, log = node.counters(), node.output()
    ledger.record(tried=len(bad) + 3, ok=1, failed=counters["bad_messages"] + 3,
                  bytes_verified=8 * (DEEPSEEK.kv_page_bytes + DEEPSEEK.index_page_bytes) * 61,
                  bytes_lost=lost)
    assert receiver.poll() == KVPoll.Success and lost == 0
    assert counters["bad_messages"] == len(bad) == drops(log)
    assert "Traceback" not in log

