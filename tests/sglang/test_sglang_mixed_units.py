"""A mixed deployment's detection and its ABORT (``plugin/sglang/mixed.py``): which bootstrap
queries come from a decode without dsa-bridge, counted every time and reported once per host;
sglang's ABORT frames, the prefill ranks told, when each room's ABORT is sent again (pure); and
``PrefillAborts`` against a stand-in of sglang's prefill (its bootstrap server's ``GET /route`` over
HTTP, its rank port a ZMQ PULL socket). The deployment itself, with sglang's own classes on one
side: ``tests/sglang/test_sglang_mixed.py``."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, urlsplit

import pytest
import zmq

from dsa_bridge.plugin.sglang.mixed import (
    ABORT_REPEATS_S,
    DECODE_POLICY_MARK,
    POLICIES,
    AbortSchedule,
    ForeignDecodes,
    PrefillAborts,
    abort_frames,
    foreign_route_query,
    marked_policy,
    marked_route_query,
    policy_mark,
    prefill_rank_queries,
)

PARALLEL_INFO = "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"


def query(text: str) -> dict[str, str]:
    return dict(parse_qsl(text))


def test_sglangs_parallel_info_query_is_foreign_and_dsa_bridges_is_not():
    assert foreign_route_query(query(PARALLEL_INFO))  # what sglang's decode asks first
    assert not foreign_route_query(query(PARALLEL_INFO + marked_route_query()))  # dsa-bridge's
    assert foreign_route_query(query(PARALLEL_INFO + "&client=other"))


def test_a_rank_lookup_is_not_the_parallel_info_query():
    rank = "prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
    assert not foreign_route_query(query(rank))
    assert not foreign_route_query({})


def test_foreign_decodes_are_counted_each_time_and_reported_once_per_host():
    seen = ForeignDecodes()
    first = seen.record("10.0.0.7")
    assert "a decode at 10.0.0.7" in first
    assert "SGLANG_PLUGINS=dsa_bridge is not set on that decode server" in first
    assert seen.record("10.0.0.7") is None  # its other ranks, or a retry: counted, not logged
    assert seen.record("10.0.0.8") is not None
    assert seen.count == 3


def test_the_registered_policy_tells_sglangs_decode_what_to_set():
    # sglang's decode prints it as "...policy mismatch: prefill=<mark>, decode=early..."
    assert DECODE_POLICY_MARK.startswith("dsa-bridge")
    assert "set SGLANG_PLUGINS=dsa_bridge on the decode server too" in DECODE_POLICY_MARK
    assert DECODE_POLICY_MARK not in ("early", "prefill_complete")  # never equal to a real policy


@pytest.mark.parametrize("policy", ["early", "prefill_complete"])
def test_each_policy_has_its_own_mark_never_one_of_sglangs(policy):
    mark = policy_mark(policy)
    assert mark.startswith(DECODE_POLICY_MARK) and mark not in POLICIES
    assert marked_policy(mark) == policy
    assert marked_policy("early") is None and marked_policy(None) is None  # sglang's own prefill


def test_abort_frames_are_sglangs_abort_without_a_return_address():
    assert abort_frames(2**62 + 5) == [b"ABORT", str(2**62 + 5).encode()]


def test_every_rank_of_every_dp_group_is_told():
    info = {"dp_size": 2, "attn_cp_size": 1, "attn_tp_size": 2, "pp_size": 1}
    queries = [query(q) for q in prefill_rank_queries(info)]
    assert [(q["prefill_dp_rank"], q["target_tp_rank"]) for q in queries] == [
        ("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]
    assert {(q["prefill_cp_rank"], q["target_pp_rank"]) for q in queries} == {("0", "0")}
    assert len(prefill_rank_queries({"dp_size": 1, "attn_tp_size": 1, "pp_size": 3})) == 3


def test_a_rooms_abort_is_sent_at_once_then_again_and_a_room_is_scheduled_once():
    schedule = AbortSchedule(repeats_s=(0.0, 0.5, 1.5))
    schedule.add("p:1", 7, now=10.0)
    schedule.add("p:1", 7, now=10.2)  # another poll of the same refusal
    assert schedule.due(10.0) == [("p:1", 7)]
    assert schedule.due(10.4) == [] and schedule.next_at() == 10.5
    schedule.add("p:1", 8, now=10.4)
    assert schedule.due(10.5) == [("p:1", 8), ("p:1", 7)] and schedule.next_at() == 10.9
    assert schedule.due(11.5) == [("p:1", 8), ("p:1", 7)] and schedule.next_at() == 11.9
    assert schedule.due(20.0) == [("p:1", 8)] and schedule.next_at() is None  # 7: its last
    schedule.add("p:1", 7, now=30.0)  # done with it: a new refusal of it is scheduled again
    assert schedule.due(30.0) == [("p:1", 7)]
    assert ABORT_REPEATS_S[0] == 0.0 and ABORT_REPEATS_S[-1] < 10.0  # fails fast, retries briefly


class StandInPrefill:
    """A bootstrap server (``GET /route``: the parallel info, then each rank) over rank ports that
    are ZMQ PULL sockets, as sglang's prefill's; ``layout`` its registered ``kv_layout``."""

    def __init__(self, layout: str | None, ranks: int = 2):
        self.context = zmq.Context()
        self.pulls = [self.context.socket(zmq.PULL) for _ in range(ranks)]
        ports = [sock.bind_to_random_port("tcp://127.0.0.1") for sock in self.pulls]
        info = {"attn_tp_size": ranks, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1,
                **({"kv_layout": layout} if layout else {})}
        self.queries: list[dict] = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(handler):  # noqa: N802  (http.server's name)
                asked = dict(parse_qsl(urlsplit(handler.path).query))
                self.queries.append(asked)
                tp = int(asked["target_tp_rank"])
                body = info if tp == -1 else {"rank_ip": "127.0.0.1", "rank_port": ports[tp]}
                handler.send_response(200)
                handler.end_headers()
                handler.wfile.write(json.dumps(body).encode())

            def log_message(handler, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.addr = f"127.0.0.1:{self.http.server_address[1]}"

    def received(self, timeout_ms: int) -> list[list[bytes]]:
        got = []
        for sock in self.pulls:
            while sock.poll(timeout_ms):
                got.append(sock.recv_multipart())
        return got

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        for sock in self.pulls:
            sock.close(0)
        self.context.term()


@pytest.fixture
def aborts():
    made = []

    def make(layout: str | None):
        prefill, sender = StandInPrefill(layout), PrefillAborts()
        made.append((prefill, sender))
        return prefill, sender

    yield make
    for prefill, sender in made:
        sender.close()
        prefill.close()


@pytest.mark.slow
def test_sglangs_prefill_ranks_each_get_the_rooms_abort_again_and_again(aborts):
    prefill, sender = aborts(None)  # sglang's own prefill registers no kv_layout
    sender.notify(prefill.addr, 41, "the prefill registered kv_layout None")
    got = prefill.received(timeout_ms=int((ABORT_REPEATS_S[-1] + 2) * 1000))
    assert got == [abort_frames(41)] * (2 * len(ABORT_REPEATS_S))  # both ranks, every repeat
    assert sender.sent == 2 * len(ABORT_REPEATS_S)
    info_queries = [q for q in prefill.queries if q["target_tp_rank"] == "-1"]
    assert info_queries and all(q.get("client") == "dsa-bridge" for q in info_queries)


def test_a_dsa_bridge_prefill_is_sent_nothing(aborts):
    prefill, sender = aborts("dsa-bridge")  # refused for another reason: its port is dsa-bridge's
    sender.notify(prefill.addr, 42, "page size: prefill 64, decode 32")
    assert prefill.received(timeout_ms=1500) == [] and sender.sent == 0
    assert len(prefill.queries) == 1  # the parallel info only
