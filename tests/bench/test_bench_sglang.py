"""The ``sglang`` section of ``dsa-bridge bench`` (``bench/sglang_pd.py``), its pure parts: the
``--sections`` flag, the waves' requests, the report's maths (ms per request, GB/s, CPU seconds,
the ratio dsa-bridge / sglang over interleaved wave pairs), and the skip where sglang is not
importable (exit code 0, the reason in the report). The real run is
``tests/sglang/test_sglang_bench.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import threading
import time

import pytest

from dsa_bridge.transfer.bench import sglang_pd
from dsa_bridge.transfer.bench.command import DEFAULT_SECTIONS, SECTIONS, add_bench_parser
from dsa_bridge.transfer.bench.sglang_pd import SGLANG_SIZES, Mode, summarize, wave_requests
from dsa_bridge.transfer.bench.thread_cpu import cpu_by_thread, snapshot


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_sections_default_to_their_default_list_and_take_a_list():
    assert parse().sections == list(DEFAULT_SECTIONS)
    assert {"core", "sglang"} <= set(DEFAULT_SECTIONS) <= set(SECTIONS)
    assert parse("--sections", "sglang", "--quick").sections == ["sglang"]
    assert parse("--sections", "core,sglang").sections == ["core", "sglang"]


def test_an_unknown_section_is_refused_naming_the_choices(capsys):
    with pytest.raises(SystemExit):
        parse("--sections", "nonesuch")
    assert f"choose from {', '.join(SECTIONS)}, got 'nonesuch'" in capsys.readouterr().err


def test_the_sizes_move_the_issues_requests_and_fit_their_pools():
    quick = SGLANG_SIZES["quick"]
    assert quick.layers == 61  # DeepSeek-V3.2, every layer
    assert quick.modes == (Mode(1, 8, 8192), Mode(8, 32, 2048), Mode(8, 16, 2048, busy=True))
    assert [m.name for m in quick.modes] == ["1 x 8192", "8 x 2048", "8 x 2048, busy"]
    for sizes in SGLANG_SIZES.values():
        for mode in sizes.modes:
            assert mode.requests % mode.in_flight == 0 and mode.tokens % 64 == 0
            last = wave_requests(mode, mode.waves - 1)
            assert max(slot for _, slot, _ in last) < sizes.slots
            # a wave's pages (slot * pages + 1 ...) stay inside the pool, padding page excluded
            assert max((slot + 1) * pages for _, slot, pages in last) < sizes.pool_pages
    assert SGLANG_SIZES["quick"].pool_pages == 8 * 32 + 1


def test_every_wave_has_its_own_rooms_the_same_on_both_connectors():
    rooms = [room for mode in SGLANG_SIZES["full"].modes for wave in range(-1, mode.waves)
             for room, _, _ in wave_requests(mode, wave)]
    assert len(rooms) == len(set(rooms))
    assert wave_requests(Mode(8, 32, 2048), 3) == wave_requests(Mode(8, 32, 2048), 3)


def wave(connector: str, pair: int, seconds: float, *, in_flight: int = 2, cpu: float = 0.1,
         mismatched: tuple = ()) -> dict:
    return {"connector": connector, "in_flight": in_flight, "tokens": 128, "pair": pair,
            "seconds": seconds, "nbytes": 10**9 * in_flight, "prefill_cpu_s": cpu,
            "decode_cpu_s": cpu / 2, "mismatched": list(mismatched)}


def test_summary_per_connector_and_the_ratio_over_wave_pairs():
    waves = [wave("sglang", 0, 0.2), wave("dsa-bridge", 0, 0.1),  # pair ratio 2.0
             wave("sglang", 1, 0.2), wave("dsa-bridge", 1, 0.4),  # 0.5
             wave("sglang", 2, 0.3), wave("dsa-bridge", 2, 0.2, mismatched=("slot 0 kv:3",)),  # 1.5
             wave("sglang", -1, 9.0), wave("dsa-bridge", -1, 0.01)]  # the warm-up: not counted
    (name, entry), = summarize(waves).items()
    assert name == "2 x 128" and (entry["in_flight"], entry["tokens"]) == (2, 128)
    assert entry["ratio"] == pytest.approx(1.5)  # the median of 2.0, 0.5 and 1.5
    assert entry["target_met"]
    sglang, bridge = entry["sglang"], entry["dsa-bridge"]
    assert sglang["requests"] == bridge["requests"] == 6
    assert sglang["ms_per_request"] == pytest.approx(100)  # median of 0.2/2, 0.2/2, 0.3/2 s
    assert bridge["ms_per_request"] == pytest.approx(100)  # median of 0.05, 0.2, 0.1 s
    assert sglang["gbps"] == pytest.approx(6 / 0.7) and bridge["gbps"] == pytest.approx(6 / 0.7)
    assert sglang["prefill_cpu_s"] == pytest.approx(0.3)
    assert sglang["decode_cpu_s"] == pytest.approx(0.15)
    assert sglang["byte_exact"] and not bridge["byte_exact"]


def test_summary_sums_each_process_cpu_per_thread_over_the_counted_waves():
    waves = [{**wave("sglang", 0, 0.2), "decode_threads": {"native": 0.5, "MainThread": 0.1}},
             {**wave("sglang", 1, 0.2), "decode_threads": {"native": 0.25, "HeartbeatChecker": 0.01}},
             {**wave("sglang", -1, 0.2), "decode_threads": {"native": 9.0}},  # warm-up: not counted
             {**wave("dsa-bridge", 0, 0.1), "decode_threads": {"decode-control": 0.02, "native": 0.7}},
             wave("dsa-bridge", 1, 0.1)]  # a wave without per-thread figures adds nothing
    (_, entry), = summarize(waves).items()
    assert entry["sglang"]["decode_cpu_by_thread"] == {"native": 0.75, "MainThread": 0.1,
                                                       "HeartbeatChecker": 0.01}
    assert list(entry["sglang"]["decode_cpu_by_thread"]) == ["native", "MainThread", "HeartbeatChecker"]
    assert entry["dsa-bridge"]["decode_cpu_by_thread"] == {"native": 0.7, "decode-control": 0.02}
    assert entry["dsa-bridge"]["prefill_cpu_by_thread"] == {}


def test_cpu_by_thread_is_the_difference_per_name_and_finds_a_python_thread_by_its_name():
    before = {1: ("MainThread", 1.0), 2: ("native", 5.0), 3: ("native", 1.0), 4: ("gone", 3.0)}
    after = {1: ("MainThread", 1.25), 2: ("native", 5.5), 3: ("native", 1.0), 5: ("new", 0.5),
             6: ("idle", 0.0)}
    assert cpu_by_thread(before, after) == {"native": 0.5, "new": 0.5, "MainThread": 0.25}
    done, spent = threading.Event(), {}

    def burn():  # a Python thread's CPU is found under its name, an idle one's is not
        start = time.thread_time()
        while time.thread_time() - start < 0.2:
            pass
        spent["s"] = time.thread_time() - start
        done.wait(10)

    first = snapshot()
    burner = threading.Thread(target=burn, name="burner")
    burner.start()
    try:
        deadline = time.monotonic() + 10
        while "s" not in spent and time.monotonic() < deadline:
            time.sleep(0.01)
        threads = cpu_by_thread(first, snapshot())
    finally:
        done.set()
        burner.join(10)
    assert 0.15 <= threads["burner"] <= 0.35, threads  # clock ticks of 10 ms


def test_summary_keeps_modes_apart_and_a_slower_dsa_bridge_misses_the_target():
    waves = [wave("sglang", 0, 0.18, in_flight=1), wave("dsa-bridge", 0, 0.2, in_flight=1),
             wave("sglang", 0, 1.0, in_flight=8), wave("dsa-bridge", 0, 0.8, in_flight=8),
             {**wave("sglang", 0, 3.0, in_flight=8), "busy": True},
             {**wave("dsa-bridge", 0, 1.0, in_flight=8), "busy": True}]
    modes = summarize(waves)
    assert list(modes) == ["1 x 128", "8 x 128", "8 x 128, busy"]
    assert modes["8 x 128, busy"]["ratio"] == pytest.approx(3.0) and modes["8 x 128, busy"]["busy"]
    assert not modes["8 x 128"]["busy"]
    assert modes["1 x 128"]["ratio"] == pytest.approx(0.9) and not modes["1 x 128"]["target_met"]
    assert modes["8 x 128"]["ratio"] == pytest.approx(1.25) and modes["8 x 128"]["target_met"]
    assert modes["8 x 128"]["sglang"]["ms_per_request"] == pytest.approx(125)


def test_without_sglang_the_section_is_skipped_with_the_reason(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    lines = []
    assert sglang_pd.run_section("tiny", lines.append) == {"skipped": sglang_pd.sglang_problem()}
    assert "sglang is not importable from" in lines[0] and ".venv-sglang" in lines[0]


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None,
                    reason="sglang is installed here: the section would run")
def test_the_bench_command_skips_the_section_and_exits_0_where_sglang_is_missing():
    result = subprocess.run(
        [sys.executable, "-m", "dsa_bridge.transfer.launcher.cli", "bench", "--tiny", "--json",
         "--sections", "sglang"], capture_output=True, text=True, timeout=60,
        stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert "sglang is not importable" in report["sglang"]["skipped"]
    assert "transfer" not in report  # the core section did not run
    assert "sglang section skipped" in result.stderr
