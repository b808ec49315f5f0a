"""Two whole vLLM ``LLM`` engines, prefill and decode, each in its own OS process with the
connector (``llm_rank``): vLLM's own calls move the prompt's KV, decode's greedy tokens equal the
ones prefill's engine generates from the prompt itself, and each decode worker's prompt rows,
read from vLLM's own cache tensors, equal those of the prefill rank it reads. An engine at TP 2
runs vLLM's own multiprocess executor: two worker processes under its one scheduler, each with
vLLM's parallel state over gloo, from which the connector takes its TP rank and brings up that
rank's dsa-bridge node."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import clear_engine_environment, require_engine
from tests.ports import free_port

from .conftest import VLLM_MISSING

if VLLM_MISSING:
    pytest.skip(VLLM_MISSING, allow_module_level=True)

from .llm_rank import PROMPT, TOKENS, write_model  # noqa: E402

pytestmark = pytest.mark.slow  # each test starts vLLM processes (tests/conftest.py)
ROOT = Path(__file__).resolve().parents[2]
RUN_S = 420.0  # a rank's whole run (vLLM's start included) on two shared cores at load 20
# vLLM's CPU executor binds each worker to a NUMA node of its own unless told otherwise; this
# machine has one ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers").
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


def control_ports(count: int) -> int:
    """A first port with ``count`` free ports from it (prefill TP rank r listens on port + r)."""
    for _ in range(100):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + count - 1))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no {count} free ports in a row after 100 tries")


# (a decode wider than its prefill, one prefill rank writing two copies, is test_vllm_pd.py's)
@pytest.mark.parametrize("widths", [(1, 1), (2, 2), (2, 1)], ids=["tp1-tp1", "tp2-tp2", "tp2-tp1"])
def test_a_decode_llm_generates_from_the_prefill_llms_kv(widths, tmp_path, monkeypatch):
    """Prefill and decode at TP widths ``widths``: decode rank d reads the whole prompt from one
    prefill rank (the MLA cache is replicated), prefill ranks it does not read from are told
    they have nothing to send, and every rank's blocks go back to vLLM."""
    clear_engine_environment(monkeypatch)
    require_engine("mooncake")
    model = write_model(tmp_path / "model")
    answers = tmp_path / "answers.json"
    procs = []
    try:
        for role, tp, extra in (("prefill", widths[0], {"engine": "mooncake",
                                                        "port": control_ports(widths[0])}),
                                ("decode", widths[1], {"engine": "mooncake"})):
            with open(tmp_path / f"{role}.log", "w") as log:  # vLLM logs on stdout too
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "tests.vllm.llm_rank", role, "--model", str(model),
                     "--extra", json.dumps(extra), "--answers", str(answers), "--tp", str(tp),
                     "--timeout", str(RUN_S)],
                    cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                    env={**os.environ, **(TP_ENV if tp > 1 else {})}))
        summaries = []
        for proc, role in zip(procs, ("prefill", "decode"), strict=True):
            proc.wait(timeout=RUN_S + 60)
            lines = (tmp_path / f"{role}.log").read_text().splitlines()
            assert proc.returncode == 0, "\n".join(lines[-40:])
            # the summary: the rank's last JSON line
            summaries.append(json.loads(next(line for line in reversed(lines)
                                             if line.startswith("{"))))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    sent, got = summaries
    assert sent["pending"] is False  # every prefill rank reported its blocks free
    assert len(got["tokens"]) == TOKENS and got["tokens"] == got["reference"]
    pages = -(-len(PROMPT) // 16)
    request = pages * 16 * 1152 * 2  # 2 layers of bf16 MLA rows
    prefill_tp, decode_tp = widths
    source = [d // (decode_tp // prefill_tp) if decode_tp >= prefill_tp else d * (prefill_tp // decode_tp)
              for d in range(decode_tp)]  # the prefill rank each decode rank reads
    owners = {proc.pid for proc in procs}
    for side, tp in ((sent["ranks"], prefill_tp), (got["ranks"], decode_tp)):
        assert [(r["vllm_rank"], r["rank"], r["size"]) for r in side] == [(r, r, tp) for r in range(tp)]
        assert [(r["layers"], r["page_size"]) for r in side] == [(2, 16)] * tp
        pids = {r["pid"] for r in side}
        assert len(pids) == tp and (pids.isdisjoint(owners) if tp > 1 else pids <= owners)
    assert [r["bytes"] for r in sent["ranks"]] == [request * source.count(p) for p in range(prefill_tp)]
    assert [r["bytes"] for r in got["ranks"]] == [request] * decode_tp
    for rank in sent["ranks"]:
        assert rank["nonzero_layers"] == 2
    for d, rank in enumerate(got["ranks"]):
        assert rank["rows"] == sent["ranks"][source[d]]["rows"]  # byte-exact, layer by layer
