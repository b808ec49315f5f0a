"""``dsa-bridge bench --sections sglang`` for real, at its tiny size: four rank processes (a
prefill and a decode per connector) built by sglang's own code on sglang's own DSA pools, the
same requests through sglang's ``MooncakeKVManager`` and dsa-bridge's ``DSABridgeKVManager``,
Mooncake over TCP on loopback. Not a timed test: it checks that both connectors moved every
request byte-exact (KV, indexer, aux) and that the report has its figures and a ratio — never how
fast either is.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import require_engine

from .conftest import SGLANG_MISSING

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

TIMEOUT_S = 300  # four processes import sglang on a shared 2-core host


def test_tiny_sglang_section_moves_every_request_byte_exact_through_both_connectors():
    require_engine("mooncake")
    result = subprocess.run(
        [sys.executable, "-m", "dsa_bridge.transfer.launcher.cli", "bench", "--tiny", "--json",
         "--sections", "sglang"], capture_output=True, text=True, timeout=TIMEOUT_S,
        stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-4000:]
    section = json.loads(result.stdout)["sglang"]  # fails if anything but the report reached stdout
    assert section["managers"] == {"sglang": ["MooncakeKVManager", "MooncakeKVManager"],
                                   "dsa-bridge": ["DSABridgeKVManager", "DSABridgeKVManager"]}
    assert set(section["modes"]) == {"1 x 256", "2 x 128", "2 x 128, busy"}
    for entry in section["modes"].values():
        assert entry["ratio"] > 0 and isinstance(entry["target_met"], bool)
        for connector in ("sglang", "dsa-bridge"):
            row = entry[connector]
            assert row["byte_exact"], (connector, entry)
            assert row["ms_per_request"] > 0 and row["gbps"] > 0 and row["prefill_cpu_s"] > 0
            for process in ("prefill", "decode"):  # (tiny windows: often under a clock tick)
                threads = row[f"{process}_cpu_by_thread"]
                assert all(isinstance(s, float) and s >= 0 for s in threads.values()), threads
    # every request's bytes compared: 4 layers' KV and indexer of its pages, and its aux row
    page_bytes = 64 * 4 * (656 + 132)
    first = section["waves"][0]  # one request of 4 pages
    aux_bytes = first["nbytes"] - 4 * page_bytes
    assert 0 < aux_bytes < 4096
    assert len(section["waves"]) == 2 * (3 + 3 + 2)  # both connectors, each mode's waves + a warm-up
    for wave in section["waves"]:
        assert wave["mismatched"] == []
        pages = wave["tokens"] // 64 * wave["in_flight"]
        assert wave["nbytes"] == pages * page_bytes + wave["in_flight"] * aux_bytes
    assert len(section["load_average"]["start"]) == 3
