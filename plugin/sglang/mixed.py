"""A mixed deployment — dsa-bridge's transfer on one server, sglang's own connector on the other
(``SGLANG_PLUGINS=dsa_bridge`` set on one side only) — failing fast and saying why. The
decisions are pure; ``PrefillAborts`` is the one part with sockets and a thread.

- dsa-bridge decode, sglang prefill: the prefill registers no ``kv_layout`` of dsa-bridge's;
  ``bringup.pairing_problems`` refuses it from its parallel info (decode's requests fail at once).
- sglang decode, dsa-bridge prefill: sglang's decode does not check ``kv_layout`` for a DSA pool
  (its own is None) and would talk its ZMQ protocol (a PUSH socket) to dsa-bridge's control port
  (a ROUTER): ZMQ refuses the pair at its handshake, no frame ever arrives, and sglang's decode
  would wait for its waiting timeout. So a dsa-bridge prefill registers, as its
  ``decode_allocation_policy``, ``DECODE_POLICY_MARK``: sglang's decode receiver compares that
  field with its own policy at ``init`` and fails the request at once with sglang's "decode
  allocation policy mismatch: prefill=<the mark>". The mark names the prefill's own policy
  when it is not the default (``policy_mark``), which dsa-bridge's decode compares with its own
  (``bringup.pairing_problems``). The
  prefill learns of such a decode from its bootstrap server: sglang's decode asks for the
  parallel info without ``ROUTE_MARK``, which dsa-bridge's decode adds (``foreign_route_query``),
  and ``ForeignDecodes`` counts and logs it once per decode host.
- dsa-bridge decode, sglang prefill, the prefill's side: a refused request is told to sglang's
  prefill in sglang's own protocol, the ABORT its decode receivers send a prefill rank's port
  (``abort_frames``: ``[b"ABORT", room]``, no return address, so no ABORT_ACK is asked for). It
  carries no reason: the reason is logged on decode, once per prefill. The room's DP rank is not
  known to a refused decode (sglang's queue never calls ``init``), so every rank of every DP
  group is told (``prefill_rank_queries``); a rank without the room ignores it. The prefill may
  not hold the request yet when decode refuses it (both get it from the router at once) and
  sglang's prefill drops an ABORT for a room it does not hold, so it is sent again
  (``ABORT_REPEATS_S``, ``AbortSchedule``). ``PrefillAborts`` sends it, off the scheduler thread.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Mapping

import requests

log = logging.getLogger(__name__)

KV_LAYOUT_MARK = "dsa-bridge"  # the kv_layout a dsa-bridge prefill registers: decode requires it
CP_PAGE_SPLIT_MARK = KV_LAYOUT_MARK + " cp-page-split"  # ...one whose CP ranks split the pages
DECODE_POLICY_MARK = ("dsa-bridge (this prefill runs dsa-bridge's transfer: set "
                      "SGLANG_PLUGINS=dsa_bridge on the decode server too)")
POLICIES = ("early", "prefill_complete")  # sglang's --disaggregation-decode-allocation-policy
ROUTE_MARK = ("client", "dsa-bridge")  # a query parameter of dsa-bridge's decode's GET /route
PARALLEL_INFO_QUERY = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
ABORT_TAG = b"ABORT"  # sglang's (common/conn.py): the first frame of a decode's abort notification
# after a refusal, when the room's ABORT is sent (again): sglang's prefill ignores one for a room
# it does not hold yet, and the router hands the request to both servers at once
ABORT_REPEATS_S = (0.0, 0.5, 1.5, 3.5)
RANKS_TTL_S = 5.0  # a refused prefill's rank endpoints are looked up again after this (a restart)
HTTP_TIMEOUT_S = 2.0


def layout_mark(cp_page_split: bool) -> str:
    """The ``kv_layout`` a dsa-bridge prefill registers: dsa-bridge's, saying whether its CP ranks
    each write a share of every request's pages (``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER``
    on the prefill), which a dsa-bridge decode then reads from every CP rank."""
    return CP_PAGE_SPLIT_MARK if cp_page_split else KV_LAYOUT_MARK


def bridge_layout(kv_layout: str | None) -> bool:
    """Whether a prefill's registered ``kv_layout`` is a dsa-bridge prefill's."""
    return kv_layout in (KV_LAYOUT_MARK, CP_PAGE_SPLIT_MARK)


def policy_mark(policy: str) -> str:
    """What a dsa-bridge prefill registers as its ``decode_allocation_policy``: never one of
    sglang's policies (sglang's own decode refuses it), naming the prefill's own policy when it
    is not the default."""
    return DECODE_POLICY_MARK if policy == "early" else f"{DECODE_POLICY_MARK} [{policy}]"


def marked_policy(mark: str | None) -> str | None:
    """The policy a dsa-bridge prefill's ``policy_mark`` names; None for another mark."""
    return next((policy for policy in POLICIES if policy_mark(policy) == mark), None)


