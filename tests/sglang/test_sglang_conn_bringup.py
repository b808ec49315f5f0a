"""dsa-bridge's sglang connector at bring-up, against the real sglang 0.5.23 on the CPU: no shape
sglang's scheduler meets crashes it — a prefill it cannot pair with is refused by name, a peer
that failed to connect is retried with backoff, and ranks register an address their peers reach.

- a decode rank driven by sglang's own ``DecodePreallocQueue`` code (``prealloc_rank.py``):
  requests to a prefill of another page size abort with the reason naming the flag,
  ``try_ensure_parallel_info`` answers False (never raises), the refusal is logged once, and the
  same queue and manager then move a good prefill's request byte-exact;
- a failed connection to a prefill is not retried per request: one ``DecodeNode`` construction,
  then one per backoff step (1 s doubling to 30 s), requests failing at once meanwhile;
- a prefill rank registers ``SGLANG_HOST_IP`` (sglang's ``get_local_ip_auto``) as its address and
  listens there, with ``--host 0.0.0.0``; with ``--dist-init-addr`` it registers at that host.
(``poll_pp_consensus`` as sglang's prefill calls it: ``test_sglang_conn.py``, the pipelined
prefill.)
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading

import pytest
import requests

from tests.conftest import require_engine
from tests.transfer.helpers import wait_for

from .conftest import SGLANG_MISSING, published_context
from .test_sglang_conn import DSV32, config, free_port, put_route, registration, run_ranks

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

from sglang.srt.disaggregation.base import KVArgs  # noqa: E402
from sglang.srt.disaggregation.common.conn import PrefillServerInfo  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode, setup_state_kv_args  # noqa: E402
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool as SGLangPool  # noqa: E402
from sglang.srt.utils.network import get_local_ip_auto  # noqa: E402

from dsa_bridge.plugin.sglang import bringup, conn, decode_nodes  # noqa: E402
from dsa_bridge.plugin.sglang.mixed import policy_mark  # noqa: E402
from dsa_bridge.plugin.sglang.pool import BridgeDSATokenToKVPool  # noqa: E402
from dsa_bridge.transfer.backends import create_backend  # noqa: E402
from dsa_bridge.transfer.prefill import PrefillNode  # noqa: E402

MODEL = {"layers": 4, "model_layers": 4, "kv_cache_dim": 656}


def kv_args(pool) -> KVArgs:
    """A DSA pool's KVArgs as sglang fills them, without aux buffers (none to register here)."""
    args = KVArgs()
    args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens = pool.get_contiguous_buf_infos()
    args.kv_layer_ids, args.num_draft_entries, args.page_size = [], 0, pool.page_size
    args.prefill_start_layer = pool.start_layer
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = [], [], []
    args.kv_cache_dtype_str = "fp8_e4m3"
    setup_state_kv_args(args, pool)
    return args


# ---- a refused prefill, through sglang's own prealloc queue -------------------------------------

def test_refused_prefill_aborts_its_requests_and_the_same_queue_serves_a_good_prefill():
    require_engine("nixl")
    cfg = {**config("nixl", MODEL), "refused_port": free_port(), "dist_port": free_port()}
    (prefill,), decode = run_ranks([("prefill", [cfg]), ("prealloc", cfg)])
    assert decode["manager"] == "DSABridgeKVManager"
    # every request to the refused prefill aborted (sglang's prepare_abort, 500), naming the flag
    assert len(decode["refused"]) == 4 and set(decode["refused_status"]) == {500}
    for message in decode["refused"]:
        assert "Decode handshake failed" in message  # sglang's _update_handshake_waiters
        assert "page size: prefill 32, decode 64" in message and "--page-size" in message
    assert decode["ensure_refused"] is False  # answered, never raised
    assert decode["ensure_attempts"] == 2  # asked again after sglang's 1 s retry interval
    assert len(decode["refusals_logged"]) == 1  # once for the prefill, not per request
    # then the good prefill's request, through the same queue and manager, byte-exact
    assert decode["poll"] == prefill["poll"] == 4
    assert decode["mismatched"] == [] and decode["others_sentinel"]
    assert decode["aux_exact"] and decode["aux_others_sentinel"]
    assert decode["nbytes"] == prefill["bytes"]


# ---- backoff: a failed peer is not re-handshaken per request ----------------------------------------

