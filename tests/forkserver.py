"""Test processes forked from a server that imported their heavy modules once.

A node process's own start is mostly imports: ``import torch`` takes about two CPU-seconds here,
``import sglang`` about ten. Python's ``forkserver`` start method runs one server process per
test process that imports the modules of ``preload`` once and forks each process from it. Every
process is still its own OS process (its own PID, engine, sockets and pools, stopped by the test
by that PID), run as ``python -m MODULE ARGS`` would run it (``runpy``, its own ``sys.argv``,
environment and working directory, its stdout and stderr on the files or pipes given, Python's
fault handler on where ``PYTHONFAULTHANDLER`` asks): only the import is shared. Nothing is
preloaded that starts a thread (the engines' modules do): a fork copies only the thread that
forks. ``popen`` is ``subprocess.Popen`` for a ``[sys.executable, ...]`` command line.

The main suite preloads torch (``MAIN_PRELOAD``, set by ``tests/conftest.py``); the SGLang tier
sglang (``tests/sglang/conftest.py``). Tests that run the real command line as a user types it
(the README's, the console script) still exec it.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
from multiprocessing import reduction

MAIN_PRELOAD = ["torch", "numpy", "msgspec", "zmq"]

_CONTEXT = multiprocessing.get_context("forkserver")


def preload(modules: list[str]) -> None:
    """What the fork server imports once (before it starts: the first process forked)."""
    _CONTEXT.set_forkserver_preload(modules)


def context() -> multiprocessing.context.BaseContext:
    """The fork server's context, for a ``multiprocessing.Process`` with its own target."""
    return _CONTEXT


class _Fd:
    """A descriptor the forked rank receives as its own (sent with the fork request)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _detach, (reduction.DupFd(self.fd),)


def _detach(dup) -> int:
    return dup.detach()


def _run(argv: list[str], env: dict, cwd: str, out: int, err: int) -> None:
    """In the forked process: its stdout and stderr, directory and environment, then ``argv`` as
    the interpreter runs ``python -m MODULE ARGS...``, ``python -c CODE`` or ``python SCRIPT
    ARGS...``."""
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if env.get("PYTHONFAULTHANDLER"):  # read at an interpreter's start, which a fork skips
        faulthandler.enable()
    option, *args = argv
    if option == "-m":
        sys.argv = list(args)
        runpy.run_module(args[0], run_name="__main__", alter_sys=True)
    elif option == "-c":
        sys.argv = ["-c", *args[1:]]
        exec(compile(args[0], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 (python -c)
    else:  # a script
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(option)))
        runpy.run_path(option, run_name="__main__")


class RankProcess:
    """``python ARGV`` (``-m MODULE ARGS...``, ``-c CODE`` or ``SCRIPT ARGS...``) forked, with the calls of
    ``subprocess.Popen`` the tests use: ``pid``, ``poll``, ``wait`` (``subprocess.TimeoutExpired``
    past its timeout), ``kill``, ``send_signal``, ``returncode`` (``-N`` for a process killed by
    signal N), ``stdout``/``stderr`` for ``subprocess.PIPE``, and ``stderr=subprocess.STDOUT``."""

    def __init__(self, argv: list[str], env: dict, cwd: str, stdout, stderr):
        ends, self.stdout, self.stderr = [], None, None
        for given, name in ((stdout, "stdout"), (stderr, "stderr")):
            if given == subprocess.STDOUT:
                ends.append((ends[0][0], False))
            elif given == subprocess.PIPE:
                read, write = os.pipe()
                setattr(self, name, open(read, encoding="utf-8"))  # noqa: SIM115 (the caller reads it)
                ends.append((write, True))
            else:
                ends.append((given.fileno(), False))
        self._process = _CONTEXT.Process(target=_run, daemon=False, args=(
            argv, env, cwd, _Fd(ends[0][0]), _Fd(ends[1][0])))
        try:
            self._process.start()
        finally:
            for fd, ours in ends:
                if ours:
                    os.close(fd)
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self._process.name, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def popen(argv: list[str], env: dict, cwd: str, stdout, stderr) -> RankProcess:
    """``subprocess.Popen([sys.executable, *ARGV], ...)`` (stdin from /dev/null) as a forked
    process."""
    if argv[0] != sys.executable:
        raise ValueError(f"not a Python command line: {argv[:2]}")
    return RankProcess(argv[1:], env, cwd, stdout, stderr)


def run(argv: list[str], env: dict, cwd: str, timeout_s: float) -> subprocess.CompletedProcess:
    """``subprocess.run(["python", *argv], capture_output=True, text=True)`` as a forked process;
    killed past ``timeout_s`` (``subprocess.TimeoutExpired``)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = RankProcess(argv, env, cwd, out, err)
        try:
            proc.wait(timeout_s)
        finally:
            proc.kill()
            proc.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(argv, proc.returncode, out.read(), err.read())


def stop_server() -> None:
    """The fork server, if this process started one, killed by its PID and waited for (a graceful
    exit unloads sglang for tens of seconds under load; its ranks are stopped by their tests)."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if server._forkserver_pid is not None:
        os.kill(server._forkserver_pid, signal.SIGKILL)
    server._stop()
