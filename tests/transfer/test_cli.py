"""The launcher: the pool command, every bad option refused before anything is allocated (one
line naming the option, exit code 2), host names resolved, stopping on SIGTERM."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from dsa_bridge.transfer import backends, cli, demo, options
from dsa_bridge.transfer.auth import SECRET_ENV
from dsa_bridge.transfer.cli import main


class Allocated(Exception):
    """Raised where a pool would be allocated, an engine started or a child launched."""


@pytest.fixture
def nothing_allocated(monkeypatch):
    """Any pool, engine or child process the command would start raises ``Allocated``."""

    def refuse(*_args, **_kwargs):
        raise Allocated

    monkeypatch.setattr(cli, "make_pool", refuse)
    monkeypatch.setattr(backends, "create_backend", refuse)
    monkeypatch.setattr(demo, "launch", refuse)
    monkeypatch.delenv(SECRET_ENV, raising=False)


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


DECODE = ("decode", "--prefill", "127.0.0.1:7000")
TIMEOUTS = [(role, option) for role in (("prefill",), DECODE, ("demo",))
            for option in ("--peer-timeout", "--request-timeout")] + [(("demo",), "--timeout")]
BAD_OPTIONS = [
    # counts and sizes
    (["demo", "--concurrency", "0"], "argument --concurrency: must be a positive integer"),
    ([*DECODE, "--concurrency", "-2"], "argument --concurrency: must be a positive integer"),
    (["prefill", "--chunk-pages", "0"], "argument --chunk-pages: must be a positive integer"),
    (["demo", "--requests", "0"], "argument --requests: must be a positive integer"),
    (["demo", "--requests", "2000000"], "argument --requests: must be at most 1000000"),
    (["demo", "--requests", "many"], "argument --requests: must be an integer"),
    ([*DECODE, "--max-tokens", "0"], "argument --max-tokens: must be a positive integer"),
    (["demo", "--pool-tokens", "0"], "argument --pool-tokens: must be a positive integer"),
    (["pool", "--pool-tokens", "100"], "--pool-tokens must be a multiple of --page-size (64)"),
    (["demo", "--page-size", "32", "--pool-tokens", "48"], "--pool-tokens must be a multiple"),
    (["demo", "--pool-tokens", str(2**40)], "--pool-tokens 1099511627776: two pools"),
    (["prefill", "--pool-tokens", str(2**40)], "--pool-tokens 1099511627776: the pool"),
    (["pool", "--page-size", "48"], "argument --page-size: must be a power of two"),
    (["pool", "--page-size", "0"], "argument --page-size: must be a positive integer"),
    (["pool", "--budget-gib", "nan"], "argument --budget-gib: must be a finite number > 0"),
    (["pool", "--budget-gib", "inf"], "argument --budget-gib: must be a finite number > 0"),
    (["pool", "--budget-gib", "0"], "argument --budget-gib: must be a finite number > 0"),
    (["demo", "--seed", "-1"], "argument --seed: must be >= 0"),
    # timeouts
    *[([*role, option, value], f"argument {option}: must be a finite number of seconds > 0")
      for role, option in TIMEOUTS for value in ("nan", "inf", "0", "-1")],
    (["demo", "--timeout", "soon"], "argument --timeout: must be a finite number of seconds"),
    # endpoints and hosts
    (["prefill", "--listen", "nonsense"], "argument --listen: must be HOST:PORT"),
    (["prefill", "--listen", "no-such-host.invalid:0"], "argument --listen: cannot resolve host"),
    (["decode", "--prefill", "host:port"], "argument --prefill: must be HOST:PORT"),
    (["decode", "--prefill", "127.0.0.1:0"], "argument --prefill: port must be in 1..65535"),
    (["decode", "--prefill", "no-such-host.invalid:7000"], "argument --prefill: cannot resolve"),
    ([*DECODE, "--engine-host", "no-such-host.invalid"], "argument --engine-host: cannot resolve"),
    (["decode", "--prefill", "[::1]:7000"], "--prefill: mooncake takes IPv4 addresses only"),
    ([*DECODE, "--engine-host", "::1"], "--engine-host: mooncake takes IPv4 addresses only"),
    (["prefill", "--listen", "[::1]:0"], "--listen: mooncake takes IPv4 addresses only"),
    # files, levels, choices
    (["prefill", "--secret-file", "/no/such/secret"], "argument --secret-file: cannot read"),
    ([*DECODE, "--summary-file", "/no/such/dir/s.json"], "argument --summary-file: directory"),
    (["prefill", "--ready-file", "/no/such/dir/r.json"], "argument --ready-file: directory"),
    (["--log-level", "loud", "pool"], "argument --log-level: must be one of DEBUG"),
    (["bench", "--backends", "foo"], "argument --backends: choose from mooncake, nixl"),
    (["bench", "--backends", ","], "argument --backends: choose from mooncake, nixl"),
    (["bench", "--plots", "/proc/version/plots"], "argument --plots: '/proc/version' is not a dir"),
    (["pool", "--model", "no-such-model"], "--model no-such-model: model config"),
    (["decode"], "the following arguments are required: --prefill"),
]


@pytest.mark.parametrize("argv, message", BAD_OPTIONS, ids=lambda v: " ".join(v)
                         if isinstance(v, list) else None)
def test_bad_option_is_one_line_naming_it_before_anything_is_allocated(
        capsys, nothing_allocated, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert message in err and err.count("\n") == 1, err  # one line, and no traceback
    assert out == ""


@pytest.mark.parametrize("field, value, message", [
    ("num_hidden_layers", 0, "config['num_hidden_layers'] must be >= 1"),
    ("num_hidden_layers", 10**9, "num_hidden_layers is 1000000000; at most 4096"),
    ("num_hidden_layers", "61", "config['num_hidden_layers'] must be an int"),
    ("kv_lora_rank", 500, "kv_lora_rank must be a multiple of 128"),
    ("kv_lora_rank", 2**40, "GiB for"),  # a pool of that size cannot be allocated here
    ("index_head_dim", 100, "index_head_dim (100) must be a multiple of index_quant_block"),
    ("qk_rope_head_dim", -64, "config['qk_rope_head_dim'] must be >= 1"),
    ("index_head_dim", None, "model config is missing 'index_head_dim'"),
])
def test_bad_model_config_is_refused_naming_model(capsys, nothing_allocated, tmp_path, field,
                                                  value, message):
    config = {"num_hidden_layers": 4, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
              "index_head_dim": 128, field: value}
    if value is None:
        del config[field]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    for command in (["pool"], ["prefill"], DECODE, ["demo"]):
        code, _, err = run(capsys, *command, "--model", str(path))
        if command == ["pool"] and message == "GiB for":  # pool allocates nothing: it only sizes
            assert code == 0
            continue
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"dsa-bridge {command[0]}: error: --") and message in err, err


def test_unreadable_model_config_is_refused(capsys, nothing_allocated, tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    code, _, err = run(capsys, "demo", "--model", str(path))
    assert code == 2 and f"--model {path}: cannot read model config" in err


def test_open_listener_without_secret_is_refused_before_the_pool(capsys, nothing_allocated):
    """The 3 GB case: refused by the option check, make_pool (patched to raise) never called."""
    code, _, err = run(capsys, "prefill", "--listen", "0.0.0.0:7000")
    assert code == 2 and err.count("\n") == 1
    assert "--listen 0.0.0.0:7000: refusing to listen on non-loopback 0.0.0.0" in err


@pytest.mark.parametrize("extra, env", [(["--insecure"], {}), ([], {SECRET_ENV: "s3cret"})])
def test_open_listener_with_secret_or_insecure_gets_to_the_pool(capsys, nothing_allocated,
                                                                monkeypatch, extra, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(cli, "stop_on_signals", threading.Event)  # keep pytest's own handlers
    with pytest.raises(Allocated):
        main(["prefill", "--listen", "0.0.0.0:7000", *extra])


def test_host_names_are_resolved_to_numeric_addresses():
    assert options.listen_endpoint("localhost:0") == "127.0.0.1:0"
    assert options.peer_endpoint("localhost:7000") == "127.0.0.1:7000"
    assert options.peer_endpoint("[::1]:7000") == "[::1]:7000"
    assert options.engine_host("localhost") == "127.0.0.1"
    assert options.listen_endpoint("10.1.2.3:80") == "10.1.2.3:80"


def test_help_exits_zero(capsys):
    assert main(["demo", "--help"]) == 0
    assert "--concurrency" in capsys.readouterr().out


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "localhost:0"])
def test_prefill_exits_cleanly_on_sigterm(listen):
    """A long-lived prefill node stops on SIGTERM: exit code 0 and its counters on stderr. A host
    name is resolved first (Mooncake takes numeric IPv4 only)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "dsa_bridge.transfer.cli", "prefill", "--listen", listen,
         "--pool-tokens", "1024"], stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 60
        line = ""
        while "listening on" not in line:
            assert time.monotonic() < deadline and process.poll() is None, "prefill did not start"
            line = process.stderr.readline()
        assert "listening on 127.0.0.1:" in line
        process.send_signal(signal.SIGTERM)
        assert process.wait(20) == 0
        rest = process.stderr.read()
        assert "[prefill] counters:" in rest
        assert "Traceback" not in rest
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
