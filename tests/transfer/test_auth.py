"""The shared-secret handshake: who may pair with a prefill node."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from dsa_bridge.transfer import auth, protocol
from dsa_bridge.transfer.decode import DecodeNode
from dsa_bridge.transfer.handshake import HandshakeError, pool_buffers
from dsa_bridge.transfer.prefill import PrefillNode

from .fake_backend import FakeBackend
from .helpers import make_pool, wait_for


@pytest.fixture
def prefill():
    node = PrefillNode(make_pool(), FakeBackend(), secret=b"s3cret")
    yield node
    node.close()


def test_both_sides_with_the_secret_pair(prefill):
    with DecodeNode(make_pool(), FakeBackend(), prefill.endpoint, secret=b"s3cret"):
        wait_for(lambda: prefill.counters.snapshot()["handshakes_ok"] == 1)


@pytest.mark.parametrize("secret", [b"", b"wrong"])
def test_without_the_secret_refused_and_logged(prefill, secret):
    with pytest.raises(HandshakeError, match="authentication failed"):
        DecodeNode(make_pool(), FakeBackend(), prefill.endpoint, secret=secret)
    assert prefill.counters.snapshot()["handshakes_refused"] == 1
    assert "authentication failed" in prefill.refusals[0]
    assert prefill.peers() == []


def test_prefill_without_the_secret_is_not_trusted_by_decode():
    with PrefillNode(make_pool(), FakeBackend()) as open_prefill:
        with pytest.raises(HandshakeError, match="did not prove the shared secret"):
            DecodeNode(make_pool(), FakeBackend(), open_prefill.endpoint, secret=b"s3cret")


def signed_hello(secret: bytes, **changes) -> protocol.Hello:
    pool = make_pool()
    engine = FakeBackend()
    hello = protocol.Hello(protocol.PROTOCOL_VERSION, "replayer", engine.name,
                           pool.layout.to_dict(), pool.layout.layout_hash(), engine.metadata(),
                           pool_buffers(pool), list(pool.layout.index_layer_ids),
                           nonce=b"n" * 16,
                           sent_at=changes.pop("sent_at", time.time()))
    hello = msgspec.structs.replace(hello, **changes)
    return msgspec.structs.replace(hello, auth=auth.sign(secret, protocol.signed_bytes(hello)))


def send_raw(endpoint: str, message) -> protocol.HelloAck:
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{endpoint}")
        sock.send(protocol.encode(message))
        assert sock.poll(5000), "no answer"
        return protocol.decode(sock.recv())
    finally:
        sock.close(0)
        context.term()


def test_replayed_hello_refused(prefill):
    hello = signed_hello(b"s3cret")
    assert send_raw(prefill.endpoint, hello).ok
    replay = send_raw(prefill.endpoint, hello)
    assert not replay.ok and "nonce reused" in replay.reason


def test_stale_hello_refused(prefill):
    ack = send_raw(prefill.endpoint, signed_hello(b"s3cret", sent_at=1.0))
    assert not ack.ok and "clock skew" in ack.reason


def test_tampered_hello_refused(prefill):
    hello = signed_hello(b"s3cret")
    tampered = msgspec.structs.replace(hello, buffers=hello.buffers[:-1])
    ack = send_raw(prefill.endpoint, tampered)
    assert not ack.ok and "authentication failed" in ack.reason


def test_non_loopback_listener_needs_a_secret():
    with pytest.raises(auth.AuthError, match="without a shared secret"):
        PrefillNode(make_pool(), FakeBackend(), listen="0.0.0.0:0")


def test_secret_file(tmp_path, monkeypatch):
    path = tmp_path / "secret"
    path.write_text("abc\n")
    assert auth.load_secret(str(path)) == b"abc"
    (tmp_path / "empty").write_text("")
    with pytest.raises(auth.AuthError, match="is empty"):
        auth.load_secret(str(tmp_path / "empty"))
    monkeypatch.setenv(auth.SECRET_ENV, "from-env")
    assert auth.load_secret(None) == b"from-env"
