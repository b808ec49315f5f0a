"""A mixed deployment — dsa-bridge's transfer on one server, sglang's own connector on the other
(``SGLANG_PLUGINS=dsa_bridge`` set on one side only) — failing fast and saying why, pure.

- dsa-bridge decode, sglang prefill: the prefill registers no ``kv_layout`` of dsa-bridge's;
  ``bringup.pairing_problems`` refuses it from its parallel info (decode's requests fail at once).
- sglang decode, dsa-bridge prefill: sglang's decode does not check ``kv_layout`` for a DSA pool
  (its own is None) and would talk its ZMQ protocol (a PUSH socket) to dsa-bridge's control port
  (a ROUTER): ZMQ refuses the pair at its handshake, no frame ever arrives, and sglang's decode
  would wait for its waiting timeout. So a dsa-bridge prefill registers, as its
  ``decode_allocation_policy``, ``DECODE_POLICY_MARK``: sglang's decode receiver compares that
  field with its own policy at ``init`` and fails the request at once with sglang's "decode
  allocation policy mismatch: prefill=<the mark>" (dsa-bridge's decode does not read it). The
  prefill learns of such a decode from its bootstrap server: sglang's decode asks for the
  parallel info without ``ROUTE_MARK``, which dsa-bridge's decode adds (``foreign_route_query``),
  and ``ForeignDecodes`` counts and logs it once per decode host.
"""

from __future__ import annotations

from collections.abc import Mapping

DECODE_POLICY_MARK = ("dsa-bridge (this prefill runs dsa-bridge's transfer: set "
                      "SGLANG_PLUGINS=dsa_bridge on the decode server too)")
ROUTE_MARK = ("client", "dsa-bridge")  # a query parameter of dsa-bridge's decode's GET /route
PARALLEL_INFO_QUERY = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")


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
