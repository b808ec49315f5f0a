"""Rank processes of the SGLang tier, forked from a server that imported torch and sglang once.

A rank script's own start is mostly ``import sglang`` (about ten CPU-seconds here); Python's
``forkserver`` start method runs one server process per test process that imports the modules
of ``PRELOAD`` once and forks each rank from it. Every rank is still its own OS process (its own
PID, engine, sockets and pools, stopped by the test by that PID), run as ``python -m MODULE
ARGS`` would run it (``runpy``, its own ``sys.argv``, environment and working directory, its
stdout and stderr on the files or pipes given): only the import is shared. Nothing is preloaded
that starts a thread (the engines' modules do): a fork copies only the thread that forks.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
from multiprocessing import reduction

PRELOAD = ["tests.sglang.conftest", "sglang.srt.disaggregation.prefill", "sglang.srt.disaggregation.decode",
           "sglang.srt.mem_cache.memory_pool", "sglang.srt.plugins", "requests"]

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOAD)


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
    the interpreter runs ``python -m MODULE ARGS...`` or ``python -c CODE``."""
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    option, target, *args = argv
    if option == "-m":
        sys.argv = [target, *args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = ["-c", *args]
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 (python -c)


class RankProcess:
    """``python ARGV`` (``-m MODULE ARGS...`` or ``-c CODE``) forked, with the calls of
    ``subprocess.Popen`` the tests use: ``pid``, ``poll``, ``wait`` (``subprocess.TimeoutExpired``
    past its timeout), ``kill``, ``send_signal``, ``returncode`` (``-N`` for a process killed by
    signal N), and ``stdout``/``stderr`` for ``subprocess.PIPE``."""

    def __init__(self, argv: list[str], env: dict, cwd: str, stdout, stderr):
        ends, self.stdout, self.stderr = [], None, None
        for given, name in ((stdout, "stdout"), (stderr, "stderr")):
            if given == subprocess.PIPE:
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

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


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
