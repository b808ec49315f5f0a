"""A process that ends right after a Mooncake ``disconnect``, as a prefill does whose decode went
silent just before it was stopped: ``python -m tests.backends.exit_after_disconnect close|exit``.

It writes once to a peer (its own child process: ``... peer``), lets the peer end, disconnects
from it and then ends at once, after ``close()`` (``close``) or without it (``exit``). The
disconnect's lane-closing reads still run in a helper thread then; a process that ended under
them died of ``terminate called without an active exception`` (SIGABRT, in CI's vLLM tier).
Exit code 0 when it ended cleanly."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from dsa_bridge.plugin.descriptors import raw_region
from dsa_bridge.transfer.backends import create_backend

PEER_TIMEOUT_S = 60.0


def peer() -> None:
    """The peer: a registered buffer, announced on stdout; ends when its stdin gives a line."""
    backend = create_backend("mooncake", host="127.0.0.1")
    buffer = np.zeros(1 << 16, dtype=np.uint8)
    backend.register([raw_region(buffer.ctypes.data, buffer.nbytes)])
    print(backend.metadata().decode(), buffer.ctypes.data, flush=True)
    sys.stdin.readline()
    backend.close()


def main(mode: str) -> None:
    backend = create_backend("mooncake", host="127.0.0.1")
    source = np.ones(1 << 16, dtype=np.uint8)
    backend.register([raw_region(source.ctypes.data, source.nbytes)])
    child = subprocess.Popen([sys.executable, "-m", __spec__.name, "peer"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        metadata, address = child.stdout.readline().split()
        handle = backend.connect(metadata.encode())
        backend.write(handle, np.array([source.ctypes.data]), np.array([int(address)]),
                      np.array([4096]), timeout_s=PEER_TIMEOUT_S)
        child.communicate("\n", timeout=PEER_TIMEOUT_S)  # the peer is gone
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(PEER_TIMEOUT_S)
    backend.disconnect(handle)
    if mode == "close":
        backend.close()


if __name__ == "__main__":
    peer() if sys.argv[1] == "peer" else main(sys.argv[1])
