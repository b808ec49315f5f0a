"""Test-only hostile process against a prefill node's control port (``test_flood.py``).

    python tests/reliability/flooder.py --endpoint HOST:PORT --mode junk --seconds 8 --result R

- ``junk``: from ``--connections`` DEALER sockets in turn, for ``--seconds``: undecodable
  messages (every prefix of every message type, the reserved byte 0xc1 with random bytes, several
  frames), valid messages out of place (before any handshake), and now and then a Hello the node
  must refuse (signed with a wrong secret when ``--secret`` is given, of a wrong protocol version
  otherwise); past ``--seconds``, on until the ``--until`` file appears (at most ``UNTIL_S``
  more: the test makes it once its own requests were served during the flood, however slow a
  loaded machine makes them). Counts of what was sent, by how the node should count it, and
  whether ``--until`` appeared go to ``--result`` once the flood is over; the connections stay
  open until the ``--hold`` file appears (at most ``HOLD_S``): what a node has not read yet when a
  peer disconnects is lost with the connection.
- ``oversized``: messages of ``--sizes`` bytes, one at a time; after each it waits until the
  node has closed the connection and ZMQ has made a new one. ``--exact`` bytes of junk are sent
  last: a message of the limit itself reaches the node (and is counted as a bad message).
- ``hellos``: three 12 MB Hellos of 600,000 buffers (beyond the socket's limit), three Hellos of
  ``MAX_BUFFERS + 1`` buffers (within it, refused by the decoder), three Hellos whose layout lists
  100,000 layers (refused by the handshake, with an answer whose latency is recorded).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import msgspec
import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from dsa_bridge.plugin import DSALayout
from dsa_bridge.plugin.descriptors import BufferDescriptor
from dsa_bridge.transfer import auth, protocol
from dsa_bridge.transfer.launcher.summary import write_json_atomic

LAYOUT = DSALayout.preset("deepseek-v3.2")
CONNECT_TIMEOUT_S = 30.0
HOLD_S = 180.0
UNTIL_S = 120.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--mode", required=True, choices=("junk", "oversized", "hellos"))
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--secret", action="store_true", help="the node has a secret: sign with another")
    parser.add_argument("--backend", default="mooncake")
    parser.add_argument("--sizes", default="")
    parser.add_argument("--exact", type=int, default=0)
    parser.add_argument("--result", required=True)
    parser.add_argument("--until", default="", help="junk: past --seconds, flood on until this "
                        "file exists")
    parser.add_argument("--hold", default="", help="junk: after the flood, keep the connections "
                        "open until this file exists (so that none of it is lost with them)")
    return parser.parse_args()


def dealer(context: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDTIMEO, 100)
    sock.connect(f"tcp://{endpoint}")
    return sock


def hello(backend: str, **change) -> protocol.Hello:
    message = protocol.Hello(protocol.PROTOCOL_VERSION, "flooder", backend, LAYOUT.to_dict(),
                             LAYOUT.layout_hash(), b"127.0.0.1:1", [], [], nonce=os.urandom(16),
                             sent_at=time.time())
    return msgspec.structs.replace(message, **change)


def junk_items(args, rng: np.random.Generator) -> list[tuple[str, list[bytes]]]:
    """(how the node counts it, frames) for every kind of junk; Hellos are made fresh."""
    samples = [hello(args.backend), protocol.RequestPages(5, [1, 2, 3], 192), protocol.Abort(5, "x"),
               protocol.ChunkDone(5, 0, ok=True, last=True), protocol.Heartbeat(1.0)]
    items: list[tuple[str, list[bytes]]] = []
    for message in samples:
        data = protocol.encode(message)
        items += [("undecodable", [data[:n]]) for n in range(1, min(len(data), 48))]
        items.append(("undecodable", [data, data]))
    items += [("undecodable", [b"\xc1" + rng.bytes(int(n))]) for n in rng.integers(0, 200, 100)]
    items += [("out_of_place", [protocol.encode(m)]) for m in samples[1:]] * 10
    return items


def refused_hello(args) -> bytes:
    if args.secret:  # well formed, signed with a secret the node does not hold
        message = hello(args.backend)
        return protocol.encode(msgspec.structs.replace(
            message, auth=auth.sign(b"not-the-secret", protocol.signed_bytes(message))))
    return protocol.encode(hello(args.backend, version=protocol.PROTOCOL_VERSION + 1))


def flood(args) -> dict:
    rng = np.random.default_rng(5)
    items = junk_items(args, rng)
    context = zmq.Context()
    socks = [dealer(context, args.endpoint) for _ in range(args.connections)]
    sent = {"undecodable": 0, "out_of_place": 0, "hello": 0}
    start = time.monotonic()
    end = look = start + args.seconds
    until_seen = not args.until
    i = 0
    while True:
        now = time.monotonic()
        if now >= look:  # past --seconds: look for --until every 50 ms
            until_seen = until_seen or os.path.exists(args.until)
            if until_seen or now >= end + UNTIL_S:
                break
            look = now + 0.05
        sock = socks[i % len(socks)]
        kind, frames = ("hello", [refused_hello(args)]) if i % 50 == 49 else items[i % len(items)]
        i += 1
        try:
            sock.send_multipart(frames)
        except zmq.Again:  # the node's queue for this connection is full: it reads at its pace
            continue
        sent[kind] += 1
    write_json_atomic(args.result, {"sent": sent, "seconds": time.monotonic() - start,
                                    "until_seen": until_seen})
    held = time.monotonic()
    while args.hold and not os.path.exists(args.hold) and time.monotonic() - held < HOLD_S:
        time.sleep(0.05)
    for sock in socks:
        sock.close(0)
    context.term()
    return {}


def cut_off_and_back(monitor: zmq.Socket) -> float:
    """Seconds until the connection was closed by the node and made again by ZMQ."""
    started = time.monotonic()
    seen: list[int] = []
    while not (zmq.EVENT_DISCONNECTED in seen
               and zmq.EVENT_CONNECTED in seen[seen.index(zmq.EVENT_DISCONNECTED):]):
        if time.monotonic() - started > CONNECT_TIMEOUT_S:
            raise SystemExit(f"the node did not close the connection: events {seen}")
        if monitor.poll(100):
            seen.append(recv_monitor_message(monitor)["event"])
    return time.monotonic() - started


def connected(monitor: zmq.Socket) -> None:
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while time.monotonic() < deadline:
        if monitor.poll(100) and recv_monitor_message(monitor)["event"] == zmq.EVENT_CONNECTED:
            return
    raise SystemExit("never connected")


@contextlib.contextmanager
def monitored_dealer(endpoint: str):
    """A DEALER socket connected to ``endpoint`` and its monitor of (dis)connections; closed
    after a clean exit, flushing what is queued (a failure exits the process at once)."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 30_000)
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    sock.connect(f"tcp://{endpoint}")
    connected(monitor)
    yield sock, monitor
    sock.disable_monitor()
    monitor.close(0)
    sock.close()
    context.term()


