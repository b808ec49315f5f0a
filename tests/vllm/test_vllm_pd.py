"""The connector inside vLLM's real scheduler and worker lifecycle, prefill and decode as separate
OS processes (``pd_rank``), over real engines: every layer's MLA and indexer pages byte-exact on
a fragmented decode block table, each side's blocks back in vLLM's pool once the transfer is
proven; an abort mid-write, a decode timeout and a killed prefill hold decode's blocks until no
write can land and end the request with vLLM's error; a prefill whose decode never comes frees its
blocks at its deadline; a corrupted page caught by the checksums."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import clear_engine_environment, require_engine
from tests.ports import free_port

from .conftest import VLLM_MISSING

if VLLM_MISSING:
    pytest.skip(VLLM_MISSING, allow_module_level=True)

from .harness import write_model  # noqa: E402

pytestmark = pytest.mark.slow  # each test starts vLLM processes (tests/conftest.py)
ROOT = Path(__file__).resolve().parents[2]
REQUESTS = [["short", 1], ["page", 64], ["three", 130], ["long", 300]]
START_S = 120.0  # a rank's start (vLLM's import and config) on two shared cores, and its run


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    clear_engine_environment(monkeypatch)


class Pair:
    """A prefill and a decode ``pd_rank`` process, stopped by the test by their PIDs."""

    def __init__(self, tmp: Path, model: Path):
        self.tmp, self.model = tmp, model
        self.answers, self.stop = tmp / "answers.json", tmp / "stop"
        self.procs: list[subprocess.Popen] = []
        self.logs: dict[int, Path] = {}  # pid -> its stderr

    def start(self, role: str, extra: dict, *args: str, env: dict | None = None) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "tests.vllm.pd_rank", role, "--model", str(self.model),
               "--extra", json.dumps(extra), "--answers", str(self.answers), "--stop", str(self.stop),
               "--timeout", str(START_S), *args]
        path = self.tmp / f"{role}-{len(self.procs)}.err"
        with open(path, "w") as err:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True,
                                    env={**os.environ, **(env or {})})
        self.procs.append(proc)
        self.logs[proc.pid] = path
        return proc

    def log(self, proc: subprocess.Popen) -> str:
        return self.logs[proc.pid].read_text()

    def prefill(self, extra: dict, requests=REQUESTS, env: dict | None = None) -> subprocess.Popen:
        return self.start("prefill", extra, "--requests", json.dumps(requests), env=env)

    def summary(self, proc: subprocess.Popen, timeout_s: float = START_S + 30) -> dict:
        out, _ = proc.communicate(timeout=timeout_s)
        assert proc.returncode == 0, self.log(proc)[-3000:]
        return json.loads(out.strip().splitlines()[-1])

    def finish_prefill(self, proc: subprocess.Popen) -> dict:
        self.stop.touch()
        return self.summary(proc)

    def wait_for_log(self, proc: subprocess.Popen, text: str, timeout_s: float = START_S) -> None:
        """Wait until ``proc``'s log has ``text`` (bounded)."""
        deadline = time.monotonic() + timeout_s
        while text not in self.log(proc):
            assert time.monotonic() < deadline and proc.poll() is None, self.log(proc)[-3000:]
            time.sleep(0.05)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


@pytest.fixture
def pair(tmp_path, model):
    made = Pair(tmp_path, model)
    yield made
    made.close()


def assert_released(prefill: dict, decode: dict) -> None:
    assert prefill["free_held"] < prefill["free_before"]  # held while decode had not written
    assert (prefill["free_after"], prefill["pending"]) == (prefill["free_before"], False)
    assert (decode["free_after"], decode["pending"]) == (decode["free_before"], False)


@pytest.mark.parametrize("engine,checksums", [("mooncake", False), ("nixl", True)])
def test_every_layer_byte_exact_on_a_fragmented_block_table(pair, engine, checksums):
    require_engine(engine)
    extra = {"engine": engine, "checksums": checksums}
    prefill = pair.prefill({**extra, "port": free_port()})
    decode = pair.start("decode", extra, "--fragment")
    got, sent = pair.summary(decode), pair.finish_prefill(prefill)
    assert sent["answered"] == len(REQUESTS)
    assert got["finished"] == {req_id: "length" for req_id, _ in REQUESTS}
    assert got["differing_pages"] == {req_id: 0 for req_id, _ in REQUESTS}  # 4 layers x (MLA, indexer)
    assert (got["layers"], got["indexers"]) == (4, 4)
    long = got["blocks"]["long"]
    assert len(long) == 5 and sorted(long) != list(range(min(long), min(long) + 5))  # fragmented
    assert_released(sent, got)