def test_peer_backoff_doubles_from_one_second_to_thirty():
    failure, delays = None, []
    for _ in range(8):
        failure = bringup.PeerBackoff.after(failure, "refused", now=100.0)
        delays.append(failure.retry_at - 100.0)
    assert delays == [1, 2, 4, 8, 16, 30, 30, 30]
    assert failure.failures == 8 and failure.reason == "refused"


def test_a_failed_connection_is_retried_with_backoff_not_per_request(monkeypatch, caplog):
    """A prefill whose handshake is refused (it holds layers 2..5, decode 0..3): the real
    ``DecodeNode`` is constructed once (off the scheduler thread), then once per backoff step;
    requests in between fail at once with the last reason."""
    require_engine("nixl")
    made = []

    class CountingDecodeNode(decode_nodes.DecodeNode):
        def __init__(self, *args, **kwargs):
            made.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(decode_nodes, "DecodeNode", CountingDecodeNode)
    port = free_port()
    server = conn.DSABridgeKVBootstrapServer("127.0.0.1", port)
    with published_context(disaggregation_mode="decode", disaggregation_transfer_backend="nixl") as sa:
        prefill = PrefillNode(BridgeDSATokenToKVPool(**DSV32, start_layer=2), create_backend("nixl"))
        try:
            host, rank_port = prefill.endpoint.rsplit(":", 1)
            put_route(port, registration(rank_ip=host, rank_port=int(rank_port)))
            manager = conn.DSABridgeKVManager(kv_args(BridgeDSATokenToKVPool(**DSV32)),
                                              DisaggregationMode.DECODE, sa, True)
            now = [1000.0]
            manager.decode_nodes.clock = lambda: now[0]
            addr, room = f"127.0.0.1:{port}", iter(range(1, 100))

            def request() -> str:
                receiver = conn.DSABridgeKVReceiver(manager, addr, next(room))
                receiver.init(0)  # a connection attempt runs on the connector thread...
                wait_for(lambda: receiver.poll() != 1, 30, "the attempt's end")  # ...Bootstrapping
                assert receiver.poll() == 0  # Failed: by that attempt, or at once in its backoff
                with pytest.raises(RuntimeError) as failed:
                    receiver.failure_exception()
                return str(failed.value)

            with caplog.at_level(logging.WARNING, logger="dsa_bridge.plugin.sglang"):
                reasons = [request() for _ in range(4)]
                assert len(made) == 1  # one handshake for four requests
                assert all("layer sets" in r for r in reasons)
                assert "next attempt in 1.0s" in reasons[1]
                steps = []
                for t in (1000.9, 1001.0, 1002.9, 1003.0, 1006.9, 1007.0):
                    now[0] = t
                    request()
                    steps.append(len(made))
            assert steps == [1, 2, 2, 3, 3, 4]  # retried after 1 s, then 2 s, then 4 s
            logged = [r for r in caplog.records if "connecting to prefill" in r.getMessage()]
            assert len(logged) == 4  # once per attempt, not per request
            assert manager.decode_nodes.nodes == {}
            manager.shutdown()
        finally:
            prefill.close()
            server.close()


def test_a_handshake_runs_off_the_scheduler_thread(monkeypatch):
    """A prefill rank that takes the connection but never answers the handshake: ``init`` returns
    at once and the request stays Bootstrapping while sglang's queue goes on; a second request to
    that prefill waits on the same attempt; the attempt, on the manager's connector thread, ends
    both Failed with the handshake's reason."""
    import zmq

    require_engine("nixl")
    made = []

    class RecordingDecodeNode(decode_nodes.DecodeNode):
        def __init__(self, *args, **kwargs):
            made.append(threading.current_thread().name)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(decode_nodes, "DecodeNode", RecordingDecodeNode)
    port, context = free_port(), zmq.Context()
    silent = context.socket(zmq.ROUTER)  # a prefill rank frozen before its first answer
    silent.setsockopt(zmq.LINGER, 0)
    silent_port = silent.bind_to_random_port("tcp://127.0.0.1")
    server = conn.DSABridgeKVBootstrapServer("127.0.0.1", port)
    try:
        put_route(port, registration(rank_ip="127.0.0.1", rank_port=silent_port))
        with published_context(disaggregation_mode="decode", disaggregation_transfer_backend="nixl") as sa:
            manager = conn.DSABridgeKVManager(kv_args(BridgeDSATokenToKVPool(**DSV32)),
                                              DisaggregationMode.DECODE, sa, True)
            addr = f"127.0.0.1:{port}"
            first, second = (conn.DSABridgeKVReceiver(manager, addr, room) for room in (1, 2))
            first.init(0)
            second.init(0)
            assert first.poll() == second.poll() == 1  # Bootstrapping: the queue goes on
            wait_for(lambda: made, 10, "the attempt")
            assert len(made) == 1 and made[0] != threading.current_thread().name
            wait_for(lambda: first.poll() == second.poll() == 0, 30, "the attempt's end")
            for receiver in (first, second):
                with pytest.raises(RuntimeError, match=f"prefill 127.0.0.1:{silent_port} did not answer"):
                    receiver.failure_exception()
            assert len(made) == 1 and manager.decode_nodes.nodes == {}
            manager.shutdown()
    finally:
        server.close()
        context.destroy(0)


