"""The ``vllm`` section of ``dsa-bridge bench`` (``bench/vllm.py``, ``bench/vllm_rank.py``): its
pure parts everywhere (the figures from waves, the skip where vllm is not installed, the
section's place among the bench's choices); where vllm is installed, the section at ``--tiny``
as the bench runs it: four vLLM instance processes, vLLM's own NixlConnector and dsa-bridge's
moving the same requests, every mode byte-exact, dsa-bridge's descriptors those of the raw
engine, the fragmented table one block per run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from dsa_bridge.transfer.bench import vllm as vllm_section
from dsa_bridge.transfer.bench.channel import Driven
from dsa_bridge.transfer.bench.command import SECTIONS
from dsa_bridge.transfer.bench.vllm import (
    PAGE,
    TARGETS,
    VLLM_SIZES,
    Mode,
    Pair,
    idle_cores,
    process_cpu_s,
    summarize,
)
from dsa_bridge.transfer.bench.vllm_rank import MODEL, max_model_len

from .conftest import VLLM_MISSING

ROOT = Path(__file__).resolve().parents[2]


def wave(connector, pair, seconds, route=None, raw=None, nbytes=1000, descriptors=8, differ=None):
    route = route or ("pull" if connector == "vllm" else "direct")
    w = {"connector": connector, "mode": "m", "route": route, "pair": pair, "seconds": seconds,
         "decode_cpu_s": 0.1, "nbytes": nbytes, "differ": differ or {},
         "descriptors": None if connector == "vllm" else descriptors,
         "written_bytes": None if connector == "vllm" else nbytes}
    if raw is not None:
        w.update(raw_seconds=raw, raw_descriptors=descriptors, raw_bytes=nbytes)
    return w


def test_a_mode_is_vllms_seconds_over_dsa_bridges_median_over_pairs():
    waves = [wave("vllm", 0, 0.2), wave("dsa-bridge", 0, 0.1, raw=0.1),  # pair ratio 2.0
             wave("vllm", 1, 0.1), wave("dsa-bridge", 1, 0.2, raw=0.1),  # 0.5
             wave("vllm", 2, 0.3), wave("dsa-bridge", 2, 0.25, raw=0.24)]  # 1.2
    entry = summarize(Mode(2, 128, 3), waves)
    assert entry["ratio"] == pytest.approx(1.2) and entry["target"] == TARGETS["ratio"]
    assert entry["target_met"]
    assert entry["ratio_vs_raw"] == pytest.approx(0.96)  # median of 1.0, 0.5, 0.96
    assert entry["raw_target_met"] and entry["descriptors_exact"]
    assert entry["vllm"]["ms_per_request"] == pytest.approx(100)  # median 0.2 s over 2 requests
    assert entry["dsa-bridge"]["gbps"] == pytest.approx(3000 / 0.55 / 1e9)
    assert entry["vllm"]["byte_exact"] and entry["dsa-bridge"]["byte_exact"]
    assert entry["vllm"]["descriptors"] is None and entry["dsa-bridge"]["descriptors"] == 8
    waves[1]["differ"] = {"w1-0": 3}
    waves[3]["raw_descriptors"] = 9
    worse = summarize(Mode(2, 128, 3), waves)
    assert not worse["dsa-bridge"]["byte_exact"] and not worse["descriptors_exact"]


def test_the_fragmented_mode_is_judged_on_dsa_bridges_default_route_each_forced_beside():
    waves = [wave("vllm", 0, 0.5), wave("dsa-bridge", 0, 0.3, raw=0.3, descriptors=32),
             wave("dsa-bridge", 0, 0.2, "staged", descriptors=1),
             wave("dsa-bridge", 0, 0.4, "auto", descriptors=32),
             wave("vllm", 1, 0.2), wave("dsa-bridge", 1, 0.1, raw=0.1, descriptors=32),
             wave("dsa-bridge", 1, 0.2, "staged", descriptors=1),
             wave("dsa-bridge", 1, 0.1, "auto", descriptors=32),
             wave("vllm", 2, 0.2), wave("dsa-bridge", 2, 0.1, raw=0.1, descriptors=32),
             wave("dsa-bridge", 2, 0.2, "staged", descriptors=1),
             wave("dsa-bridge", 2, 0.3, "auto", descriptors=1)]  # auto tries the dearer route
    entry = summarize(Mode(1, 256, 3, True), waves)
    assert entry["ratio"] == pytest.approx(0.5 / 0.4)  # auto's: median of 1.25, 2.0 and 0.67
    assert entry["target"] == TARGETS["fragmented_ratio"] and entry["target_met"]
    assert entry["staged_ratio"] == pytest.approx(1.0)  # median of 2.5, 1.0 and 1.0
    assert entry["staged_vs_direct"] == pytest.approx(0.5)  # median of 1.5, 0.5 and 0.5
    assert entry["direct_ratio"] == pytest.approx(2.0)  # median of 1.67, 2.0 and 2.0
    assert [entry[f"dsa-bridge{route}"]["descriptors"]
            for route in (" direct", " staged", "")] == [32, 1, 32]  # auto: its most waves' route
    assert Mode(1, 64, 1, True).runs()[1:] == [("dsa-bridge", route)
                                               for route in ("direct", "staged", "auto")]


def test_sizes_fit_their_modes():
    for sizes in VLLM_SIZES.values():
        assert sizes.blocks > max(m.blocks for m in sizes.modes)
        assert {m.fragmented for m in sizes.modes} == {True, False}
    assert {m.in_flight for m in VLLM_SIZES["quick"].modes} == {1, 8}
    assert Mode(1, 64, 1, True).runs()[0] == ("vllm", "pull")
    assert "vllm" in SECTIONS


def test_every_size_builds_a_model_config_vllm_accepts():
    """vLLM refuses a max_model_len above the model's max_position_embeddings: the full
    sizes' 272 blocks once asked for 17,344 tokens of a 16,384-token model."""
    for sizes in VLLM_SIZES.values():
        longest = max(m.tokens for m in sizes.modes) + PAGE  # a prompt and its sampled token
        assert longest <= max_model_len(sizes.blocks) <= MODEL["max_position_embeddings"]


