"""The prefill child of ``dsa-bridge bench``: its command loop, and the bench process's handle
on it.

The child (``python -m dsa_bridge.transfer.bench.child --control ENDPOINT``) runs a real
PrefillNode; the bench process, which runs the DecodeNode (``bench.measure.TransferSession``),
drives it over a private ZMQ PAIR socket; every command (a msgpack map) gets one answer:

- ``setup``: build a pool of the given geometry, an engine backend and a PrefillNode, and answer
  its control endpoint; the bench process then builds the matching DecodeNode (the handshake).
- ``peer``: the decode node's engine metadata and buffers. The raw baseline plans with the pairs
  the node itself uses (``handshake.pair_with_peer``) and writes through the node's own engine
  (``connect`` of a peer the engine already knows returns the same handle).
- ``send``: create a sender per room (``init`` + one ``send`` of all its pages), as a prefill
  that has finished computing does; each chunk waits for decode's page ids, then goes straight
  to the node's writer. ``checksums`` switches the node's page checksums on or off for
  these requests, ``route`` sets the node's route (``auto``, ``direct``, ``staged``); the answer
  carries the node's statistics so far (as ``stats``).
- ``stats``: the node's checksum seconds so far (after the requests: their difference is what
  prefill spent checksumming them), its staged chunks and slices so far, its staging area's
  bytes and slice size, and its control thread's longest interval between two
  ticks since the last ``send`` (``max_tick_gap_ms``: how long the writer's engine calls kept
  heartbeats and deadlines waiting).
- ``idle_gap``: the longest interval between two passes of a bare loop that only polls (as the
  node's control loop does when idle: every ``tick_ms`` of its engine) for the given seconds, in
  the child, with no write in flight: the baseline for ``max_tick_gap_ms``, what the machine
  alone gives a thread that wakes that often (``idle_tick_gap_ms``).
- ``fill``: write the launcher's page pattern of a room into the given pages of every buffer, on
  the pool's device (what a prefill's forward would leave there; decode checks every byte of it:
  the GPU tier, tests/gpu);
- ``raw``: plan the given (src, dst) page lists with ``plan_writes`` (timed on its own), join the
  plans and time one ``backend.write`` of all of them: pre-built descriptors, one batch.
- ``teardown`` (close the node) and ``quit``.

The child's stdout (where NIXL and UCX log) goes to stderr; it is stopped by PID whatever
happens, and ends by itself when its parent is gone or it has been idle for ``IDLE_EXIT_S``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import zmq

from ...plugin import DSALayout, DSATokenToKVPool
from ...plugin.descriptors import BufferDescriptor
from ..backends import create_backend
from ..handshake import pair_with_peer, transfer_set
from ..launcher.page_pattern import expected_pages
from ..plan import plan_writes
from ..prefill import PrefillNode
from .channel import Driven, serve_commands

PAGE = 64
COMMAND_TIMEOUT_S = 180.0
START_TIMEOUT_S = 60.0
WRITE_TIMEOUT_S = 120.0
IDLE_EXIT_S = 900.0
PLAN_REPEAT = 5


@dataclass(frozen=True)
class Geometry:
    """A pool both sides build: a model preset cut to its first ``layers`` layers, on
    ``device`` ("cpu" or "cuda:N")."""

    model: str
    layers: int
    kv_dtype: str
    pool_tokens: int
    page_size: int = PAGE
    indexer_layout: str = "uniform"
    device: str = "cpu"

    def layout(self) -> DSALayout:
        return DSALayout.preset(self.model, end_layer=self.layers, kv_dtype=self.kv_dtype,
                                page_size=self.page_size, indexer_layout=self.indexer_layout)

    @property
    def buffers(self) -> int:
        """Buffers a request fills: every layer's KV, and each indexer the layout holds."""
        layout = self.layout()
        return layout.num_layers + len(layout.index_layer_ids)

    def pool(self) -> DSATokenToKVPool:
        return DSATokenToKVPool.from_layout(self.layout(), size=self.pool_tokens,
                                            device=self.device)