# ---- the registration address ----------------------------------------------------------------------

def routable_ip() -> str:
    ip = get_local_ip_auto()
    if ip.startswith("127.") or ip == "::1":
        pytest.skip(f"this host has no address but loopback ({ip})")
    return ip


def registered_rank(port: int) -> dict:
    url = (f"http://127.0.0.1:{port}/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0"
           "&target_pp_rank=0")
    response = requests.get(url, timeout=5)
    assert response.status_code == 200, response.text
    return response.json()


@contextlib.contextmanager
def bootstrap_server(host: str = "127.0.0.1"):
    """sglang's bootstrap server (dsa-bridge's: the same routes) on a free port; yields the port."""
    port = free_port()
    server = conn.DSABridgeKVBootstrapServer(host, port)
    try:
        yield port
    finally:
        server.close()


def prefill_manager(server_args):
    args = kv_args(BridgeDSATokenToKVPool(**DSV32))
    return conn.DSABridgeKVManager(args, DisaggregationMode.PREFILL, server_args, True)


def test_prefill_rank_registers_sglang_host_ip_and_listens_there_with_host_0000(monkeypatch):
    require_engine("nixl")
    ip = routable_ip()
    monkeypatch.setenv("SGLANG_HOST_IP", ip)
    monkeypatch.delenv("DSA_BRIDGE_SECRET", raising=False)
    with (bootstrap_server("0.0.0.0") as port,
          published_context(disaggregation_mode="prefill", disaggregation_transfer_backend="nixl",
                            disaggregation_bootstrap_port=port, host="0.0.0.0") as sa):
        with pytest.raises(RuntimeError, match=f"listens on {ip} .*set DSA_BRIDGE_SECRET to the same"):
            prefill_manager(sa)  # a routable listener needs the shared secret
        monkeypatch.setenv("DSA_BRIDGE_SECRET", "s3cret")
        manager = prefill_manager(sa)
        try:
            rank = registered_rank(port)  # registered at 127.0.0.1: one node, sglang's choice
            assert rank["rank_ip"] == ip and f"{ip}:{rank['rank_port']}" == manager.node.endpoint
            socket.create_connection((ip, rank["rank_port"]), timeout=5).close()  # reachable there
        finally:
            manager.shutdown()


def test_bootstrap_host_is_sglangs_choice():
    assert bringup.bootstrap_host("0.0.0.0", None) == "127.0.0.1"
    assert bringup.bootstrap_host("::", None) == "::1"
    assert bringup.bootstrap_host("10.0.0.7", None) == "10.0.0.7"
    assert bringup.bootstrap_host("0.0.0.0", "10.1.2.3:5000") == "10.1.2.3"  # multi-node: rank 0's host
    assert bringup.bootstrap_host("0.0.0.0", "[fd00::5]:5000") == "fd00::5"


def test_multi_node_prefill_rank_registers_at_the_dist_init_addr_host(monkeypatch):
    """The bootstrap server listens on this host's routable address only (as on a node other than
    the rank's): the rank reaches it through ``--dist-init-addr``'s host, not 127.0.0.1."""
    require_engine("nixl")
    ip = routable_ip()
    monkeypatch.setenv("SGLANG_HOST_IP", ip)
    monkeypatch.setenv("DSA_BRIDGE_SECRET", "s3cret")
    port = free_port()
    server = conn.DSABridgeKVBootstrapServer(ip, port)
    try:
        with published_context(disaggregation_mode="prefill", disaggregation_transfer_backend="nixl",
                               disaggregation_bootstrap_port=port, host="0.0.0.0",
                               dist_init_addr=f"{ip}:{free_port()}") as sa:
            manager = prefill_manager(sa)
            try:
                with pytest.raises(OSError):  # the premise: not reachable at 127.0.0.1
                    socket.create_connection(("127.0.0.1", port), timeout=2).close()
                response = requests.get(f"http://{ip}:{port}/route?prefill_dp_rank=0&prefill_cp_rank=0"
                                        "&target_tp_rank=0&target_pp_rank=0", timeout=5)
                assert response.status_code == 200, response.text
                assert response.json()["rank_ip"] == ip
            finally:
                manager.shutdown()
    finally:
        server.close()


