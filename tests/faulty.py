"""TEST-ONLY fault injection at the backend seam: wraps a real backend and makes writes misbehave.

It lives in the tests, never in the installed package. Tests use it in-process, or select it in
a ``dsa-bridge prefill`` process started through ``tests/fault_cli.py`` (the real command with
its backend wrapped here) by the environment, read once at start-up:

- ``DSA_BRIDGE_FAULT_WRITE_EVERY=N``: every Nth write writes the first half of its descriptors,
  then raises BackendError, as a failed Mooncake batch leaves part of its data written;
- ``DSA_BRIDGE_FAULT_WRITE_DELAY_MS=D``: every write writes the first half of its descriptors,
  sleeps D ms, then writes the rest, so a write stays in flight (bytes still landing) long enough
  for a test to abort its request or kill a node meanwhile (``HALF_LANDED`` is logged, with the
  peer, when the sleep begins);
- ``DSA_BRIDGE_FAULT_FLIP_EVERY=N``: every Nth write lands whole, then one byte of its
  destination is flipped — the last byte of its middle descriptor, overwritten through the
  engine with the inverse of the source byte — as corruption on the way would leave it, for the
  end-to-end checksums to catch (CPU memory only: the source byte is read directly).

When it closes it logs how many writes were attempted (``WRITES_ATTEMPTED``), so a test can
count the failures against the writes the node really made (its writer batches chunks, so the
number of writes depends on timing). Everything else is passed through to the wrapped backend
unchanged.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time

import numpy as np

from dsa_bridge.plugin.descriptors import BufferDescriptor, raw_region
from dsa_bridge.transfer.backends.base import BackendError, TransferBackend

log = logging.getLogger(__name__)

EVERY_ENV = "DSA_BRIDGE_FAULT_WRITE_EVERY"
DELAY_ENV = "DSA_BRIDGE_FAULT_WRITE_DELAY_MS"
FLIP_ENV = "DSA_BRIDGE_FAULT_FLIP_EVERY"
HALF_LANDED = "TEST-ONLY fault: half of a write landed, the rest follows after the delay"
# logged with the count when the backend closes: how many writes the node attempted in all
WRITES_ATTEMPTED = "TEST-ONLY fault: writes attempted"


class FaultyBackend:
    """A TransferBackend whose writes fail every ``fail_every``-th call, land slowly, and/or
    corrupt one byte every ``flip_every``-th call."""

    def __init__(self, inner: TransferBackend, *, fail_every: int = 0, delay_s: float = 0.0,
                 flip_every: int = 0):
        if fail_every < 0 or delay_s < 0 or flip_every < 0:
            raise ValueError(f"fail_every, delay_s and flip_every must be >= 0, got {fail_every}, "
                             f"{delay_s}, {flip_every}")
        self.inner = inner
        self.name = inner.name
        self.tick_ms = inner.tick_ms
        self.needs_progress = inner.needs_progress
        self.fail_every = fail_every
        self.delay_s = delay_s
        self.flip_every = flip_every
        self.flipped: list[int] = []  # destination addresses of the flipped bytes
        self._scratch = np.zeros(64, dtype=np.uint8)  # the source of a flipped byte, registered
        self.writes = 0
        self.in_flight = threading.Event()  # set while a delayed write has landed only half
        self._lock = threading.Lock()

    def register(self, regions: list[BufferDescriptor]) -> None:
        if self.flip_every:
            if any(region.device != "cpu" for region in regions):
                raise ValueError("the flip fault reads source bytes directly: CPU memory only")
            regions = [*regions, raw_region(self._scratch.ctypes.data, self._scratch.nbytes)]
        self.inner.register(regions)

    def unregister(self, regions: list[BufferDescriptor]) -> None:
        self.inner.unregister(regions)

    def metadata(self) -> bytes:
        return self.inner.metadata()

    def connect(self, peer_metadata: bytes) -> str:
        return self.inner.connect(peer_metadata)

    def write(self, peer: str, src: np.ndarray, dst: np.ndarray, length: np.ndarray, *,
              timeout_s: float) -> None:
        with self._lock:
            self.writes += 1
            fail = self.fail_every and self.writes % self.fail_every == 0
            flip = self.flip_every and self.writes % self.flip_every == 0
        half = max(1, len(src) // 2)
        self.inner.write(peer, src[:half], dst[:half], length[:half], timeout_s=timeout_s)
        if fail:
            raise BackendError(self.name, "write", f"injected failure (write {self.writes}, every "
                                                   f"{self.fail_every}); half the data written",
                               peer=peer, code=-1)
        if self.delay_s:
            self.in_flight.set()
            log.warning("%s (write %d, peer %s)", HALF_LANDED, self.writes, peer)
            time.sleep(self.delay_s)
            self.in_flight.clear()
        if half < len(src):
            self.inner.write(peer, src[half:], dst[half:], length[half:], timeout_s=timeout_s)
        if flip:
            self._flip(peer, src, dst, length, timeout_s)

    def _flip(self, peer: str, src: np.ndarray, dst: np.ndarray, length: np.ndarray,
              timeout_s: float) -> None:
        i = len(src) // 2
        last = int(length[i]) - 1
        self._scratch[0] = ctypes.string_at(int(src[i]) + last, 1)[0] ^ 0xFF
        target = int(dst[i]) + last
        self.inner.write(peer, np.array([self._scratch.ctypes.data], dtype=np.uint64),
                         np.array([target], dtype=np.uint64), np.array([1], dtype=np.uint64),
                         timeout_s=timeout_s)
        self.flipped.append(target)
        log.warning("TEST-ONLY fault: flipped the byte at %#x after write %d", target, self.writes)

    def disconnect(self, peer: str) -> None:
        self.inner.disconnect(peer)

    def progress(self) -> None:
        self.inner.progress()

    def transport(self) -> str:
        return self.inner.transport()

    def close(self) -> None:
        log.warning("%s: %d", WRITES_ATTEMPTED, self.writes)
        self.inner.close()


def wrap_from_env(backend: TransferBackend, environ=os.environ) -> TransferBackend:
    """``backend`` wrapped in a FaultyBackend when a fault variable is set, else unchanged."""
    every = int(environ.get(EVERY_ENV, "0") or 0)
    delay_ms = float(environ.get(DELAY_ENV, "0") or 0)
    flip = int(environ.get(FLIP_ENV, "0") or 0)
    if not every and not delay_ms and not flip:
        return backend
    log.warning("TEST-ONLY fault injection active: fail every %d writes, delay %.0f ms, flip a "
                "byte every %d writes", every, delay_ms, flip)
    return FaultyBackend(backend, fail_every=every, delay_s=delay_ms / 1000, flip_every=flip)
