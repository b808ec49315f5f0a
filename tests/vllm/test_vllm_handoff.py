"""The worker's GIL hand-over: while a transfer is in flight, each ``get_finished`` lets a node
thread that a message woke take the GIL at once, not at the interpreter's forced switch.

vLLM's engine core steps in a Python loop without pause while a request waits for its KV. Here
the steps are pure Python and a thread stands for a node's control thread: blocked in a system
call (as in its poll), woken by a byte on a pipe, it then needs the GIL. Counted in steps, not
seconds: without the hand-over it waits for the forced switch (5 ms: tens of steps), with it
for the step that sleeps."""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time

import pytest

from .conftest import VLLM_MISSING

if VLLM_MISSING:
    pytest.skip(VLLM_MISSING, allow_module_level=True)

from dsa_bridge.plugin.vllm.options import BridgeOptions  # noqa: E402
from dsa_bridge.plugin.vllm.worker import BridgeWorker  # noqa: E402
from dsa_bridge.transfer.request import KVPoll  # noqa: E402

TRIALS = 15
STEP_S = 0.0001  # a step's pure-Python work
MAX_STEPS = 1000  # a trial's bound (the forced switch comes after about 50 steps)


def steps_until_woken_thread_runs(worker: BridgeWorker) -> int:
    """Wake a thread blocked on a pipe, then step (pure Python, then ``get_finished``'s
    ``transfer_results``) until it has run: the steps it took."""
    read_end, write_end = os.pipe()
    ran = threading.Event()

    def node_thread() -> None:
        os.read(read_end, 1)  # the GIL released while blocked, needed once woken
        ran.set()

    thread = threading.Thread(target=node_thread, daemon=True)
    thread.start()
    time.sleep(0.01)  # blocked in its read by now
    try:
        os.write(write_end, b"\0")
        steps = 0
        while not ran.is_set() and steps < MAX_STEPS:
            end = time.perf_counter() + STEP_S
            while time.perf_counter() < end:  # holds the GIL, as vLLM's scheduling does
                pass
            worker.transfer_results()
            steps += 1
        thread.join(1.0)
        return steps
    finally:
        os.close(read_end)
        os.close(write_end)


class Loading:
    """A decode request whose pages are still being written."""

    def poll(self) -> KVPoll:
        return KVPoll.Transferring


def test_a_step_with_a_transfer_in_flight_hands_the_gil_to_the_nodes_threads():
    assert sys.getswitchinterval() == pytest.approx(0.005)  # the interpreter's default
    worker = BridgeWorker(BridgeOptions(), producer=False, consumer=True, geometry={},
                          tp_rank=0, tp_size=1)
    idle = [steps_until_woken_thread_runs(worker) for _ in range(TRIALS)]
    worker.receivers["in flight"] = (None, Loading())
    loading = [steps_until_woken_thread_runs(worker) for _ in range(TRIALS)]
    assert statistics.median(loading) <= 3, (idle, loading)
    assert statistics.median(idle) >= 5 * statistics.median(loading), (idle, loading)
    assert worker.transfer_results() == (set(), set(), set())  # still in flight
