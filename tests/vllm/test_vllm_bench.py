"""The ``vllm`` section of ``dsa-bridge bench`` (``bench/vllm.py``, ``bench/vllm_rank.py``): its
pure parts everywhere (the figures from waves, the skip where vllm is not installed, the
section's place among the bench's choices); where vllm is installed, the section at ``--tiny``
as the bench runs it: two vLLM instance processes, every mode byte-exact, the raw engine on the
same descriptors, the fragmented table staged against direct."""

from __future__ import annotations

import pytest

from dsa_bridge.transfer.bench import vllm as vllm_section
from dsa_bridge.transfer.bench.command import SECTIONS
from dsa_bridge.transfer.bench.vllm import TARGETS, VLLM_SIZES, Mode, summarize

from .conftest import VLLM_MISSING


def wave(seconds, route="direct", raw=None, nbytes=1000, descriptors=8, differ=None):
    w = {"mode": "m", "route": route, "seconds": seconds, "decode_cpu_s": 0.1, "nbytes": nbytes,
         "descriptors": descriptors, "written_bytes": nbytes, "differ": differ or {}}
    if raw is not None:
        w.update(raw_seconds=raw, raw_descriptors=descriptors, raw_bytes=nbytes)
    return w


def test_a_mode_against_the_raw_engine_is_the_median_of_its_waves():
    entry = summarize(Mode(2, 128, 3), [wave(0.2, raw=0.1), wave(0.1, raw=0.1), wave(0.4, raw=0.38)])
    assert entry["ratio_vs_raw"] == pytest.approx(0.95)  # median of 0.5, 1.0, 0.95
    assert entry["target"] == TARGETS["ratio_vs_raw"] and entry["target_met"]
    assert entry["ms_per_request"] == pytest.approx(100)  # median 0.2 s over 2 requests
    assert entry["gbps"] == pytest.approx(3000 / 0.7 / 1e9)
    assert entry["byte_exact"] and entry["descriptors_exact"]
    worse = summarize(Mode(1, 64, 1), [wave(0.2, raw=0.1, differ={"w1-0": 3})])
    assert not worse["target_met"] and not worse["byte_exact"]
    other = wave(0.1, raw=0.1)
    other["raw_descriptors"] = 9
    assert not summarize(Mode(1, 64, 1), [other])["descriptors_exact"]


def test_the_fragmented_mode_is_direct_over_staged():
    entry = summarize(Mode(1, 256, 2, True), [
        wave(0.3, descriptors=32), wave(0.2, "staged", descriptors=1),
        wave(0.1, descriptors=32), wave(0.1, "staged", descriptors=1)])
    assert entry["ratio"] == pytest.approx(1.25)  # median of 1.5 and 1.0
    assert entry["target"] == TARGETS["staged_vs_direct"] and entry["target_met"]
    assert (entry["direct_descriptors"], entry["staged_descriptors"]) == (32, 1)


def test_sizes_fit_their_modes():
    for sizes in VLLM_SIZES.values():
        assert sizes.blocks > max(m.blocks for m in sizes.modes)
        assert {m.fragmented for m in sizes.modes} == {True, False}
        assert {m.in_flight for m in sizes.modes if not m.fragmented} >= {1} and sizes.layers >= 1
    assert {m.in_flight for m in VLLM_SIZES["quick"].modes} == {1, 8}
    assert "vllm" in SECTIONS


def test_the_section_says_it_is_skipped_where_vllm_is_not_installed(monkeypatch, capsys):
    monkeypatch.setattr(vllm_section.importlib.util, "find_spec", lambda name: None)
    said = []
    section = vllm_section.run_section("tiny", said.append)
    assert section["skipped"].startswith("vllm not installed") and said
    vllm_section.print_section(section)
    assert capsys.readouterr().out.strip().startswith("vllm: skipped: vllm not installed")


@pytest.mark.slow  # two vLLM instance processes
@pytest.mark.skipif(bool(VLLM_MISSING), reason=VLLM_MISSING or "")
def test_the_section_runs_byte_exact_through_vllm(capsys):
    from tests.conftest import require_engine

    require_engine("nixl")
    section = vllm_section.run_section("tiny", lambda text: None)
    modes = section["modes"]
    assert list(modes) == ["1 x 256", "2 x 128", "1 x 256 fragmented"]
    buffers = 2 * VLLM_SIZES["tiny"].layers  # MLA and indexer, every layer
    for name, in_flight in (("1 x 256", 1), ("2 x 128", 2)):
        entry = modes[name]
        assert entry["byte_exact"] and entry["descriptors_exact"], entry
        assert entry["descriptors"] == in_flight * buffers  # each request's blocks one run
        assert entry["ratio_vs_raw"] > 0 and entry["target"] == 0.9
    fragmented = modes["1 x 256 fragmented"]
    assert fragmented["byte_exact"]
    assert fragmented["direct_descriptors"] == 4 * buffers  # one block per run
    assert fragmented["staged_descriptors"] < fragmented["direct_descriptors"]
    assert "cannot be partitioned into NIXL regions" in section["vllm_nixl"]
    vllm_section.print_section(section)
    out = capsys.readouterr().out
    assert "ratio_vs_raw" in out and "staged_vs_direct" in out and "target >= 1.25" in out
