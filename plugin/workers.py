"""Helper threads for the pool's CPU copies: a list of independent tasks, shared out.

The caller and up to ``threads - 1`` helper threads take tasks from one list until it is empty;
the caller then waits only for the tasks a helper has already begun. A helper the OS does not
schedule (a busy machine) therefore delays nothing but the task it holds, and with no helper
running at all the caller does every task itself. Tasks must release the GIL to gain anything
(numpy's copies do). Helpers are daemon threads started on first use and kept; a forked child
starts its own.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence


class _Job:
    """One list of tasks; ``work`` takes and runs tasks until none is left (or one failed)."""

    def __init__(self, tasks: Sequence[Callable[[], None]]) -> None:
        self._tasks = tasks
        self._next = 0
        self._running = 0
        self._error: BaseException | None = None
        self._cond = threading.Condition()

    def work(self) -> None:
        while True:
            with self._cond:
                if self._next == len(self._tasks) or self._error is not None:
                    return
                task = self._tasks[self._next]
                self._next += 1
                self._running += 1
            try:
                task()
            except BaseException as exc:  # handed to the caller by wait()
                with self._cond:
                    self._error = self._error or exc
            finally:
                with self._cond:
                    self._running -= 1
                    self._cond.notify_all()

    def wait(self) -> None:
        """After the caller's own ``work``: until every begun task is done; re-raise a failure."""
        with self._cond:
            self._cond.wait_for(lambda: self._running == 0)
        if self._error is not None:
            raise self._error


class _Helpers:
    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def _serve(self, jobs: queue.SimpleQueue[_Job]) -> None:
        while True:
            jobs.get().work()

    def run(self, tasks: Sequence[Callable[[], None]], threads: int) -> None:
        helpers = min(threads, len(tasks)) - 1
        if helpers <= 0:
            for task in tasks:
                task()
            return
        job = _Job(tasks)
        with self._lock:
            while len(self._threads) < helpers:
                thread = threading.Thread(target=self._serve, args=(self._jobs,), daemon=True,
                                          name=f"dsa-bridge-copy-{len(self._threads)}")
                thread.start()
                self._threads.append(thread)
            for _ in range(helpers):
                self._jobs.put(job)
        job.work()
        job.wait()


_HELPERS = _Helpers()
os.register_at_fork(after_in_child=_HELPERS._reset)  # the parent's threads do not exist there


def run_tasks(tasks: Sequence[Callable[[], None]], threads: int) -> None:
    """Run every task once, on the calling thread and up to ``threads - 1`` helpers; returns when
    all are done and re-raises the first failure (no new task starts after one)."""
    _HELPERS.run(tasks, threads)
