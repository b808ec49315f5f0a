"""Two whole vLLM ``LLM`` engines, prefill and decode, each in its own OS process with the
connector (``llm_rank``): vLLM's own calls move the prompt's KV, and decode's greedy tokens equal
the ones prefill's engine generates from the prompt itself."""

from __future__ import annotations

import json
import os
import signal
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
WAIT_S = 200.0


def test_a_decode_llm_generates_from_the_prefill_llms_kv(tmp_path, monkeypatch):
    clear_engine_environment(monkeypatch)
    require_engine("mooncake")
    model = write_model(tmp_path / "model")
    answers = tmp_path / "answers.json"
    procs = []
    try:
        for role, extra in (("prefill", {"engine": "mooncake", "port": free_port()}),
                            ("decode", {"engine": "mooncake"})):
            with open(tmp_path / f"{role}.err", "w") as err:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "tests.vllm.llm_rank", role, "--model", str(model),
                     "--extra", json.dumps(extra), "--answers", str(answers)],
                    cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True))
        summaries = []
        for proc, role in zip(procs, ("prefill", "decode"), strict=True):
            out, _ = proc.communicate(timeout=WAIT_S)
            assert proc.returncode == 0, (tmp_path / f"{role}.err").read_text()[-3000:]
            summaries.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    sent, got = summaries
    assert sent["pending"] is False
    pages = -(-len(PROMPT) // 16)
    assert sent["sent"] == got["received"] == pages * 16 * 1152 * 2  # 2 layers of bf16 MLA rows
    assert (got["layers"], got["page_size"]) == (2, 16)
    assert len(got["tokens"]) == TOKENS and got["tokens"] == got["reference"]
