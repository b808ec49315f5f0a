"""``dsa-bridge decode --rooms``: a decode node that runs a prefill's answers (its rooms and
prompt lengths, as a vLLM prefill with dsa-bridge's connector hands them out) instead of drawing
its own. Bad files and answers that do not match the options are one line naming ``--rooms``
before anything is allocated; a good one runs against a real ``dsa-bridge prefill`` process and
verifies every byte of exactly those rooms."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dsa_bridge.transfer import backends
from dsa_bridge.transfer.auth import SECRET_ENV
from dsa_bridge.transfer.launcher import cli, drivers
from dsa_bridge.transfer.launcher.cli import main

from ..conftest import require_engine
from ..ports import free_port

PREFILL = "127.0.0.1:7000"


class Allocated(Exception):
    """Raised where the decode node's engine would start."""


@pytest.fixture
def no_engine(monkeypatch):
    def refuse(*_args, **_kwargs):
        raise Allocated

    monkeypatch.setattr(backends, "create_backend", refuse)
    monkeypatch.delenv(SECRET_ENV, raising=False)


def rooms_file(tmp_path, content) -> str:
    path = tmp_path / "rooms.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def decode(capsys, path: str, *extra: str):
    code = main(["decode", "--prefill", PREFILL, "--pool-tokens", "4096", "--rooms", path, *extra])
    out = capsys.readouterr()
    return code, out.out, out.err


GOOD = {"remote_room": 7, "remote_num_tokens": 130}
BAD_ROOMS = [
    ("{not json", "is not JSON"),
    ({"remote_room": 7}, "must hold a JSON list of 1..1000000 prefill answers"),
    ([], "must hold a JSON list of 1..1000000 prefill answers"),
    ([7], "entry 0 must be an object"),
    ([{"remote_num_tokens": 1}], "entry 0: remote_room must be an integer 0..9223372036854775807"),
    ([{**GOOD, "remote_room": -1}], "entry 0: remote_room must be an integer"),
    ([{**GOOD, "remote_room": 2**63}], "entry 0: remote_room must be an integer"),
    ([{**GOOD, "remote_room": True}], "entry 0: remote_room must be an integer"),
    ([GOOD, {**GOOD, "remote_num_tokens": 0}], "entry 1: remote_num_tokens must be an integer >= 1"),
    ([GOOD, {**GOOD, "remote_num_tokens": "64"}], "entry 1: remote_num_tokens must be an integer"),
    ([GOOD, GOOD], "entry 1: room 7 appears twice"),
]


@pytest.mark.parametrize("content, message", BAD_ROOMS, ids=[m for _, m in BAD_ROOMS])
def test_a_bad_rooms_file_is_one_line_naming_it(capsys, no_engine, tmp_path, content, message):
    code, out, err = decode(capsys, rooms_file(tmp_path, content))
    assert code == 2 and out == ""
    assert "argument --rooms" in err and message in err and err.count("\n") == 1, err


def test_an_unreadable_rooms_file_is_named(capsys, no_engine, tmp_path):
    code, _, err = decode(capsys, str(tmp_path / "missing.json"))
    assert code == 2 and "argument --rooms: cannot read" in err and err.count("\n") == 1, err


MISMATCHED = [
    ({"remote_num_tokens": 4097}, (), "entry 0 (room 7): 4097 prompt tokens do not fit --pool-tokens 4096"),
    ({"remote_engine": "nixl"}, (), "the prefill used engine 'nixl', this node --backend mooncake"),
    ({"tp_size": 2}, (), "the prefill has tp_size 2; this node reads a request from one prefill rank"),
    ({"remote_host": "127.0.0.1", "remote_port": 7001}, (),
     "the answer names prefill 127.0.0.1:7001, not one of --prefill 127.0.0.1:7000"),
    ({"remote_host": "127.0.0.1", "remote_port": "x"}, (), "remote_host/remote_port: must be HOST:PORT"),
    ({}, ("--requests", "4"), "--rooms: the requests are the file's; leave out --requests"),
]


@pytest.mark.parametrize("change, extra, message", MISMATCHED, ids=[m for _, _, m in MISMATCHED])
def test_answers_that_do_not_match_the_options_are_refused_before_the_pool(
        capsys, no_engine, monkeypatch, tmp_path, change, extra, message):
    monkeypatch.setattr(cli, "local_address_for", lambda host: pytest.fail("got past the checks"))
    code, out, err = decode(capsys, rooms_file(tmp_path, [{**GOOD, **change}]), *extra)
    assert code == 2 and out == ""
    assert err.startswith("dsa-bridge decode: error: --rooms") and message in err, err
    assert err.count("\n") == 1, err


def test_matching_answers_get_to_the_engine(capsys, no_engine, tmp_path):
    """A vLLM prefill's whole answer (engine, endpoint, TP width 1) passes every check."""
    answer = {**GOOD, "do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 7000,
              "tp_size": 1, "remote_engine": "mooncake"}
    with pytest.raises(Allocated):
        decode(capsys, rooms_file(tmp_path, [answer]))


def test_drive_decode_refuses_rooms_that_do_not_pair_with_the_requests():
    with pytest.raises(ValueError, match="2 rooms for 1 requests"):
        drivers.drive_decode(None, [64], rooms=[1, 2])


@pytest.mark.slow  # two node processes
def test_a_decode_runs_exactly_the_rooms_it_is_given(tmp_path):
    """Against a real ``dsa-bridge prefill`` (which answers any room): the given rooms, the
    largest 63-bit one included, and their lengths are the requests; every byte verified."""
    require_engine("nixl")
    port = free_port()
    rooms = [{"remote_room": 2**63 - 1, "remote_num_tokens": 1},
             {"remote_room": 0, "remote_num_tokens": 300}, {"remote_room": 41, "remote_num_tokens": 64}]
    common = ["--backend", "nixl", "--pool-tokens", "4096", "--checksums"]
    with open(tmp_path / "prefill.err", "w") as err:
        prefill = subprocess.Popen(
            [sys.executable, "-m", "dsa_bridge.transfer.launcher.cli", "prefill", "--listen",
             f"127.0.0.1:{port}", "--verbose", *common], stdout=subprocess.DEVNULL, stderr=err)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "dsa_bridge.transfer.launcher.cli", "decode", "--prefill",
             f"127.0.0.1:{port}", "--rooms", rooms_file(tmp_path, rooms), "--json", *common],
            capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-3000:]
        got = json.loads(done.stdout)
        assert (got["requests"], got["requests_ok"], got["bytes_mismatched"]) == (3, 3, 0)
        pages = 1 + 5 + 1
        assert got["bytes_verified"] == pages * 61 * (64 * 656 + 64 * 132)  # DeepSeek-V3.2
        assert got["checksums_verified"] == pages * 61 * 2 and got["sentinel_intact"]
    finally:
        os.kill(prefill.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while prefill.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if prefill.poll() is None:
            os.kill(prefill.pid, signal.SIGKILL)
            prefill.wait(10)
    assert prefill.returncode == 0
    assert "filled 3 requests" in (tmp_path / "prefill.err").read_text()