def marked_route_query() -> str:
    """The parameter dsa-bridge's decode adds to its parallel-info query ("&name=value")."""
    return f"&{ROUTE_MARK[0]}={ROUTE_MARK[1]}"


def foreign_route_query(query: Mapping[str, str]) -> bool:
    """Whether a GET /route is the parallel-info query (every rank -1) of a decode that does not
    run dsa-bridge's transfer (no ``ROUTE_MARK``): sglang's own decode asks it first."""
    if any(query.get(name) != "-1" for name in PARALLEL_INFO_QUERY):
        return False
    return query.get(ROUTE_MARK[0]) != ROUTE_MARK[1]


def foreign_decode_reason(host: str) -> str:
    return (f"a decode at {host} asked this prefill's bootstrap server for its parallel info "
            "without dsa-bridge's mark: it runs sglang's own connector, SGLANG_PLUGINS=dsa_bridge is "
            "not set on that decode server (this prefill runs dsa-bridge's transfer). Its requests "
            "fail at once (sglang's decode refuses this prefill's decode_allocation_policy); this "
            "prefill's requests meant for it end at SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT. Set "
            "SGLANG_PLUGINS=dsa_bridge on the decode server")


class ForeignDecodes:
    """Parallel-info queries from decodes that do not run dsa-bridge: ``count`` of them, and
    ``record(host)`` -> the reason to log the first time a host asks, else None."""

    def __init__(self):
        self.count = 0
        self.hosts: set[str] = set()

    def record(self, host: str) -> str | None:
        self.count += 1
        if host in self.hosts:
            return None
        self.hosts.add(host)
        return foreign_decode_reason(host)


def abort_frames(room: int) -> list[bytes]:
    """sglang's ABORT of ``room``, as its decode receivers send it to a prefill rank's port
    (``AbortNotification``) without a return address: the prefill fails the room and sends no
    ABORT_ACK. It has no field for a reason."""
    return [ABORT_TAG, str(int(room)).encode("ascii")]


def prefill_rank_queries(info: Mapping) -> list[str]:
    """The ``GET /route`` query of every rank of a prefill whose parallel info is ``info``: each
    DP group, CP rank, TP rank and pipeline stage."""
    return [f"prefill_dp_rank={dp}&prefill_cp_rank={cp}&target_tp_rank={tp}&target_pp_rank={pp}"
            for dp in range(int(info["dp_size"])) for cp in range(int(info.get("attn_cp_size", 1)))
            for tp in range(int(info["attn_tp_size"])) for pp in range(int(info.get("pp_size", 1)))]


def told_prefill_reason(bootstrap_addr: str, ranks: int, reason: str) -> str:
    return (f"told sglang's own prefill at {bootstrap_addr} ({ranks} rank(s)) to fail the requests "
            f"this decode refuses, with sglang's ABORT, which carries no reason; the reason: "
            f"{reason}")


class AbortSchedule:
    """When to send each refused room's ABORT (``ABORT_REPEATS_S`` after its refusal), pure:
    ``add(addr, room, now)`` (a room already scheduled is not added again), ``due(now)`` -> the
    ``(addr, room)`` to send now, ``next_at()`` -> the next time one is due (None: none left)."""

    def __init__(self, repeats_s: tuple[float, ...] = ABORT_REPEATS_S):
        self.repeats_s = repeats_s
        self._heap: list[tuple[float, int, str, int]] = []  # (at, repeat index, addr, room)
        self._scheduled: set[tuple[str, int]] = set()

    def add(self, bootstrap_addr: str, room: int, now: float) -> None:
        if (bootstrap_addr, room) in self._scheduled:
            return
        self._scheduled.add((bootstrap_addr, room))
        heapq.heappush(self._heap, (now + self.repeats_s[0], 0, bootstrap_addr, room))

    def due(self, now: float) -> list[tuple[str, int]]:
        out = []
        while self._heap and self._heap[0][0] <= now:
            at, index, addr, room = heapq.heappop(self._heap)
            out.append((addr, room))
            if index + 1 < len(self.repeats_s):
                later = at - self.repeats_s[index] + self.repeats_s[index + 1]
                heapq.heappush(self._heap, (later, index + 1, addr, room))
            else:
                self._scheduled.discard((addr, room))
        return out

    def next_at(self) -> float | None:
        return self._heap[0][0] if self._heap else None