# ---- a request's prefill DP rank, found as sglang finds it --------------------------------------

@pytest.mark.parametrize(("room", "dp_rank", "ranks", "method", "force", "given", "expected"), [
    (7, 0, 1, "round_robin", False, False, (False, "")),  # one DP rank: nothing to find
    (7, 1, 2, "follow_bootstrap_room", False, False, (False, "")),  # decode computes 7 % 2
    (7, 1, 2, "round_robin", False, True, (False, "")),  # the request carries its rank
    (7, 1, 2, "round_robin", False, False, (True, "")),  # decode must ask: registered
    (7, 1, 2, "follow_bootstrap_room", True, False, (True, "")),  # asked anyway: registered
    (8, 1, 2, "follow_bootstrap_room", False, False, (False, "conflict")),
])
def test_dp_route_is_sglangs_choice(room, dp_rank, ranks, method, force, given, expected):
    route = bringup.dp_route(room, dp_rank, ranks, load_balance_method=method, force_query=force,
                             given_dp_rank=given)
    assert (route.register, "conflict" if route.conflict else "") == expected
    if route.conflict:
        assert "dispatched to dp_rank 1 but bootstrap_room 8 implies dp_rank 0" in route.conflict
        assert "SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK=1" in route.conflict


def test_prefill_registers_its_dp_rank_where_decode_must_ask_and_fails_a_conflict(monkeypatch):
    """Two DP ranks and round-robin dispatch: each sender registers its room's DP rank with the
    bootstrap server, and sglang's own decode query (``query_prefill_dp_ranks``) finds it. Under
    ``follow_bootstrap_room``, a request on another rank than its room implies fails at once with
    sglang's conflict message."""
    require_engine("nixl")
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    monkeypatch.setenv("SGLANG_HOST_IP", "127.0.0.1")

    for method in ("round_robin", "follow_bootstrap_room"):
        with (bootstrap_server() as port,
              published_context(disaggregation_mode="prefill", disaggregation_transfer_backend="nixl",
                                disaggregation_bootstrap_port=port, host="127.0.0.1", dp_size=2,
                                load_balance_method=method) as sa):
            addr = f"127.0.0.1:{port}"
            manager = prefill_manager(sa)
            try:
                manager.attn_dp_rank = 1  # this rank serves DP group 1
                senders = [conn.DSABridgeKVSender(manager, addr, room) for room in (40, 41)]
                if method == "round_robin":
                    assert CommonKVReceiver.query_prefill_dp_ranks(addr, [40, 41, 42]) == {
                        "40": 1, "41": 1}  # 42 was never dispatched
                    assert [s.poll() for s in senders] == [1, 1]  # Bootstrapping
                else:
                    assert [s.poll() for s in senders] == [0, 1]  # 40 % 2 == 0: not ours
                    with pytest.raises(RuntimeError, match="follow_bootstrap_room conflict: "
                                       "dispatched to dp_rank 1 but bootstrap_room 40"):
                        senders[0].failure_exception()
            finally:
                manager.shutdown()


# ---- sglang's prefill_complete policy: served, and paired only with the same policy -----------------

@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_prefill_complete_is_served_from_start_up(mode, monkeypatch):
    """``--disaggregation-decode-allocation-policy prefill_complete`` (sglang's own check allows
    it with Mooncake, attention TP 1): the manager starts, deferring decode's allocation; a
    prefill registers its policy, marked, for decode to compare."""
    require_engine("mooncake")
    monkeypatch.setenv("SGLANG_HOST_IP", "127.0.0.1")
    with (bootstrap_server() as port,
          published_context(disaggregation_mode=mode, disaggregation_transfer_backend="mooncake",
                            disaggregation_bootstrap_port=port, host="127.0.0.1",
                            disaggregation_decode_allocation_policy="prefill_complete") as sa):
        manager = conn.DSABridgeKVManager(kv_args(BridgeDSATokenToKVPool(**DSV32)),
                                          DisaggregationMode(mode), sa, True)
        try:
            assert manager.defer_allocation
            if mode == "prefill":
                info = requests.get(f"http://127.0.0.1:{port}/route?prefill_dp_rank=-1&prefill_cp_rank=-1"
                                    "&target_tp_rank=-1&target_pp_rank=-1", timeout=5).json()
                assert info["decode_allocation_policy"] == policy_mark("prefill_complete")
        finally:
            manager.shutdown()