def trim_heap() -> None:
    """Free a closed node's pool now and hand the memory back to the OS: a node and its control
    loop refer to each other (only the cycle collector frees them), and glibc keeps freed blocks
    below its adaptive mmap threshold. Else one geometry's pool counts against the next one's."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim this way
        pass


class _PrefillServer:
    """What the child process does for each command (see the module docstring)."""

    def __init__(self) -> None:
        self.node: PrefillNode | None = None
        self.pairs: list = []
        self.peer = ""

    def setup(self, backend: str, geometry: dict) -> dict:
        if self.node is not None:
            raise RuntimeError("setup twice without teardown")
        pool = Geometry(**geometry).pool()
        self.node = PrefillNode(pool, create_backend(backend, host="127.0.0.1"),
                                listen="127.0.0.1:0", request_timeout_s=COMMAND_TIMEOUT_S,
                                write_timeout_s=WRITE_TIMEOUT_S)
        return {"endpoint": self.node.endpoint, "transport": self.node.backend.transport()}

    def set_peer(self, metadata: bytes, buffers: list) -> dict:
        """The pairs the node itself made for the decode node (same geometry on both sides)."""
        infos, layout = [BufferDescriptor(*b) for b in buffers], self.node.layout
        keys = transfer_set(layout, layout, layout.index_layer_ids)
        self.pairs = pair_with_peer(layout, self.node.buffers, infos, keys)
        self.peer = self.node.backend.connect(metadata)
        return {}

    def send(self, requests: list, checksums: bool = False, route: str = "direct") -> dict:
        self.node.checksums = checksums
        self.node.route = route
        stats = self.stats()
        self.node._loop.max_tick_gap_s = 0.0  # the gap the stats after these requests report
        for room, pages in requests:
            sender = self.node.sender(room)
            sender.init(len(pages))
            sender.send(np.asarray(pages, dtype=np.int64))
        return stats

    def stats(self) -> dict:
        counts = self.node.counters.snapshot()
        return {**{key: counts[key] for key in ("checksum_seconds", "staged_chunks",
                                                "staging_slices", "staging_bytes")},
                "slice_bytes": self.node._stager.slice_bytes,
                "max_tick_gap_ms": 1e3 * self.node._loop.max_tick_gap_s}

    def idle_gap(self, seconds: float) -> dict:
        poller, (quiet, unused) = zmq.Poller(), os.pipe()  # a poller with nothing would not wait
        poller.register(quiet, zmq.POLLIN)
        try:
            start = last = time.monotonic()
            gap = 0.0
            while last - start < seconds:
                poller.poll(self.node.backend.tick_ms)  # as the node's control loop polls
                now = time.monotonic()
                gap, last = max(gap, now - last), now
        finally:
            os.close(quiet)
            os.close(unused)
        return {"max_gap_ms": 1e3 * gap}

    def fill(self, room: int, pages: list) -> dict:
        pool = self.node.pool
        index = torch.as_tensor(pages, dtype=torch.int64, device=pool.device)
        for layer, kind in pool.buffer_keys():
            view = pool.page_view(layer, kind)
            view.index_copy_(0, index, expected_pages(room, layer, kind, np.arange(len(pages)),
                                                      view.shape[1]).to(view.device))
        if index.is_cuda:
            torch.cuda.synchronize(index.device)
        return {}

    def raw(self, requests: list) -> dict:
        pages = [(np.asarray(s, dtype=np.int64), np.asarray(d, dtype=np.int64)) for s, d in requests]
        plan_seconds = []
        for _ in range(PLAN_REPEAT):
            start = time.perf_counter()
            plans = [plan_writes(self.pairs, src, dst) for src, dst in pages]
            plan_seconds.append(time.perf_counter() - start)
        src, dst, length = (np.concatenate([getattr(p, key) for p in plans])
                            for key in ("src", "dst", "length"))
        start = time.perf_counter()
        self.node.backend.write(self.peer, src, dst, length, timeout_s=WRITE_TIMEOUT_S)
        return {"seconds": time.perf_counter() - start,
                "plan_seconds": statistics.median(plan_seconds),
                "descriptors": int(length.size), "nbytes": int(length.sum())}

    def teardown(self) -> dict:
        self.close()
        trim_heap()
        return {}

    def close(self) -> None:
        node, self.node, self.pairs, self.peer = self.node, None, [], ""
        if node is not None:
            node.close()


def serve(control: str) -> int:
    """The child's command loop; it ends on ``quit``, when its parent is gone, or when idle."""
    server = _PrefillServer()
    commands = {"setup": server.setup, "peer": server.set_peer, "send": server.send,
                "stats": server.stats, "raw": server.raw, "idle_gap": server.idle_gap,
                "fill": server.fill,
                "teardown": server.teardown}
    try:
        return serve_commands(control, commands, idle_exit_s=IDLE_EXIT_S)
    finally:
        server.close()


def start_child() -> Driven:
    """The prefill child, started and answering."""
    child = Driven("prefill", "dsa_bridge.transfer.bench.child", [],
                   start_timeout_s=START_TIMEOUT_S, command_timeout_s=COMMAND_TIMEOUT_S)
    try:
        child.reply()  # it started
    except BaseException:
        child.stop()
        raise
    return child


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the prefill child of dsa-bridge bench")
    parser.add_argument("--control", required=True, help="the bench process's ZMQ endpoint")
    return serve(parser.parse_args(argv).control)


if __name__ == "__main__":
    sys.exit(main())
