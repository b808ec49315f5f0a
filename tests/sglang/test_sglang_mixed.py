"""A mixed deployment inside the real sglang 0.5.23 (``plugin/sglang/mixed.py``): the plugin named
in ``SGLANG_PLUGINS`` on one server only, each server a process of its own (``mixed_rank.py``),
sglang's own classes on the other side. On Mooncake only: sglang's own NIXL manager does not run on
the CPU (it imports the ``nixl`` meta package, absent beside the ``nixl_cu12`` wheel, and registers
the KV cache as GPU memory, ``register_buffer_to_engine``); dsa-bridge's side is the same code for
both engines (the registration, the bootstrap server, the parallel-info refusal).

- sglang's own decode against a dsa-bridge prefill: sglang's decode fails its request at its
  ``init``, within 10 s of the request, with sglang's policy-mismatch message carrying dsa-bridge's
  "set SGLANG_PLUGINS=dsa_bridge on the decode server too"; the prefill's bootstrap server counts
  the foreign decode and says which side lacks the plugin, within 10 s too;
- dsa-bridge's decode against sglang's own prefill: refused from the prefill's parallel info
  (``kv_layout``), the request failed within 10 s, naming ``SGLANG_PLUGINS=dsa_bridge`` on the
  prefill; and sglang's own prefill is told in its own protocol (sglang's ABORT to its rank
  port): its request fails within 10 s too, as sglang's prefill fails a request its decode
  aborted, in its own words (the ABORT carries no reason: dsa-bridge's decode logs it, naming
  the prefill's missing plugin).
"""

from __future__ import annotations

import json
import os

import pytest

from tests.conftest import require_engine

from ..forkserver import RankProcess
from .conftest import SGLANG_MISSING

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

from .test_sglang_conn import MODELS, ROOT, free_port, result_of, stopped_at_end  # noqa: E402

FAST_S = 10.0


def run_mixed(engine: str, bridge_side: str, logs) -> tuple[dict, dict]:
    """Prefill and decode processes, ``SGLANG_PLUGINS=dsa_bridge`` on ``bridge_side`` only; output
    to files in ``logs`` (never a pipe left unread); both always stopped."""
    require_engine(engine)
    cfg = {"engine": engine, "port": free_port(), "room": 2**62 + 12345, "pages": 8,
           "done": str(logs / "done"), "prefill_done": str(logs / "prefill_done"),
           **MODELS["deepseek-v3.2"]}
    base = {k: v for k, v in os.environ.items() if k != "SGLANG_PLUGINS"}
    base.update(SGLANG_HOST_IP="127.0.0.1", MC_LOG_LEVEL="ERROR")
    procs: list = []
    files: list = []
    with stopped_at_end(procs, files):
        for role in ("prefill", "decode"):
            env = {**base, "SGLANG_PLUGINS": "dsa_bridge"} if role == bridge_side else base
            out, err = open(logs / f"{role}.out", "w+"), open(logs / f"{role}.err", "w+")
            files += [out, err]
            procs.append(RankProcess(["-m", "tests.sglang.mixed_rank", role, json.dumps(cfg)], env, str(ROOT),
                                     out, err))
        for proc in procs:
            proc.wait(timeout=240)
        errors = {role: (logs / f"{role}.err").read_text()[-3000:] for role in ("prefill", "decode")}
        assert [proc.returncode for proc in procs] == [0, 0], errors
        results = [result_of((logs / f"{role}.out").read_text()) for role in ("prefill", "decode")]
        return results[0], {**results[1], "prefill_log": (logs / "prefill.err").read_text(),
                            "decode_log": (logs / "decode.err").read_text()}


@pytest.mark.parametrize("engine", ["mooncake"])
def test_sglang_decode_against_dsa_bridge_prefill_fails_fast_and_says_why(engine, tmp_path):
    prefill, decode = run_mixed(engine, "prefill", tmp_path)
    assert (prefill["manager"], decode["manager"]) == ("DSABridgeKVManager",
                                                       f"{engine.capitalize()}KVManager")
    assert decode["poll"] == 0 and decode["elapsed_s"] < FAST_S, decode  # Failed, at once
    assert "decode allocation policy mismatch: prefill=dsa-bridge" in decode["reason"]
    assert "set SGLANG_PLUGINS=dsa_bridge on the decode server too" in decode["reason"]
    # the prefill side: counted and logged, naming the side without the plugin
    assert prefill["foreign"] >= 1 and prefill["recognised_at"] - decode["t0"] < FAST_S, (prefill, decode)
    assert "SGLANG_PLUGINS=dsa_bridge is not set on that decode server" in decode["prefill_log"]


@pytest.mark.parametrize("engine", ["mooncake"])
def test_dsa_bridge_decode_against_sglang_prefill_fails_fast_and_says_why(engine, tmp_path):
    prefill, decode = run_mixed(engine, "decode", tmp_path)
    assert (prefill["manager"], decode["manager"]) == (f"{engine.capitalize()}KVManager",
                                                       "DSABridgeKVManager")
    assert decode["poll"] == 0 and decode["elapsed_s"] < FAST_S, decode
    assert "registered kv_layout None, not dsa-bridge's" in decode["reason"]
    assert "set SGLANG_PLUGINS=dsa_bridge on the prefill too" in decode["reason"]
    assert not decode["initialised"]  # refused from the parallel info: never paired
    # sglang's own prefill is told with sglang's ABORT: its request fails at once
    assert prefill["poll"] == 0 and prefill["failed_at"] - decode["t0"] < FAST_S, (prefill, decode)
    # sglang's ABORT carries no reason: sglang's prefill fails the request in its own words...
    assert prefill["reason"].endswith("Failed due to an unknown reason from another rank")
    assert decode["aborts_sent"] >= 1
    # ...and dsa-bridge's decode logs why, once per prefill
    assert "told sglang's own prefill at 127.0.0.1" in decode["decode_log"]
    assert "set SGLANG_PLUGINS=dsa_bridge on the prefill too" in decode["decode_log"]


def test_sglangs_own_parser_reads_the_abort_as_a_room_without_an_ack_asked():
    from sglang.srt.disaggregation.common.conn import AbortNotification

    from dsa_bridge.plugin.sglang.mixed import abort_frames

    notification = AbortNotification.from_zmq(abort_frames(2**62 + 12345))
    assert notification == AbortNotification(room=2**62 + 12345)
    assert notification.deferred_ack_target() is None  # sglang's prefill sends no ABORT_ACK
