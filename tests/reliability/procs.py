"""Node processes for the reliability tier: started on a host, stopped by PID, never leaked.

``Processes`` is the registry a test's fixture owns: every process goes through ``start`` and
``stop_all`` (fixture teardown) terminates what is still running, kills what ignores SIGTERM,
and asserts that every PID it started is gone. ``prefill`` / ``decode`` / ``driver`` start the
``dsa-bridge`` roles and the test-only multi-prefill decode driver on a ``Host``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .. import forkserver
from ..integration.processes import cli
from .netns import Host

# PYTHONFAULTHANDLER: a node that ignores SIGTERM gets SIGABRT, which dumps its threads' stacks
NODE_ENV = {"MC_LOG_LEVEL": "ERROR", "NIXL_LOG_LEVEL": "ERROR", "UCX_LOG_LEVEL": "error",
            "PYTHONFAULTHANDLER": "1"}
REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("driver.py")
READY_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 20.0


class Hang(AssertionError):
    """A bounded wait expired: the reliability table counts these as hangs."""


class Node:
    """One OS process started by a test; its stdout and stderr go to a log file. A Python
    command line on this host is forked from the fork server (``tests/forkserver.py``: torch
    imported once); one inside a namespace (``ip netns exec``) is exec'd."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str]):
        self.name = name
        self.log_path = log_path
        with open(log_path, "w") as log:
            if argv[0] == sys.executable:
                self.process = forkserver.popen(argv, env, str(REPO), log, subprocess.STDOUT)
            else:
                self.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, env=env, cwd=REPO)
        self.endpoint = ""
        self.hung = ""  # did not exit on SIGTERM: its signal state then

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        if self.process.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL and reap (works on a stopped process too)."""
        self.signal(signal.SIGKILL)
        self.process.wait(STOP_TIMEOUT_S)

    def wait(self, timeout_s: float) -> int:
        return self.process.wait(timeout_s)

    def stop(self) -> int:
        """SIGTERM (after SIGCONT, in case a test froze it). A node still running after
        STOP_TIMEOUT_S is marked hung (its signal state and native stacks kept), gets SIGABRT
        (its Python stacks go to its log), then SIGKILL."""
        if self.process.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.hung = f"{signal_state(self.pid)}\n{native_stacks(self.pid)}"
                self.signal(signal.SIGABRT)
                try:
                    self.process.wait(5)
                except subprocess.TimeoutExpired:
                    self.kill()
        return self.process.returncode

    def counters(self) -> dict:
        """The counters a stopped ``dsa-bridge prefill`` wrote on exit (``prefill`` gives it a
        ``--summary-file``)."""
        path = self.log_path.with_suffix(".prefill.json")
        assert path.exists(), f"{self.name} wrote no counters to {path}:\n{self.output()[-3000:]}"
        return json.loads(path.read_text())["counters"]


def signal_state(pid: int) -> str:
    """The signal masks of every thread of a process (why it may not have exited)."""
    lines = []
    for tid in sorted(os.listdir(f"/proc/{pid}/task")):
        with open(f"/proc/{pid}/task/{tid}/status") as status:
            masks = " ".join(line.split(":")[0] + "=" + line.split()[1] for line in status
                             if line.startswith(("Name", "State", "SigPnd", "ShdPnd", "SigBlk",
                                                 "SigIgn", "SigCgt")))
        lines.append(f"{tid}: {masks}")
    return "\n".join(lines)


def native_stacks(pid: int) -> str:
    """Every thread's C stack of a live process (gdb, bounded), or why there is none."""
    try:
        result = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 12"],
                                capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"no native stacks: {exc}"
    return "\n".join(line for line in result.stdout.splitlines() if line.startswith(("Thread", "#")))


def gone(pid: int) -> bool:
    """True when no process (not even a zombie) has this PID."""
    return not os.path.exists(f"/proc/{pid}")