@pytest.mark.parametrize(("prefill", "decode"), [("early", "prefill_complete"),
                                                 ("prefill_complete", "early")])
def test_decode_refuses_a_prefill_of_another_allocation_policy_naming_the_flag(prefill, decode):
    info = PrefillServerInfo(attn_tp_size=1, attn_cp_size=1, dp_size=1, pp_size=1, page_size=64,
                             kv_cache_dtype="fp8_e4m3", follow_bootstrap_room=True, kv_layout="dsa-bridge",
                             decode_allocation_policy=policy_mark(prefill))
    problems = bringup.pairing_problems(info, page_size=64, kv_cache_dtype="fp8_e4m3", attn_tp_size=1,
                                        policy=decode)
    assert problems == [f"decode allocation policy: prefill {prefill}, decode {decode} (set "
                        "--disaggregation-decode-allocation-policy identically on both servers)"]
    info.decode_allocation_policy = policy_mark(decode)
    assert bringup.pairing_problems(info, page_size=64, kv_cache_dtype="fp8_e4m3", attn_tp_size=1,
                                    policy=decode) == []
    info.decode_allocation_policy = "early"  # no mark (sglang's default): a prefill of the default
    assert bool(bringup.pairing_problems(info, page_size=64, kv_cache_dtype="fp8_e4m3", attn_tp_size=1,
                                         policy=decode)) == (decode != "early")


# ---- decode pipeline stages: the stage's layers from its pool ---------------------------------------

def test_a_decode_stage_takes_its_layers_from_dsa_bridges_pool():
    """A decode stage's KVArgs do not say its layers; dsa-bridge's pool records its
    ``start_layer``, so stage 1 of a 2 x 4-layer decode holds global layers 4-7."""
    require_engine("nixl")
    with published_context(disaggregation_mode="decode", disaggregation_transfer_backend="nixl",
                           pp_size=2) as sa:
        args = kv_args(BridgeDSATokenToKVPool(**{**DSV32, "start_layer": 4}))
        args.pp_rank = 1
        manager = conn.DSABridgeKVManager(args, DisaggregationMode.DECODE, sa, True)
        try:
            assert manager.bridge.kv_layer_ids == [4, 5, 6, 7]
            assert manager.bridge.layout.layer_ids == (4, 5, 6, 7)
        finally:
            manager.shutdown()


def test_a_decode_stage_over_another_pool_is_refused_at_start_up_by_name():
    """sglang's own pool (the plugin's pool hook not in force) does not record its first layer:
    refused, naming what to change, rather than guessed."""
    with published_context(disaggregation_mode="decode", disaggregation_transfer_backend="nixl",
                           pp_size=2) as sa:
        args = kv_args(SGLangPool(**{**DSV32, "start_layer": 4}))
        with pytest.raises(ValueError, match="a decode with pipeline stages needs dsa-bridge's DSA "
                                             "pool .*SGLANG_PLUGINS=dsa_bridge, or give decode --pp-size 1"):
            conn.DSABridgeKVManager(args, DisaggregationMode.DECODE, sa, True)


@pytest.mark.parametrize(("decode_rank", "decode_size", "prefill_size", "stages"), [
    (0, 1, 1, (0,)),
    (0, 1, 3, (0, 1, 2)),  # a one-stage decode reads every stage
    (0, 2, 2, (0,)),
    (1, 2, 2, (1,)),  # a decode with the prefill's stages reads its own
])
def test_target_stages_are_sglangs(decode_rank, decode_size, prefill_size, stages):
    assert bringup.target_stages(decode_rank, decode_size, prefill_size) == stages


@pytest.mark.parametrize(("prefill_pp", "decode_pp", "problem"), [
    (2, 1, None), (2, 2, None), (1, 1, None),
    (1, 2, "pipeline stages: prefill 1, decode 2 (a decode with pipeline stages needs the prefill's "
           "--pp-size; or give decode --pp-size 1)"),
    (4, 2, "pipeline stages: prefill 4, decode 2"),
])
def test_decode_stages_pair_only_with_as_many_prefill_stages(prefill_pp, decode_pp, problem):
    info = PrefillServerInfo(attn_tp_size=1, attn_cp_size=1, dp_size=1, pp_size=prefill_pp, page_size=64,
                             kv_cache_dtype="fp8_e4m3", follow_bootstrap_room=True, kv_layout="dsa-bridge")
    problems = bringup.pairing_problems(info, page_size=64, kv_cache_dtype="fp8_e4m3",
                                        attn_tp_size=1, pp_size=decode_pp)
    assert (problems == []) if problem is None else (len(problems) == 1 and problem in problems[0])


