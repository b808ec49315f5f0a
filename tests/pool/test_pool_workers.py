"""plugin.workers: every task runs once, failures reach the caller, a busy helper holds up only
the task it has begun, and a forked child starts helpers of its own."""

from __future__ import annotations

import os
import threading
import time

import pytest

from dsa_bridge.plugin.workers import run_tasks

WAIT_S = 20.0


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_every_task_runs_once(threads):
    done, lock = [], threading.Lock()

    def task(i):
        def run():
            time.sleep(0.001)  # a GIL-free wait, so helpers get a share
            with lock:
                done.append(i)
        return run

    run_tasks([task(i) for i in range(40)], threads)
    assert sorted(done) == list(range(40))


def test_a_failure_reaches_the_caller_and_stops_new_tasks():
    ran = []

    def boom():
        raise RuntimeError("task 2 failed")

    tasks = [lambda: ran.append(0), lambda: ran.append(1), boom, lambda: ran.append(3)]
    with pytest.raises(RuntimeError, match="task 2 failed"):
        run_tasks(tasks, 1)
    assert ran == [0, 1]
    with pytest.raises(RuntimeError, match="task 2 failed"):
        run_tasks([boom] * 6, 2)  # from a helper or the caller, whichever took one first
    run_tasks([lambda: ran.append(9)], 2)  # nothing left behind
    assert ran == [0, 1, 9]


def test_a_busy_helper_holds_up_nothing_it_has_not_begun():
    """The helper is stuck in another call's task: a second call's tasks all run on its own
    thread, and it returns while the helper is still stuck."""
    started, release = threading.Semaphore(0), threading.Event()

    def stuck():
        started.release()
        assert release.wait(WAIT_S)

    other = threading.Thread(target=run_tasks, args=([stuck, stuck], 2))
    other.start()
    try:
        for _ in range(2):  # the other call's own thread and the helper are both stuck
            assert started.acquire(timeout=WAIT_S)
        ran_on = []
        run_tasks([lambda: ran_on.append(threading.get_ident()) for _ in range(10)], 2)
        assert ran_on == [threading.get_ident()] * 10
        assert not release.is_set() and other.is_alive()
    finally:
        release.set()
        other.join(WAIT_S)
    assert not other.is_alive()


def test_a_forked_child_starts_its_own_helpers():
    run_tasks([lambda: None] * 4, 2)  # the parent's helper exists
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if both threads shared the tasks
        code = 1
        try:
            seen, lock = set(), threading.Lock()

            def task():
                time.sleep(0.02)
                with lock:
                    seen.add(threading.get_ident())

            run_tasks([task] * 20, 2)
            code = 0 if len(seen) == 2 else 3
        finally:
            os._exit(code)
    deadline = time.monotonic() + WAIT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child did not finish its tasks")
        time.sleep(0.01)
    assert os.waitstatus_to_exitcode(status) == 0
