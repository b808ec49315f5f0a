"""The launcher: the pool command, every bad option refused before anything is allocated (one
line naming the option, exit code 2), host names resolved, stopping on SIGTERM, a quiet demo whose
summary separates the transfer from the stand-in model's filling."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from dsa_bridge.transfer import backends
from dsa_bridge.transfer.auth import SECRET_ENV
from dsa_bridge.transfer.backends import BACKENDS
from dsa_bridge.transfer.launcher import cli, demo, options
from dsa_bridge.transfer.launcher.cli import main
from dsa_bridge.transfer.launcher.summary import join_prefill, print_summary
from tests.conftest import require_engine

GLOG_ERROR = re.compile(r"^E\d{4}", re.MULTILINE)
ENGINE_LOG_ENV = ("MC_LOG_LEVEL", "NIXL_LOG_LEVEL", "UCX_LOG_LEVEL")


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
    *[([*DECODE, "--quarantine-timeout", value], message) for value, message in (
        ("nan", "argument --quarantine-timeout: must be a finite number of seconds > 0"),
        ("0", "argument --quarantine-timeout: must be a finite number of seconds > 0"),
        ("1.5", "argument --quarantine-timeout: must be at least 2 seconds, got '1.5'"))],
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


@pytest.mark.slow
@pytest.mark.parametrize(("listen", "verbose"), [("127.0.0.1:0", False), ("localhost:0", True)])
def test_prefill_exits_cleanly_on_sigterm(listen, verbose):
    """A long-lived prefill node stops on SIGTERM: exit code 0, its stand-in's line on stderr, and
    its counters there only with --verbose. A host name is resolved first (Mooncake takes numeric
    IPv4 only)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "dsa_bridge.transfer.launcher.cli", "prefill", "--listen", listen,
         "--pool-tokens", "1024", *(["--verbose"] if verbose else [])],
        stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
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
        assert "[prefill] stand-in model: filled 0 requests" in rest
        assert ("[prefill] counters:" in rest) is verbose, rest
        assert "Traceback" not in rest
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


def decode_summary(**figures):
    summary = {"requests": 2, "requests_ok": 2, "requests_failed": 0, "bytes_verified": 4_000_000,
               "layers": 61, "indexer_layers": 61, "backend": "mooncake", "transport": "tcp",
               "seconds": 3.0,
               "gbps": None, "transfer_seconds": None, "fill_gbps": None, "fill_seconds": None,
               "engine_gbps": 2.0, "request_gbps": 1.0, "request_seconds": 4.0,
               "verify_gbps": 0.5, "verify_seconds": 8.0, "failures": [], "ok": True}
    return {**summary, **figures}


def test_join_prefill_takes_the_transfer_from_pages_ready_to_success():
    times = {"7": [10.0, 12.0], "8": [10.5, 15.0]}
    prefill = {"fill_bytes": 4_000_000, "fill_seconds": 2.0, "ready_at": {"7": 11.0, "8": 14.0},
               "counters": {"chunks_sent": 2}}
    joined = join_prefill(decode_summary(request_times=times), prefill)
    assert "request_times" not in joined and joined["prefill_counters"] == {"chunks_sent": 2}
    assert joined["transfer_seconds"] == 2.0  # [11, 12] and [14, 15]
    assert joined["gbps"] == 0.002 and joined["fill_gbps"] == 0.002 and joined["fill_seconds"] == 2.0
    unknown = join_prefill(decode_summary(request_times=times), {**prefill, "ready_at": {"7": 11.0}})
    assert unknown["gbps"] is None and unknown["transfer_seconds"] is None


