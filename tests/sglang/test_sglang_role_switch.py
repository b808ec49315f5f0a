"""sglang's runtime P<->D role switch (``--enable-pd-role-switch``) over dsa-bridge's managers.

Two instances, each its own OS process (``switch_rank.py``): A starts as prefill, B as decode,
each with its bootstrap server, one pool for every role. A request goes A -> B; both switch
through sglang's own ``handle_pd_role_switch`` (its checks pass on dsa-bridge's
``supports_role_switch``; ``teardown_disaggregation`` calls the manager's ``teardown``; the new
role's manager is made over the same pool); the next request goes B -> A; both switch back, and
a third goes A -> B again (each instance starts its next request once both switched, as a
router would send it). Every request byte-exact on KV, indexer and aux, on both engines.
"""

from __future__ import annotations

import pytest

from tests.conftest import require_engine
from tests.ports import free_port

from .conftest import SGLANG_MISSING
from .test_sglang_conn import config, run_ranks

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

MODEL = {"layers": 4, "model_layers": 4, "kv_cache_dim": 656}
PAGE_BYTES = 64 * (656 + 132) * 4  # KV and indexer rows of a page, every layer


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_instances_switch_roles_and_serve_both_directions_byte_exact(engine, tmp_path):
    require_engine(engine)
    base = config(engine, MODEL, barrier_dir=str(tmp_path))
    a_port, b_port = free_port(), free_port()
    requests = [{"port": prefill_port, "room": base["room"] + i, "seed": 11 + i}
                for i, prefill_port in enumerate((a_port, b_port, a_port))]
    (a,), (b,) = run_ranks([("prefill", [{**base, "port": a_port, "requests": requests}]),
                            ("decode", [{**base, "port": b_port, "requests": requests}])],
                           module="tests.sglang.switch_rank")
    assert [s["role"] for s in a["served"]] == ["prefill", "decode", "prefill"]
    assert [s["role"] for s in b["served"]] == ["decode", "prefill", "decode"]
    for served in (a["served"], b["served"]):
        assert all(s["manager"] == "DSABridgeKVManager" for s in served)
        for s in served[:-1]:  # sglang's own switch, after every request but the last
            assert s["switch"]["success"], s["switch"]["message"]
            assert s["switch"]["new_role"] != s["role"]
    for i, (x, y) in enumerate(zip(a["served"], b["served"], strict=True)):
        prefill, decode = (x, y) if x["role"] == "prefill" else (y, x)
        assert decode["poll"] == prefill["poll"] == 4, (i, decode.get("reason"), prefill.get("reason"))
        assert decode["mismatched"] == [] and decode["others_sentinel"], i
        assert decode["aux_exact"] and decode["aux_others_sentinel"], i
        pages = len(base["src_pages"])
        assert prefill["bytes"] == decode["nbytes"] == pages * PAGE_BYTES + decode["aux_bytes"], i
