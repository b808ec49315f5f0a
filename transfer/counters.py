"""Per-node transfer counters: what really moved, so a skipped transfer cannot pass a test."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass
class Counters:
    requests_ok: int = 0
    requests_failed: int = 0
    chunks: int = 0
    bytes: int = 0
    descriptors: int = 0
    engine_failures: int = 0
    handshakes_ok: int = 0
    handshakes_refused: int = 0
    bad_messages: int = 0
    write_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "_lock"}