def test_summary_text_names_each_rate(capsys):
    print_summary(decode_summary(gbps=0.8, transfer_seconds=2.5, fill_gbps=0.3, fill_seconds=7.0),
                  as_json=False)
    text = capsys.readouterr().out
    assert "transfer  0.80 GB/s from prefill's pages ready to decode's Success" in text
    assert "engine    2.00 GB/s" in text and "stand-in  0.30 GB/s" in text
    assert "requests  1.00 GB/s from decode's request to Success" in text
    assert "checking  0.50 GB/s decode checking every byte" in text
    assert "checksums" not in text
    print_summary(decode_summary(checksums=True, checksums_verified=122), as_json=False)
    assert "checksums 122 page checksums verified end to end" in capsys.readouterr().out
    print_summary(decode_summary(), as_json=False)  # decode alone: no prefill times
    alone = capsys.readouterr().out
    assert "transfer " not in alone and "stand-in" not in alone and "requests  1.00" in alone


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_demo_is_quiet_and_separates_transfer_from_filling(backend):
    """A healthy demo with the engines' default log levels: no glog error line, no traceback;
    the summary's transfer, engine, stand-in and request figures are all there and consistent."""
    require_engine(backend)
    env = {k: v for k, v in os.environ.items() if k not in ENGINE_LOG_ENV}
    # --peer-timeout: on a loaded machine the decode process's exit once took over the default
    # 5 s, prefill dropped it as silent and Mooncake logged its engine gone (E lines): a peer
    # leaving, not what this test is about
    result = subprocess.run(
        [sys.executable, "-m", "dsa_bridge.transfer.launcher.cli", "demo", "--backend", backend,
         "--requests", "4", "--pool-tokens", "4096", "--max-tokens", "1024", "--json",
         "--peer-timeout", "60"],
        capture_output=True, text=True, timeout=300, env=env, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not GLOG_ERROR.search(result.stderr), result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    summary = json.loads(result.stdout)
    assert summary["requests_ok"] == 4 and "request_times" not in summary
    assert "counters:" not in result.stderr  # the counters are in the JSON, not in the progress
    assert summary["prefill_counters"] and summary["counters"]
    for key in ("gbps", "transfer_seconds", "engine_gbps", "fill_gbps", "fill_seconds",
                "request_gbps", "request_seconds", "verify_gbps", "verify_seconds"):
        assert summary[key] > 0, key
    assert summary["transfer_seconds"] <= summary["request_seconds"]  # ready comes after init
    assert summary["gbps"] >= summary["request_gbps"]


def test_quarantine_timeout_reaches_the_decode_options():
    assert cli.build_parser().parse_args([*DECODE]).quarantine_timeout == 600.0
    assert cli.build_parser().parse_args([*DECODE, "--quarantine-timeout", "30"]).quarantine_timeout == 30.0


def test_fixed_ports_inside_mooncakes_listener_range_are_warned_about(monkeypatch):
    """A Mooncake engine anywhere on the host listens on random ports of 15000-17000 (or the
    range its environment sets) and can take a port an operator fixed, while its server
    restarts: each such port is named, with the option that fixed it."""
    monkeypatch.delenv("MC_MIN_RPC_PORT", raising=False)
    monkeypatch.delenv("MC_MAX_RPC_PORT", raising=False)
    parse = cli.build_parser().parse_args
    warned = options.fixed_port_warnings(parse(["prefill", "--listen", "127.0.0.1:16500",
                                                "--metrics-port", "15000"]))
    assert [w.split(":")[0] for w in warned] == ["--listen 127.0.0.1", "--metrics-port 15000"]
    assert all("15000-17000" in w and "MC_MIN_RPC_PORT" in w for w in warned)
    assert options.fixed_port_warnings(parse(["prefill", "--listen", "127.0.0.1:0"])) == []
    assert options.fixed_port_warnings(parse([*DECODE, "--metrics-port", "17001"])) == []
    assert len(options.fixed_port_warnings(parse([*DECODE, "--metrics-port", "17000"]))) == 1
    monkeypatch.setenv("MC_MIN_RPC_PORT", "20000")
    monkeypatch.setenv("MC_MAX_RPC_PORT", "20099")
    (warning,) = options.fixed_port_warnings(parse([*DECODE, "--metrics-port", "20099"]))
    assert "20000-20099" in warning
    assert len(options.fixed_port_warnings(parse([*DECODE, "--metrics-port", "16000"]))) == 1


def test_a_fixed_port_warning_is_printed_before_the_node_starts(capsys, nothing_allocated,
                                                                monkeypatch):
    monkeypatch.delenv("MC_MIN_RPC_PORT", raising=False)
    monkeypatch.setattr(cli, "stop_on_signals", threading.Event)  # keep pytest's own handlers
    with pytest.raises(Allocated):
        main(["prefill", "--listen", "127.0.0.1:16500"])
    err = capsys.readouterr().err
    assert err.startswith("dsa-bridge prefill: warning: --listen 127.0.0.1:16500: ")