def test_each_rank_of_a_wider_decode_gets_the_whole_request(pair):
    """Decode TP 2 from a prefill TP 1: the MLA cache is replicated, so prefill's one rank
    writes the request to both decode ranks (two copies), each byte-exact."""
    require_engine("mooncake")
    extra = {"engine": "mooncake"}
    prefill = pair.prefill({**extra, "port": free_port()}, REQUESTS[1:3])
    ranks = [pair.start("decode", extra, "--tp", f"{rank}/2") for rank in (0, 1)]
    got = [pair.summary(rank) for rank in ranks]
    sent = pair.finish_prefill(prefill)
    for rank in got:
        assert rank["finished"] == {req_id: "length" for req_id, _ in REQUESTS[1:3]}
        assert rank["differing_pages"] == {req_id: 0 for req_id, _ in REQUESTS[1:3]}
        assert_released(sent, rank)


def test_a_wider_prefill_writes_from_one_rank_and_frees_every_rank(pair):
    """Prefill TP 2 to a decode TP 1: decode reads the request from prefill rank 0 and tells
    rank 1 it has nothing to send; every rank's blocks go back to vLLM."""
    require_engine("mooncake")
    extra, port, requests = {"engine": "mooncake"}, free_port(), json.dumps(REQUESTS[1:3])
    ranks = [pair.start("prefill", {**extra, "port": port}, "--requests", requests, "--tp",
                        f"{rank}/2", "--room-seed", "5",
                        *(["--answers", str(pair.tmp / "rank1.json")] if rank else []))
             for rank in (0, 1)]
    got = pair.summary(pair.start("decode", extra))
    sent = [pair.finish_prefill(rank) for rank in ranks]
    assert got["finished"] == {req_id: "length" for req_id, _ in REQUESTS[1:3]}
    assert got["differing_pages"] == {req_id: 0 for req_id, _ in REQUESTS[1:3]}
    assert json.loads((pair.tmp / "rank1.json").read_text()) == json.loads(pair.answers.read_text())
    for rank in sent:
        assert_released(rank, got)


def test_abort_mid_write_holds_the_blocks_until_the_write_ended(pair):
    require_engine("mooncake")
    extra = {"engine": "mooncake"}
    prefill = pair.prefill({**extra, "port": free_port()}, [["long", 300]],
                           env={"DSA_BRIDGE_FAULT_WRITE_DELAY_MS": "2500"})
    decode = pair.start("decode", extra, "--abort", "long", "--abort-after", "0.7")
    got, sent = pair.summary(decode), pair.finish_prefill(prefill)
    assert got["finished"] == {"long": "abort"}
    assert got["free_after_abort"] == got["free_before"] - 5  # its 5 blocks held: the write runs
    assert_released(sent, got)


def test_decode_timeout_fails_the_request_once_no_write_can_land(pair):
    require_engine("mooncake")
    prefill = pair.prefill({"engine": "mooncake", "port": free_port()}, [["long", 300]],
                           env={"DSA_BRIDGE_FAULT_WRITE_DELAY_MS": "3000"})
    decode = pair.start("decode", {"engine": "mooncake", "request_timeout_s": 1.5})
    got, sent = pair.summary(decode), pair.finish_prefill(prefill)
    assert got["finished"] == {"long": "error"}  # vLLM's kv_load_failure_policy "fail"
    assert_released(sent, got)


def test_a_killed_prefill_fails_the_request_once_proven_gone(pair):
    require_engine("mooncake")
    prefill = pair.prefill({"engine": "mooncake", "port": free_port(), "peer_timeout_s": 2.0},
                           [["long", 300]], env={"DSA_BRIDGE_FAULT_WRITE_DELAY_MS": "20000"})
    decode = pair.start("decode", {"engine": "mooncake", "peer_timeout_s": 2.0})
    pair.wait_for_log(prefill, "half of a write landed")
    os.kill(prefill.pid, signal.SIGKILL)
    prefill.wait(timeout=30)
    got = pair.summary(decode)
    assert got["finished"] == {"long": "error"}
    assert (got["free_after"], got["pending"]) == (got["free_before"], False)


def test_a_flipped_byte_fails_the_request_by_checksum(pair):
    require_engine("mooncake")
    extra = {"engine": "mooncake", "checksums": True}
    prefill = pair.prefill({**extra, "port": free_port()}, [["three", 130]],
                           env={"DSA_BRIDGE_FAULT_FLIP_EVERY": "1"})
    decode = pair.start("decode", extra)
    got, sent = pair.summary(decode), pair.finish_prefill(prefill)
    assert got["finished"] == {"three": "error"}
    assert_released(sent, got)


