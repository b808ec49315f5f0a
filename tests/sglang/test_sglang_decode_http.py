"""The HTTP calls sglang's decode queue makes through its KV manager, against the real sglang
0.5.23 on the CPU: neither may crash the decode scheduler.

- **The prefill DP-rank query.** Every step of sglang's decode event loop calls
  ``prefetch_prefill_dp_rank_queries``, which runs ``CommonKVReceiver.query_prefill_dp_ranks``
  on the manager's ``_ensure_prefill_recompute_executor()`` for requests whose prefill DP rank it
  cannot compute (a DP prefill under another load balancing than ``follow_bootstrap_room``).
  Driven through sglang's own ``DecodePreallocQueue`` code in its own process
  (``prealloc_rank.py``, scenario ``dp_query``): the registered room's request reaches the DP
  group the prefill registered, an unregistered one keeps waiting, and nothing raises.
- **The rebootstrap.** sglang's ``_submit_prefill_recompute`` (a retracted request enqueued
  again) calls the manager's ``submit_prefill_recompute`` with sglang's own
  ``Req.build_rebootstrap_payload()``: the manager POSTs it to the prefill's ``/generate`` at the
  HTTP port the prefill registered, once per request (attention-TP rank 0), off the scheduler
  thread; a prefill that answers an error, or registered no port, fails the request with the
  reason.
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from tests.conftest import require_engine
from tests.transfer.helpers import wait_for

from .conftest import SGLANG_MISSING, published_context
from .test_sglang_conn import DSV32, MODELS, config, free_port, put_route, registration, run_ranks

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402
from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeRequest  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402
from sglang.srt.managers.schedule_batch import Req  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402

from dsa_bridge.plugin.sglang import conn  # noqa: E402
from dsa_bridge.plugin.sglang.pool import BridgeDSATokenToKVPool  # noqa: E402

from .test_sglang_conn_bringup import kv_args  # noqa: E402

ROOM = 4242


# ---- the prefill DP-rank query, through sglang's own prealloc queue --------------------------------

def test_sglangs_dp_rank_query_runs_on_the_managers_threads_and_finds_the_registered_group():
    require_engine("nixl")
    cfg = {**config("nixl", MODELS["deepseek-v3.2"]), "scenario": "dp_query", "dist_port": free_port(),
           "silent_port": free_port()}
    (decode,) = run_ranks([("prealloc", cfg)])
    assert decode["prefetched"]  # sglang's prefetch ran its query on the manager's executor
    # room 500 was registered on DP rank 1: its request went to that group (whose rank does not
    # listen, so it fails naming it); room 501 was never registered: it still waits for its rank
    assert "(dp 1)" in decode["queried_reason"], decode["queried_reason"]
    assert set(decode["pending"]) == {"unregistered"}  # (sglang keeps it in two lists)


# ---- the rebootstrap: sglang's payload POSTed to the prefill's /generate ---------------------------

class Prefill(ThreadingHTTPServer):
    """A prefill's HTTP API, as far as the rebootstrap needs it: records each ``POST /generate``
    body and answers ``status``."""

    def __init__(self, status: int):
        self.status, self.bodies = status, []
        super().__init__(("127.0.0.1", free_port()), _Generate)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self.thread.join(timeout=10)


class _Generate(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802  (http.server's name)
        length = int(self.headers["Content-Length"])
        self.server.bodies.append((self.path, json.loads(self.rfile.read(length))))
        self.send_response(self.server.status)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


def rebootstrap(http_port: int | None, *, status: int = 200, attn_tp_rank: int = 0):
    """sglang's ``_submit_prefill_recompute`` for a retracted request of room ``ROOM`` whose
    prefill registered ``http_port`` (None: no port); returns (the prefill's POSTs, the
    receiver's poll once settled, its failure message)."""
    prefill, port = Prefill(status), free_port()
    server = conn.DSABridgeKVBootstrapServer("127.0.0.1", port)
    try:
        fields = {} if http_port is None else {"prefill_http_port": prefill.server_address[1]}
        put_route(port, registration(**fields))
        with published_context(disaggregation_mode="decode", disaggregation_transfer_backend="nixl") as sa:
            manager = conn.DSABridgeKVManager(kv_args(BridgeDSATokenToKVPool(**DSV32)),
                                              DisaggregationMode.DECODE, sa, True)
            manager.attn_tp_rank = attn_tp_rank  # the rank sglang's parallel state would give
            try:
                addr = f"127.0.0.1:{port}"
                assert manager.try_ensure_parallel_info(addr)
                req = Req(rid="retracted", origin_input_text="", origin_input_ids=[1, 2, 3],
                          sampling_params=SamplingParams(max_new_tokens=8), bootstrap_host="127.0.0.1",
                          bootstrap_port=port, bootstrap_room=ROOM)
                req.output_ids = [7, 8]
                receiver = conn.DSABridgeKVReceiver(manager, addr, ROOM)
                queue = SimpleNamespace(kv_manager=manager)
                DecodePreallocQueue._submit_prefill_recompute(
                    queue, DecodeRequest(req=req, kv_receiver=receiver, is_rebootstrap=True))
                failing = status >= 400 or http_port is None
                if attn_tp_rank == 0:
                    wait_for(lambda: receiver.poll() == KVPoll.Failed if failing else prefill.bodies,
                             30, "the rebootstrap's outcome")
                time.sleep(0.5)  # what else would come (a second POST, a late failure) has come
                poll, message = int(receiver.poll()), None
                if poll == KVPoll.Failed:
                    with pytest.raises(Exception) as failure:
                        receiver.failure_exception()
                    message = str(failure.value)
                receiver.clear()
            finally:
                manager.shutdown()
    finally:
        server.close()
        prefill.close()
    return prefill.bodies, poll, message


def test_a_rebootstrap_posts_sglangs_payload_to_the_prefills_generate():
    require_engine("nixl")
    posts, poll, message = rebootstrap(http_port=1)
    assert len(posts) == 1 and message is None and poll != KVPoll.Failed
    path, body = posts[0]
    assert path == "/generate"
    assert body["bootstrap_room"] == ROOM and body["rid"] == "retracted"
    assert body["input_ids"] == [1, 2, 3, 7, 8]  # the prompt and the tokens decoded so far
    assert body["sampling_params"]["max_new_tokens"] == 1


def test_a_rebootstrap_is_asked_once_per_request_by_attention_tp_rank_zero():
    require_engine("nixl")
    posts, poll, _ = rebootstrap(http_port=1, attn_tp_rank=1)
    assert posts == [] and poll != KVPoll.Failed


@pytest.mark.parametrize(("http_port", "status", "named"), [
    (1, 503, "rebootstrap: POST http://127.0.0.1:.*/generate answered 503"),
    (None, 200, "registered no HTTP port to ask for the request again"),
])
def test_a_rebootstrap_the_prefill_cannot_take_fails_the_request_with_the_reason(http_port, status, named):
    require_engine("nixl")
    posts, poll, message = rebootstrap(http_port, status=status)
    assert poll == KVPoll.Failed
    assert len(posts) == (1 if http_port else 0)
    assert re.search(named, message), message