class PrefillAborts:
    """Sends sglang's ABORT of the rooms a dsa-bridge decode refused to the ranks of sglang's own
    prefill (``notify``), from a thread of its own (the bootstrap lookups and the sends never
    hold sglang's scheduler thread). A prefill that registered dsa-bridge's ``kv_layout`` is not
    sglang's (it was refused for another reason, and its port speaks dsa-bridge's protocol):
    nothing is sent to it. ``sent``: ABORT messages sent."""

    def __init__(self, clock=time.monotonic):
        import zmq

        self._zmq = zmq
        self._context = zmq.Context()
        self.clock = clock
        self.sent = 0
        self._schedule = AbortSchedule()
        self._reasons: dict[str, str] = {}  # bootstrap address -> its latest refusal
        self._ranks: dict[str, tuple[float, list[str]]] = {}  # address -> (looked up at, endpoints)
        self._logged: set[str] = set()
        self._sockets: dict[str, object] = {}
        self._closed = False
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True, name="dsa-bridge-aborts")
        self._thread.start()

    def notify(self, bootstrap_addr: str, room: int, reason: str) -> None:
        """``room``, meant for the prefill at ``bootstrap_addr``, was refused for ``reason``."""
        with self._wake:
            self._reasons[bootstrap_addr] = reason
            self._schedule.add(bootstrap_addr, int(room), self.clock())
            self._wake.notify()

    def close(self) -> None:
        """Stop the thread, then close the sockets (an ABORT not yet sent is dropped)."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()
        for sock in self._sockets.values():
            sock.close()
        self._context.term()

    def _run(self) -> None:
        while True:
            with self._wake:
                next_at = self._schedule.next_at()
                if not self._closed:
                    self._wake.wait(None if next_at is None else max(0.0, next_at - self.clock()))
                if self._closed:
                    return
                due = self._schedule.due(self.clock())
                reasons = dict(self._reasons)
            for addr, room in due:
                try:
                    self._send(addr, room, reasons[addr])
                except (requests.RequestException, ValueError, KeyError, TypeError,
                        self._zmq.ZMQError) as exc:
                    log.warning("dsa-bridge: telling the prefill at %s to fail room %s failed: %s",
                                addr, room, exc)

    def _send(self, bootstrap_addr: str, room: int, reason: str) -> None:
        endpoints = self._endpoints(bootstrap_addr)
        if bootstrap_addr not in self._logged and endpoints:
            self._logged.add(bootstrap_addr)
            log.warning("dsa-bridge: %s",
                        told_prefill_reason(bootstrap_addr, len(endpoints), reason))
        for endpoint in endpoints:
            try:
                self._socket(endpoint).send_multipart(abort_frames(room), flags=self._zmq.NOBLOCK)
                self.sent += 1
            except self._zmq.Again:
                log.debug("dsa-bridge: the ABORT of room %s to %s was not queued", room, endpoint)
        log.debug("dsa-bridge: sent the ABORT of room %s to %s", room, ", ".join(endpoints))

    def _endpoints(self, bootstrap_addr: str) -> list[str]:
        """The rank endpoints of sglang's prefill at ``bootstrap_addr`` (``GET /route``), looked
        up again after ``RANKS_TTL_S``; none for a prefill of dsa-bridge's."""
        known = self._ranks.get(bootstrap_addr)
        if known is not None and self.clock() < known[0] + RANKS_TTL_S:
            return known[1]
        base = f"http://{bootstrap_addr}/route?"
        info = requests.get(base + "prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1"
                            "&target_pp_rank=-1" + marked_route_query(), timeout=HTTP_TIMEOUT_S)
        info.raise_for_status()
        endpoints = []
        if not bridge_layout(info.json().get("kv_layout")):
            for query in prefill_rank_queries(info.json()):
                rank = requests.get(base + query, timeout=HTTP_TIMEOUT_S)
                rank.raise_for_status()
                host, port = str(rank.json()["rank_ip"]), int(rank.json()["rank_port"])
                endpoints.append(f"tcp://[{host}]:{port}" if ":" in host
                                 else f"tcp://{host}:{port}")
        for gone in set(known[1] if known else ()) - set(endpoints):  # a restarted prefill's
            sock = self._sockets.pop(gone, None)
            if sock is not None:
                sock.close()
        self._ranks[bootstrap_addr] = (self.clock(), endpoints)
        return endpoints

    def _socket(self, endpoint: str):
        sock = self._sockets.get(endpoint)
        if sock is None:
            sock = self._context.socket(self._zmq.PUSH)  # as sglang's decode: its rank port PULLs
            sock.setsockopt(self._zmq.LINGER, 0)
            if endpoint.startswith("tcp://["):
                sock.setsockopt(self._zmq.IPV6, 1)
            sock.connect(endpoint)
            self._sockets[endpoint] = sock
        return sock