class Processes:
    """Every process a test starts; ``stop_all`` stops them and asserts none is left."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.nodes: list[Node] = []

    def start(self, name: str, argv: list[str], host: Host | None = None,
              env: dict[str, str] | None = None) -> Node:
        full_env = {**os.environ, **NODE_ENV, **(env or {})}
        node = Node(name, host.command(argv) if host else argv, self.tmp / f"{name}.log", full_env)
        self.nodes.append(node)
        return node

    def stop_all(self) -> None:
        for node in reversed(self.nodes):
            node.stop()
        leaked = [(n.name, n.pid) for n in self.nodes if not gone(n.pid)]
        assert not leaked, f"processes still present after stop: {leaked}"
        hung = [n for n in self.nodes if n.hung]
        if hung:
            raise Hang("did not exit on SIGTERM: " + "; ".join(
                f"{n.name} (pid {n.pid}):\n{n.hung}\n{n.output()[-4000:]}" for n in hung))


def wait_file(node: Node, path: Path, timeout_s: float = READY_TIMEOUT_S) -> dict:
    """The JSON ``node`` writes to ``path``; fails if the node exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if node.process.poll() is not None:
            raise AssertionError(f"{node.name} exited with {node.process.returncode} before "
                                 f"writing {path.name}:\n{node.output()[-3000:]}")
        if time.monotonic() > deadline:
            raise Hang(f"{node.name} did not write {path.name} within {timeout_s:.0f}s")
        time.sleep(0.05)
    return json.loads(path.read_text())


def prefill(procs: Processes, host: Host, backend: str, *extra: str, name: str = "prefill",
            env: dict[str, str] | None = None) -> Node:
    """``dsa-bridge prefill`` on the host's address; ``listening`` waits for its endpoint; its
    counters go to ``<name>.prefill.json`` when it stops (``Node.counters``)."""
    return procs.start(name, cli("prefill", "--listen", f"{host.address}:0", "--ready-file",
                                 str(procs.tmp / f"{name}.ready.json"), "--summary-file",
                                 str(procs.tmp / f"{name}.prefill.json"), "--backend", backend,
                                 *extra),
                       host, {**host.engine_env(backend), **(env or {})})


def listening(procs: Processes, *nodes: Node) -> None:
    """Wait until every prefill node is listening; sets each one's ``endpoint``."""
    for node in nodes:
        node.endpoint = wait_file(node, procs.tmp / f"{node.name}.ready.json")["endpoint"]


def decode(procs: Processes, host: Host, backend: str, endpoint: str, *extra: str,
           name: str = "decode", env: dict[str, str] | None = None) -> Node:
    """``dsa-bridge decode`` against ``endpoint``; its summary goes to ``<name>.summary.json``."""
    return procs.start(name, cli("decode", "--prefill", endpoint, "--engine-host", host.address,
                                 "--backend", backend, "--summary-file",
                                 str(procs.tmp / f"{name}.summary.json"), *extra),
                       host, {**host.engine_env(backend), **(env or {})})


def driver(procs: Processes, host: Host, backend: str, endpoints: list[str], *extra: str,
           name: str = "driver") -> Node:
    """The test-only decode driver (``driver.py``) against several prefill endpoints."""
    argv = [sys.executable, str(DRIVER), "--engine-host", host.address, "--backend", backend,
            "--summary-file", str(procs.tmp / f"{name}.summary.json")]
    for endpoint in endpoints:
        argv += ["--prefill", endpoint]
    return procs.start(name, [*argv, *extra], host, host.engine_env(backend))


def summary(procs: Processes, node: Node, timeout_s: float) -> dict:
    """Wait for a decode/driver process to exit and return the summary it wrote."""
    try:
        node.wait(timeout_s)
    except subprocess.TimeoutExpired:
        raise Hang(f"{node.name} not done within {timeout_s:.0f}s:\n"
                             f"{node.output()[-3000:]}") from None
    path = procs.tmp / f"{node.name}.summary.json"
    assert path.exists(), f"{node.name} exited {node.process.returncode} with no summary:\n" \
                          f"{node.output()[-3000:]}"
    return json.loads(path.read_text())