def test_a_prefill_whose_decode_never_comes_frees_its_blocks_at_its_deadline(pair):
    require_engine("mooncake")
    prefill = pair.prefill({"engine": "mooncake", "port": free_port(), "request_timeout_s": 2.0},
                           [["three", 130]])
    deadline = time.monotonic() + START_S
    while not pair.answers.exists():
        assert time.monotonic() < deadline and prefill.poll() is None
        time.sleep(0.1)
    time.sleep(4.0)  # past its 2 s deadline
    sent = pair.finish_prefill(prefill)
    assert sent["free_held"] == sent["free_before"] - 3
    assert (sent["free_after"], sent["pending"]) == (sent["free_before"], False)


def test_a_dsa_bridge_prefill_launcher_feeds_a_vllm_decode_byte_exact(pair, model):
    """Interoperation by the bytes: the pages are the same bytes, so a ``dsa-bridge prefill``
    node (its deterministic pattern per room, layer, cache and page) serves the connector."""
    require_engine("mooncake")
    port = free_port()
    with open(pair.tmp / "launcher.err", "w") as err:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "dsa_bridge.transfer.launcher.cli", "prefill", "--listen",
             f"127.0.0.1:{port}", "--backend", "mooncake", "--model", str(model / "config.json"),
             "--pool-tokens", "4096"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)
    pair.procs.append(launcher)
    answers = {req_id: {"length": length, "params": {
        "do_remote_prefill": True, "remote_room": 1000 + i, "remote_host": "127.0.0.1",
        "remote_port": port, "tp_size": 1, "remote_num_tokens": length, "remote_engine": "mooncake"}}
        for i, (req_id, length) in enumerate(REQUESTS)}
    pair.answers.write_text(json.dumps(answers))
    got = pair.summary(pair.start("decode", {"engine": "mooncake"}, "--launcher", "--fragment"))
    assert got["finished"] == {req_id: "length" for req_id, _ in REQUESTS}
    assert got["differing_pages"] == {req_id: 0 for req_id, _ in REQUESTS}
    assert (got["free_after"], got["pending"]) == (got["free_before"], False)
    os.kill(launcher.pid, signal.SIGTERM)
    assert launcher.wait(timeout=30) == 0, (pair.tmp / "launcher.err").read_text()[-3000:]


@pytest.mark.parametrize("engine,checksums", [("mooncake", False), ("nixl", True)])
def test_a_vllm_prefill_feeds_a_dsa_bridge_decode_launcher_byte_exact(pair, model, engine, checksums):
    """Interoperation the other way: the vLLM prefill's answers (its rooms and prompt lengths)
    are a ``dsa-bridge decode --rooms`` node's requests; it checks every byte of every layer's
    MLA and indexer page against the launcher's pattern (NIXL: with checksums) and the sentinel
    of every page no request owns; the prefill's blocks go back to vLLM once written."""
    require_engine(engine)
    port = free_port()
    prefill = pair.start("prefill", {"engine": engine, "checksums": checksums, "port": port},
                         "--requests", json.dumps(REQUESTS), "--launcher")
    deadline = time.monotonic() + START_S
    while not pair.answers.exists():
        assert time.monotonic() < deadline and prefill.poll() is None, pair.log(prefill)[-3000:]
        time.sleep(0.1)
    rooms = pair.tmp / "rooms.json"
    rooms.write_text(json.dumps([a["params"] for a in json.loads(pair.answers.read_text()).values()]))
    with open(pair.tmp / "launcher.err", "w") as err:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "dsa_bridge.transfer.launcher.cli", "decode", "--prefill",
             f"127.0.0.1:{port}", "--backend", engine, "--checksums" if checksums else "--no-checksums",
             "--model",
             str(model / "config.json"), "--pool-tokens", "4096", "--rooms", str(rooms), "--json"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True)
    pair.procs.append(launcher)
    out, _ = launcher.communicate(timeout=START_S)
    assert launcher.returncode == 0, (pair.tmp / "launcher.err").read_text()[-3000:]
    got = json.loads(out.strip().splitlines()[-1])
    pages = sum(-(-length // 64) for _, length in REQUESTS)  # 1 + 1 + 3 + 5
    assert (got["requests_ok"], got["requests_failed"], got["bytes_mismatched"]) == (4, 0, 0)
    assert got["bytes_verified"] == pages * 4 * (64 * 656 + 64 * 132)  # every layer, both caches
    assert got["checksums_verified"] == checksums * pages * 4 * 2 and got["sentinel_intact"]
    sent = pair.finish_prefill(prefill)
    assert sent["answered"] == len(REQUESTS)
    assert sent["free_held"] < sent["free_before"]
    assert (sent["free_after"], sent["pending"]) == (sent["free_before"], False)
