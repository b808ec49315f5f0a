"""One Mooncake engine per sglang process (``hooks.one_engine``): sglang starts a shared Mooncake
engine in every scheduler process (``maybe_init_shared_mooncake_transfer_engine``, called from its
distributed bootstrap); with dsa-bridge named in ``SGLANG_PLUGINS`` that start is skipped where PD
transfer is its only user, so the process runs dsa-bridge's engine alone; not named, the same
process runs two. Each case in its own process (``load_plugins`` patches sglang's modules once
per process, as in a scheduler), counting the Mooncake ``TransferEngine``\\s the process made.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import require_engine

from .. import forkserver
from .conftest import SGLANG_MISSING, published_context

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

from dsa_bridge.plugin.sglang.hooks import mooncake_only_for_pd  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, logging
import tests.sglang.conftest  # the shims
logging.basicConfig(level=logging.INFO)
from sglang.srt.plugins import load_plugins
load_plugins()
import mooncake.engine
made = []
class Counted(mooncake.engine.TransferEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        made.append(self)
mooncake.engine.TransferEngine = Counted  # sglang's engine and dsa-bridge's import it when made
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.distributed.device_communicators import mooncake_transfer_engine as shared
# sglang's caller (distributed/bootstrap.py) imports uvicorn, absent here; HookRegistry updates its
# reference as it does the defining module's, called here
from dsa_bridge.plugin.sglang import conn
from dsa_bridge.plugin.sglang.pool import BridgeDSATokenToKVPool
from tests.sglang.conftest import published_context
from tests.sglang.test_sglang_conn import DSV32
from tests.sglang.test_sglang_conn_bringup import kv_args
with published_context(disaggregation_mode="decode", disaggregation_transfer_backend="mooncake",
                       host="127.0.0.1") as server_args:
    shared.maybe_init_shared_mooncake_transfer_engine(gpu_id=0)  # sglang's scheduler start-up
    manager = conn.DSABridgeKVManager(kv_args(BridgeDSATokenToKVPool(**DSV32)),
                                      DisaggregationMode.DECODE, server_args, True)
    result = {"engines": len(made), "sglangs": shared.get_mooncake_transfer_engine() is not None,
              "dsa_bridges": manager.decode_nodes.engine is not None}
    manager.shutdown()
print("RESULT " + json.dumps(result))
"""


def probe(plugins: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_PLUGINS"}
    env["SGLANG_HOST_IP"] = "127.0.0.1"
    if plugins is not None:
        env["SGLANG_PLUGINS"] = plugins
    out = forkserver.run(["-c", PROBE], env, str(ROOT), timeout_s=240)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    return {**json.loads(line[len("RESULT "):]), "log": out.stderr}


@pytest.mark.parametrize("fields, only_pd", [
    ({"disaggregation_mode": "decode", "disaggregation_transfer_backend": "mooncake"}, True),
    ({"disaggregation_mode": "decode", "disaggregation_transfer_backend": "nixl"}, False),
    ({"disaggregation_mode": "decode", "disaggregation_transfer_backend": "mooncake",
      "enable_hierarchical_cache": True, "hicache_storage_backend": "mooncake"}, False),
])
def test_sglangs_engine_is_skipped_only_where_pd_transfer_alone_would_use_it(fields, only_pd):
    with published_context(**fields):
        assert mooncake_only_for_pd() is only_pd


def test_a_process_runs_one_engine_with_the_plugin_and_two_without():
    require_engine("mooncake")
    named = probe("dsa_bridge")
    assert named == {**named, "engines": 1, "sglangs": False, "dsa_bridges": True}
    assert "sglang's shared Mooncake engine not started" in named["log"]
    unnamed = probe(None)  # sglang's hooks not registered: its engine starts as well
    assert unnamed == {**unnamed, "engines": 2, "sglangs": True, "dsa_bridges": True}
