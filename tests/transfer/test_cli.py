"""The launcher: the pool command, errors for bad input, and stopping on SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from dsa_bridge.transfer.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_pool_deepseek_numbers(capsys):
    code, out, _ = run(capsys, "pool", "--model", "deepseek-v3.2", "--json")
    info = json.loads(out)
    assert code == 0
    assert (info["bytes_per_token"], info["capacity_tokens"]) == (48068, 1340224)
    assert (info["kv_page_bytes"], info["index_page_bytes"], info["layers"]) == (41984, 8448, 61)


def test_pool_glm_uses_the_576_byte_layout_and_reports_index_sharing(capsys):
    code, out, _ = run(capsys, "pool", "--model", "glm-5.2", "--json")
    info = json.loads(out)
    assert (info["kv_dtype"], info["bytes_per_token"]) == ("fp8_raw", 55224)
    assert info["index_sharing"]["full_only_bytes_per_token"] == 47700
    assert info["index_sharing"]["allocated_bytes_per_token"] == 55224


def test_pool_bf16(capsys):
    _, out, _ = run(capsys, "pool", "--kv-dtype", "bf16", "--json")
    assert json.loads(out)["bytes_per_token"] == 78324


@pytest.mark.parametrize("argv, message", [
    (["pool", "--model", "no-such-model"], "no-such-model"),
    (["pool", "--page-size", "48"], "page_size"),
    (["prefill", "--listen", "nonsense"], "--listen must be HOST:PORT"),
    (["decode", "--prefill", "host:port"], "--prefill must be HOST:PORT"),
])
def test_bad_input_is_a_clear_error(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert message in err and "Traceback" not in err


def test_prefill_exits_cleanly_on_sigterm():
    """A long-lived prefill node stops on SIGTERM: exit code 0 and its counters on stderr."""
    process = subprocess.Popen(
        [sys.executable, "-m", "dsa_bridge.transfer.cli", "prefill", "--listen", "127.0.0.1:0",
         "--pool-tokens", "1024"], stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 60
        line = ""
        while "listening on" not in line:
            assert time.monotonic() < deadline and process.poll() is None, "prefill did not start"
            line = process.stderr.readline()
        process.send_signal(signal.SIGTERM)
        assert process.wait(20) == 0
        assert "[prefill] counters:" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