def oversized(args) -> dict:
    with monitored_dealer(args.endpoint) as (sock, monitor):
        cut = []
        for size in (int(s) for s in args.sizes.split(",")):
            sock.send(b"\xc1" * size, copy=False)
            cut.append(cut_off_and_back(monitor))
        if args.exact:
            sock.send(b"\xc1" * args.exact)
    return {"cut_off_seconds": cut, "exact": args.exact}


def hellos(args) -> dict:
    with monitored_dealer(args.endpoint) as (sock, monitor):
        cut, sizes = [], []
        many = [BufferDescriptor(i, "kv", 2**40 + i * 4096, 4096, 64) for i in range(600_000)]
        for _ in range(3):
            data = msgspec.msgpack.encode(hello(args.backend, buffers=many))
            sizes.append(len(data))
            sock.send(data, copy=False)
            cut.append(cut_off_and_back(monitor))
        beyond = [BufferDescriptor(0, "kv", 4096, 4096, 64)] * (protocol.MAX_BUFFERS + 1)
        for _ in range(3):  # the protocol's own encoder would not make these
            sock.send(msgspec.msgpack.encode(hello(args.backend, buffers=beyond)))
        refusals = []
        layers = list(range(100_000))
        for _ in range(3):
            started = time.monotonic()
            sock.send(protocol.encode(hello(args.backend, layout={**LAYOUT.to_dict(), "layer_ids": layers})))
            if not sock.poll(30_000):
                raise SystemExit("no answer to a Hello of 100,000 layers")
            ack = protocol.decode(sock.recv())
            refusals.append({"ok": ack.ok, "reason": ack.reason, "seconds": time.monotonic() - started})
        return {"sizes": sizes, "cut_off_seconds": cut, "beyond_the_decoder": 3, "refusals": refusals}


def main() -> None:
    args = parse_args()
    result = {"junk": flood, "oversized": oversized, "hellos": hellos}[args.mode](args)
    if result:
        write_json_atomic(args.result, result)


if __name__ == "__main__":
    main()
