"""sglang's memory saver (``--enable-memory-saver``) with dsa-bridge's managers, inside the real
sglang 0.5.23, prefill and decode each their own process (``saver_rank.py``): sglang's own
``release_memory_occupation`` of its prefill bootstrap queue and decode prealloc queue calls
``deregister_buffer_to_engine``; the requests still running fail with the reason, the cache
leaves the engines, a request while released fails naming it; sglang's own
``resume_memory_occupation`` calls ``register_buffer_to_engine``, and the next request is
byte-exact on KV, indexer and aux, on both engines."""

from __future__ import annotations

import pytest

from tests.conftest import require_engine

from .conftest import SGLANG_MISSING
from .test_sglang_conn import config, free_port, run_ranks

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

MODEL = {"layers": 4, "model_layers": 4, "kv_cache_dim": 656}
RELEASED = "the cache's memory was released (sglang's release_memory_occupation)"


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_a_release_and_resume_of_the_cache_memory(engine):
    require_engine(engine)
    cfg, port = config(engine, MODEL), free_port()
    (prefill,), (decode,) = run_ranks([("saver-prefill", [{**cfg, "dist_port": port, "dist_rank": 0}]),
                                       ("saver-decode", [{**cfg, "dist_port": port, "dist_rank": 1}])])
    assert prefill["first"] == decode["first"] == 4, (prefill, decode)
    assert decode["first_exact"]["mismatched"] == [] and decode["first_exact"]["aux_exact"]
    # released: the running requests failed with the reason, the cache out of the engines
    assert prefill["running"] == decode["running"] == 0
    assert RELEASED in prefill["running_reason"] and RELEASED in decode["running_reason"], (prefill, decode)
    assert prefill["engine_closed"]
    assert decode["registered_before"] > 0 and decode["registered_released"] == 0
    assert decode["nodes_released"] == 0
    assert decode["refused"] == 0 and "release_memory_occupation, not resumed" in decode["refused_reason"]
    # resumed: registered again, the next request byte-exact with the new bytes
    assert decode["registered_resumed"] == decode["registered_before"]
    assert prefill["same_endpoint"]
    assert prefill["second"] == decode["second"] == 4, decode["second_reason"]
    assert decode["second_exact"]["mismatched"] == [] and decode["second_exact"]["aux_exact"]
    assert decode["second_exact"]["others_sentinel"]
