"""A decode that was cut off recovers: the prefill process is frozen (SIGSTOP) for longer than
the decode's peer timeout, so the decode marks it dead; after SIGCONT, with junk still arriving
from a hostile process, a request through the public API succeeds within a bound, byte-exact,
without a new DecodeNode (the decode re-handshakes with a new epoch)."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest

from dsa_bridge.transfer.backends import create_backend
from dsa_bridge.transfer.decode import DecodeNode
from dsa_bridge.transfer.launcher.drivers import count_mismatches
from dsa_bridge.transfer.request import KVPoll

from ..transfer.helpers import wait_for
from .helpers import DEEPSEEK, make_pool, settled
from .test_flood import FLOOD_S, flooder, serve

CATEGORY = "faults injected"
RECOVERY_S = 30.0


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_a_decode_that_was_cut_off_recovers(backend, procs, ledger):
    node, port = serve(procs, backend)
    decode = DecodeNode(make_pool(DEEPSEEK, 24), create_backend(backend), node.endpoint,
                        peer_timeout_s=2.0)
    try:
        first = decode.receiver(1)
        first.init(np.arange(1, 5))
        wait_for(lambda: settled(first), 60, "a request before the freeze")
        assert first.poll() == KVPoll.Success
        decode.forget(first)
        node.signal(signal.SIGSTOP)
        wait_for(lambda: not decode.peers[0].alive, 30, "the decode marking the prefill dead")
        node.signal(signal.SIGCONT)
        hostile, _ = flooder(procs, node.endpoint, "junk", "--seconds", str(FLOOD_S))
        deadline, room, ok = time.monotonic() + RECOVERY_S, 100, False
        while not ok and time.monotonic() < deadline:
            receiver = decode.receiver(room)
            receiver.init(np.arange(5, 9))
            wait_for(lambda r=receiver: settled(r), 60, f"room {room}")
            ok = receiver.poll() == KVPoll.Success
            if ok:
                assert count_mismatches(decode.pool, room, np.arange(5, 9)) == 0
            wait_for(receiver.can_release, 60, f"room {room} releasable")
            decode.forget(receiver)
            room += 1
            time.sleep(0.2)
        assert ok, f"no request succeeded within {RECOVERY_S:.0f}s of the prefill's return"
        assert decode.peers[0].alive
        hostile.wait(60)
    finally:
        decode.close()
    assert node.stop() == 0
    ledger.record(tried=1, ok=1)
