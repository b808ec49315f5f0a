"""Each thread's CPU seconds in a timed window, by thread name, for the bench's rank processes.

``snapshot()`` reads every thread of this process from ``/proc`` (Linux; elsewhere: none): its
name and its user + system CPU seconds. A thread Python started goes by its Python name (a
dsa-bridge node's ``decode-...-control``, ``...-verifier``; sglang's ``HeartbeatChecker``); a
thread Python did not start and that carries the process's own name is a C++ thread of an engine
or a library (Mooncake's TCP transport, which copies every byte received; torch's workers) and
goes by ``NATIVE``; the others keep the kernel's name (ZMQ's ``ZMQbg/IO/0``). ``cpu_by_thread``
(pure) sums the CPU between two snapshots per name: where a process's CPU in the window went,
e.g. how much of decode's was the engine's receiving copy and how much dsa-bridge's control
thread.
"""

from __future__ import annotations

import os
import threading

NATIVE = "native"
Snapshot = dict[int, tuple[str, float]]  # thread id -> (name, CPU seconds so far)


def snapshot() -> Snapshot:
    """Every thread of this process now: its name (as above) and CPU seconds."""
    tick = os.sysconf("SC_CLK_TCK")
    python_names = {thread.native_id: thread.name for thread in threading.enumerate()}
    try:
        own = _read(f"/proc/{os.getpid()}/comm")
        tids = os.listdir("/proc/self/task")
    except OSError:  # no /proc: nothing to report
        return {}
    threads: Snapshot = {}
    for tid in tids:
        try:
            stat = _read(f"/proc/self/task/{tid}/stat").rsplit(")", 1)[1].split()
            comm = _read(f"/proc/self/task/{tid}/comm")
        except OSError:  # it ended meanwhile
            continue
        name = python_names.get(int(tid)) or (NATIVE if comm == own else comm)
        threads[int(tid)] = (name, (int(stat[11]) + int(stat[12])) / tick)  # utime + stime
    return threads


def cpu_by_thread(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """CPU seconds per thread name between two snapshots, largest first, zeros left out: a
    thread started in between counts from zero, one ended in between is not seen."""
    spent: dict[str, float] = {}
    for tid, (name, cpu) in after.items():
        used = cpu - before.get(tid, (name, 0.0))[1]
        spent[name] = spent.get(name, 0.0) + used
    return {name: round(cpu, 3) for name, cpu in sorted(spent.items(), key=lambda kv: -kv[1])
            if cpu > 0}


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()
