"""sglang's Rust server with DP attention (``SGLANG_RUST_SERVER``): prefill ranks register as
sglang's own managers do (common/conn.py ``register_to_bootstrap``): every rank's row is gathered
over the world group and each rank owning a Rust listener puts them all into its registry, with
the listener's port as the prefill's HTTP port.

Two DP-attention prefill ranks, each its own process (``registry_rank.py``), over one gloo world
and sglang's own ``GroupCoordinator``, their managers made by sglang's ``_init_kv_manager``.
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
RUST = {"SGLANG_RUST_SERVER": "1"}


def registered(ranks: list[dict]) -> list[list]:
    """What a registry holding every rank's row holds: [dp, cp, tp, pp, endpoint] per rank."""
    return sorted([r["dp_rank"], 0, 0, 0, r["endpoint"]] for r in ranks)


@pytest.mark.parametrize("listeners", ["every rank", "rank 0 only"])
def test_each_rust_listener_holds_every_dp_rank(listeners):
    require_engine("mooncake")
    base = config("mooncake", MODEL, dist_port=free_port())
    ports = [free_port(), free_port() if listeners == "every rank" else None]
    results = run_ranks([("prefill", [{**base, "dp_rank": r, "rust_port": ports[r]}]) for r in (0, 1)],
                        module="tests.sglang.registry_rank", env=RUST)
    ranks = [{**result, "dp_rank": r} for r, (result,) in enumerate(results)]
    assert len({r["endpoint"] for r in ranks}) == 2
    for rank, port in zip(ranks, ports, strict=True):
        if port is None:  # no listener: its row is in rank 0's registry
            assert rank["registry"] is None
            continue
        assert rank["registry"] == registered(ranks)
        assert rank["prefill_http_port"] == port  # the listener's port, as sglang registers it
