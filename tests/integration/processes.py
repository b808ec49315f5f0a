"""Start and stop real dsa-bridge node processes for integration tests (always by PID)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .. import forkserver

NODE_ENV = {"MC_LOG_LEVEL": "ERROR", "NIXL_LOG_LEVEL": "ERROR", "UCX_LOG_LEVEL": "error"}


def cli(*arguments: str) -> list[str]:
    """The real command, with the test-only fault hook (tests/fault_cli.py)."""
    return [sys.executable, "-m", "tests.fault_cli", *arguments]


class PrefillProcess:
    """``dsa-bridge prefill`` in its own process, answering every room with the pattern."""

    def __init__(self, tmp: Path, backend: str, *extra: str, ready_timeout_s: float = 60.0):
        ready = tmp / f"prefill-{time.monotonic_ns()}.json"
        self.log = open(tmp / f"prefill-{ready.stem}.log", "w")  # noqa: SIM115 - closed in stop()
        self.process = forkserver.popen(  # torch imported once (tests/forkserver.py)
            cli("prefill", "--listen", "127.0.0.1:0", "--ready-file", str(ready), "--backend",
                backend, *extra), {**os.environ, **NODE_ENV}, os.getcwd(), self.log,
            subprocess.STDOUT)
        deadline = time.monotonic() + ready_timeout_s
        while not ready.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"prefill did not start: {self.output()[-2000:]}")
            time.sleep(0.05)
        self.endpoint = json.loads(ready.read_text())["endpoint"]

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.log.close()