# ---- the transport: RDMA where there is a device, as sglang's own engine ----------------------------

def test_an_unserved_mooncake_protocol_is_refused_at_start_up(monkeypatch):
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "efa")
    with published_context(disaggregation_mode="decode", disaggregation_transfer_backend="mooncake") as sa:
        with pytest.raises(ValueError, match="MOONCAKE_PROTOCOL='efa': dsa-bridge's Mooncake transfer "
                                             "serves 'rdma' and 'tcp'"):
            conn.DSABridgeKVManager(kv_args(BridgeDSATokenToKVPool(**DSV32)), DisaggregationMode.DECODE,
                                    sa, True)


def test_the_transport_is_said_once_per_rank(monkeypatch, caplog):
    """On this machine (no RDMA device) Mooncake runs over TCP, and the rank says so once."""
    require_engine("mooncake")
    monkeypatch.setenv("SGLANG_HOST_IP", "127.0.0.1")
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    with (bootstrap_server() as port,
          published_context(disaggregation_mode="prefill", disaggregation_transfer_backend="mooncake",
                            disaggregation_bootstrap_port=port, host="127.0.0.1") as sa):
        with caplog.at_level(logging.INFO, logger="dsa_bridge.plugin.sglang"):
            manager = prefill_manager(sa)
            manager.log_transport(manager.node.backend)  # asked again: said once
        try:
            said = [r.getMessage() for r in caplog.records if "moves its cache" in r.getMessage()]
            assert len(said) == 1 and "with mooncake over tcp" in said[0]
            assert manager.engine_options == {"protocol": "tcp", "device_name": ""}
        finally:
            manager.shutdown()


def test_a_bootstrap_port_in_mooncakes_listener_range_is_warned_about(monkeypatch, caplog):
    """A Mooncake engine of any process on the host may take a port of its listener range while
    the prefill server restarts: a prefill rank whose bootstrap port lies there says so (here the
    range is set around the test's own port; NIXL, so that no Mooncake engine of this rank
    binds in it)."""
    require_engine("nixl")
    monkeypatch.setenv("SGLANG_HOST_IP", "127.0.0.1")
    with (bootstrap_server() as port,
          published_context(disaggregation_mode="prefill", disaggregation_transfer_backend="nixl",
                            disaggregation_bootstrap_port=port, host="127.0.0.1") as sa):
        monkeypatch.setenv("MC_MIN_RPC_PORT", str(port - 1))
        monkeypatch.setenv("MC_MAX_RPC_PORT", str(port + 1))
        with caplog.at_level(logging.WARNING, logger="dsa_bridge.plugin.sglang"):
            manager = prefill_manager(sa)
        try:
            said = [r.getMessage() for r in caplog.records if "listener range" in r.getMessage()]
            assert said == [f"dsa-bridge: sglang's --disaggregation-bootstrap-port: port {port} lies "
                            f"in Mooncake's listener range {port - 1}-{port + 1} (MC_MIN_RPC_PORT-"
                            "MC_MAX_RPC_PORT), where a Mooncake engine on this host may take it "
                            "while its owner restarts; choose a port outside it"]
        finally:
            manager.shutdown()


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_sglangs_own_connectors_serve_no_host_destination(backend):
    """docs/sglang.md's claim that host KV destinations are refused by sglang itself: neither of
    its own managers says ``supports_host_destination`` and neither receiver overrides the base's
    False, so sglang's decode refuses ``--disaggregation-decode-host-receive-threshold`` below 1
    at start-up whatever the backend (as it does for dsa-bridge's manager)."""
    from sglang.srt.disaggregation.base.conn import BaseKVReceiver

    from dsa_bridge.plugin.sglang.bringup import sglang_class
    from dsa_bridge.plugin.sglang.manager import DSABridgeKVManager

    assert sglang_class(backend, "KVManager").supports_host_destination is False
    receiver = sglang_class(backend, "KVReceiver")
    assert receiver.supports_host_destination is BaseKVReceiver.supports_host_destination
    assert DSABridgeKVManager.supports_host_destination is False
