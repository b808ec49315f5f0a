"""A prefill that restarts is found again: decode serves its new requests without a restart.

sglang's prefill server runs the bootstrap server; a restarted prefill (a new process) serves it
on the same bootstrap port, but its ranks listen on new ports. Here, as separate OS processes:
a decode rank (``restart_rank.py``: ONE manager for every request, as a decode server outlives
the prefill) and a prefill rank (``pd_rank.py``) that serves a request, then is killed (SIGKILL,
its connections and bootstrap server gone with it); a new prefill process registers new
endpoints, and decode's next request, through the same manager, reaches it: the manager sees
its node cannot reach the prefill, looks the prefill up again, retires the old node (closed once
its requests are forgotten) and connects anew. Both requests byte-exact on KV, indexer and aux.
"""

from __future__ import annotations

import json
import queue
import threading
from pathlib import Path

import pytest

from tests.conftest import require_engine

from .conftest import SGLANG_MISSING
from .test_sglang_conn import config, start_rank

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

MODEL = {"layers": 4, "model_layers": 4, "kv_cache_dim": 656}


class Rank:
    """A rank's process, its stdout lines and its stderr read by threads (neither pipe fills),
    printed words waited for with a bound."""

    def __init__(self, role: str, cfgs: list[dict]):
        self.proc = start_rank(role, cfgs)
        self.lines: queue.Queue[str] = queue.Queue()
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [threading.Thread(target=self._read, args=(self.proc.stdout, True), daemon=True),
                         threading.Thread(target=self._read, args=(self.proc.stderr, False), daemon=True)]
        for reader in self._readers:
            reader.start()

    def _read(self, pipe, is_stdout: bool) -> None:
        for line in pipe:
            (self.out if is_stdout else self.err).append(line)
            if is_stdout:
                self.lines.put(line.strip())

    def expect(self, word: str, timeout_s: float) -> None:
        try:
            while self.lines.get(timeout=timeout_s) != word:
                pass
        except queue.Empty:
            raise AssertionError(f"{word!r} not printed within {timeout_s}s:\n"
                                 f"{''.join(self.err)[-6000:]}") from None

    def result(self, timeout_s: float) -> list[dict]:
        """Wait for the process to end by itself; its RESULT line."""
        self.proc.wait(timeout=timeout_s)
        for reader in self._readers:
            reader.join(timeout=30)
        assert self.proc.returncode == 0, "".join(self.err)[-4000:]
        line = next(ln for ln in self.out if ln.startswith("RESULT "))
        return json.loads(line[len("RESULT "):])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_a_killed_prefill_restarted_on_new_ports_is_served_without_restarting_decode(engine, tmp_path):
    require_engine(engine)
    base = config(engine, MODEL)
    cfgs = [{**base, "room": base["room"] + i, "seed": 7 + i, "go_file": str(tmp_path / f"go{i}")}
            for i in range(2)]
    decode = Rank("restart", cfgs)
    first = Rank("prefill", [{**cfgs[0], "killed_after": True}])
    second = None
    try:
        first.expect("READY", 180)  # registered: decode may ask for its request
        Path(cfgs[0]["go_file"]).touch()
        first.expect("SERVED", 120)
        decode.expect("FINISHED", 120)  # its end reached decode (prefill's Success may not have)
        first.kill()  # SIGKILL: no goodbye, its bootstrap server gone too
        second = Rank("prefill", [cfgs[1]])  # the restart: same bootstrap port, new rank ports
        second.expect("READY", 180)
        Path(cfgs[1]["go_file"]).touch()
        served, restarted = decode.result(300)
        second.result(120)
    finally:
        for rank in (decode, first, second):
            if rank is not None:
                rank.kill()
    for result in (served, restarted):
        assert result["poll"] == 4, result.get("reason")  # Success
        assert result["mismatched"] == [] and result["others_sentinel"]
        assert result["aux_exact"] and result["aux_others_sentinel"]
    assert served["prefill"] != restarted["prefill"]  # the new process's endpoint
    assert restarted["nodes"] == 1 and restarted["retired"] == 0  # the old node closed, idle