def test_the_section_says_it_is_skipped_where_vllm_is_not_installed(monkeypatch, capsys):
    monkeypatch.setattr(vllm_section.importlib.util, "find_spec", lambda name: None)
    said = []
    section = vllm_section.run_section("tiny", said.append)
    assert section["skipped"].startswith("vllm not installed") and said
    vllm_section.print_section(section)
    assert capsys.readouterr().out.strip().startswith("vllm: skipped: vllm not installed")


def echo(connector: str, role: str) -> Driven:
    """A stand-in instance: a process that answers ``echo``."""
    return Driven(f"{connector} {role}", "tests.bench.echo_driven", [], start_timeout_s=60,
                  command_timeout_s=30)


def state_of(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def wait_state(pid: int, states: str) -> str:
    deadline = time.monotonic() + 10
    while state_of(pid) not in states and time.monotonic() < deadline:
        time.sleep(0.01)
    return state_of(pid)


def test_a_paused_pair_is_stopped_by_pid_and_answers_once_resumed():
    """``Pair.pause``: both instances stopped (state T), no CPU while paused, answering again
    once resumed; ``stop`` of a paused pair resumes it first, so that both quit by themselves."""
    pair = Pair("vllm", VLLM_SIZES["tiny"], "unused", start=echo)
    try:
        pids = [pair.prefill.process.pid, pair.decode.process.pid]
        pair.setup_done()  # their first answers: started
        pair.pause(True)
        assert [wait_state(pid, "T") for pid in pids] == ["T", "T"]
        pair.prefill.submit("echo", value=1)
        time.sleep(0.3)
        with pytest.raises(zmq.Again):  # no answer while stopped
            pair.prefill._socket.recv(zmq.NOBLOCK)
        spent = sum(map(process_cpu_s, pids))
        time.sleep(0.3)
        assert sum(map(process_cpu_s, pids)) == spent
        pair.pause(False)
        assert pair.prefill.reply() == {"ok": True, "value": 1}
        assert pair.decode.call("echo", value=2) == {"ok": True, "value": 2}
        pair.pause(True)
        assert wait_state(pids[1], "T") == "T"
    finally:
        pair.stop()
    assert (pair.prefill.process.returncode, pair.decode.process.returncode) == (0, 0)
    assert not pair.paused


def test_idle_cores_sees_a_busy_instance_and_not_an_idle_one():
    """``idle_cores``: a pair whose instance spins counts about a core, an idle pair about none."""
    busy, idle = (Pair(c, VLLM_SIZES["tiny"], "unused", start=echo) for c in ("vllm", "dsa-bridge"))
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        busy.setup_done()
        idle.setup_done()
        busy.prefill.process, real = spinner, busy.prefill.process  # count the spinner
        try:
            cores = idle_cores({"vllm": busy, "dsa-bridge": idle}, seconds=1.0)
        finally:
            busy.prefill.process = real
        # a spinner gets a share of the two cores even at a load of 20; the echo ones sleep
        assert cores["vllm"] > 0.05 and cores["vllm"] > 3 * cores["dsa-bridge"], cores
    finally:
        spinner.kill()
        spinner.wait(10)
        busy.stop()
        idle.stop()


@pytest.mark.slow  # four vLLM instance processes
@pytest.mark.skipif(bool(VLLM_MISSING), reason=VLLM_MISSING or "")
def test_the_section_runs_both_connectors_byte_exact():
    """As a user runs it: ``dsa-bridge bench --tiny --sections vllm --json`` in its own process
    (which starts the four instances and stops them by PID), bounded."""
    from tests.conftest import require_engine

    require_engine("nixl")
    done = subprocess.run([sys.executable, "-m", "dsa_bridge.transfer.launcher.cli", "bench",
                           "--tiny", "--sections", "vllm", "--json"], cwd=ROOT, capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    section = json.loads(done.stdout)["vllm"]
    modes = section["modes"]
    assert list(modes) == ["1 x 256", "2 x 128", "1 x 256 fragmented"]
    buffers = 2 * VLLM_SIZES["tiny"].layers  # MLA and indexer, every layer
    for name, in_flight in (("1 x 256", 1), ("2 x 128", 2)):
        entry = modes[name]
        assert entry["vllm"]["byte_exact"] and entry["dsa-bridge"]["byte_exact"], entry
        assert entry["descriptors_exact"], entry
        assert entry["dsa-bridge"]["descriptors"] == in_flight * buffers  # one run a request
        assert entry["ratio"] > 0 and entry["ratio_vs_raw"] > 0
    fragmented = modes["1 x 256 fragmented"]
    assert all(fragmented[c]["byte_exact"]
               for c in ("vllm", "dsa-bridge", "dsa-bridge direct", "dsa-bridge staged"))
    assert fragmented["dsa-bridge direct"]["descriptors"] == 4 * buffers  # one block per run
    assert fragmented["dsa-bridge staged"]["descriptors"] < 4 * buffers  # one per slice
    assert fragmented["dsa-bridge"]["descriptors"] > 0  # auto: either route's
    assert len(section["waves"]) == 2 + 2 + 4  # one counted pair a mode, fragmented: 4 waves
    assert set(section["idle_cores"]) == {"vllm", "dsa-bridge"}
    assert all(cores >= 0 for cores in section["idle_cores"].values())
    vllm_section.print_section(section)  # the table a user reads, from the report
