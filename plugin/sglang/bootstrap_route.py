"""A prefill rank's row in sglang's bootstrap server (``manager.py``).

``route_row``: the row sglang's own managers put for a prefill rank (its widths and ranks, its
control endpoint as ``rank_ip``/``rank_port``, page size and dtype, ``kv_layout`` marking it
dsa-bridge's, its allocation policy, its CP and sharding modes). ``BootstrapRoute``, one per
prefill rank, puts it (``register``) at the host and port sglang's own managers register to
(``bootstrap_host``; the bootstrap port broadcast from the first node over several nodes). With
sglang's Rust server and DP attention every rank's row is gathered over the world group and each
rank that owns a Rust listener puts them all into its own registry. Only the first registration,
where every rank registers at once, is collective; a rank that registers again alone (its resumed
cache on a new port) puts its own row where it put it first. ``register_dp_rank`` tells the
bootstrap server which DP rank serves a room (``post_dp_rank``), as sglang's own senders do.
"""

from __future__ import annotations

import logging
import time

import requests
from sglang.srt.environ import envs
from sglang.srt.runtime_context import get_disagg, get_parallel, get_serving
from sglang.srt.utils.network import NetworkAddress

from .bringup import bootstrap_host
from .decode_nodes import HTTP_TIMEOUT_S
from .mixed import layout_mark, policy_mark
from .rank_config import RankConfig

log = logging.getLogger(__name__)

REGISTER_WAIT_S = 30.0  # for the bootstrap server to take a prefill rank's row (listen, answer)
REGISTER_BACKOFF_S, REGISTER_BACKOFF_MAX_S = 0.1, 2.0  # between two attempts: doubled up to the max


def route_row(rank: RankConfig, endpoint: str, *, page_size: int, kv_cache_dtype: str | None,
              split_pages: bool, allocation_policy: str) -> dict:
    """The rank's row, sglang's payload (module docstring); ``split_pages``: each CP rank writes
    a contiguous share of the pages (``mixed.layout_mark``)."""
    host, port = endpoint.rsplit(":", 1)
    parallel = get_parallel()
    return {
        "attn_tp_size": rank.attn_tp_size, "attn_tp_rank": rank.attn_tp_rank,
        "attn_cp_size": rank.attn_cp_size, "attn_cp_rank": rank.attn_cp_rank,
        "attn_dp_size": rank.attn_dp_size, "attn_dp_rank": rank.attn_dp_rank,
        "pp_size": rank.pp_size, "pp_rank": rank.pp_rank,
        "system_dp_size": rank.system_dp_size, "system_dp_rank": rank.system_dp_rank,
        "rank_ip": host, "rank_port": int(port), "page_size": page_size,
        "kv_cache_dtype": kv_cache_dtype, "kv_layout": layout_mark(split_pages),
        "load_balance_method": parallel.load_balance_method,
        "prefill_http_port": get_serving().port,
        "decode_allocation_policy": policy_mark(allocation_policy),  # (mixed.py)
        "enable_dsa_cache_layer_split": bool(parallel.enable_dsa_cache_layer_split),
        "enable_kv_cache_sharding": bool(parallel.enable_kv_cache_sharding),
    }


class BootstrapRoute:
    """Where a prefill rank's row goes, and putting it there (module docstring); ``rust_port``:
    the rank's Rust listener (sglang's ``KVArgs.rust_http_port``), if it has one."""

    def __init__(self, rust_port: int | None):
        self.rust_port = rust_port
        self.url: str | None = None  # where the row went (None before the first registration)

    def register(self, row: dict, note: str = "") -> None:
        """Put ``row`` where sglang's managers put theirs (module docstring); ``note`` ends the
        log line."""
        first = self.url is None
        endpoint = f"{row['rank_ip']}:{row['rank_port']}"
        if envs.SGLANG_RUST_SERVER.get() and row["attn_dp_size"] > 1:
            rows = get_parallel().world_group.all_gather_object(row) if first else [row]
            if self.rust_port is None:  # no Rust listener on this rank: the ranks with one put its row
                if not first:
                    log.warning("dsa-bridge: prefill rank %s moved to a new port that cannot be "
                                "registered: it has no Rust listener, and the ranks that have one "
                                "put rows into their registries only at start-up", endpoint)
                self.url = ""
                return
            self.url = NetworkAddress(bootstrap_host(get_serving().host, None),
                                      self.rust_port).to_url() + "/route"
            for each in rows:
                put_route(self.url, {**each, "prefill_http_port": self.rust_port})
            log.info("dsa-bridge: prefill rank %s put %d rank(s) into its Rust registry at %s",
                     endpoint, len(rows), self.url)
            return
        if first:
            dist_init_addr = get_parallel().dist_init_addr
            bootstrap_port = get_disagg().disaggregation_bootstrap_port
            if dist_init_addr and get_parallel().nnodes > 1:  # each host may have reserved its own port
                bootstrap_port = get_parallel().world_group.broadcast_object(bootstrap_port, src=0)
            self.url = NetworkAddress(bootstrap_host(get_serving().host, dist_init_addr),
                                      bootstrap_port).to_url() + "/route"
        put_route(self.url, row)
        log.info("dsa-bridge: prefill rank %s registered at %s%s", endpoint, self.url, note)


def put_route(url: str, payload: dict) -> None:
    """``PUT`` one prefill rank's row into sglang's bootstrap server (or Rust registry) at
    ``url``. A PUT that cannot connect (another process may start the server) or is not answered
    within ``HTTP_TIMEOUT_S`` (a starved host) is tried again, with backoff, for up to
    ``REGISTER_WAIT_S`` (the row is the same each time: a PUT sets it); then the rank fails in one
    line naming the attempts and the last error. A refusal (not 200) is not retried."""
    deadline, backoff, attempts = time.monotonic() + REGISTER_WAIT_S, REGISTER_BACKOFF_S, 0
    while True:
        attempts += 1
        try:
            response = requests.put(url, json=payload, timeout=HTTP_TIMEOUT_S)
            break
        except (requests.ConnectionError, requests.Timeout) as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(
                    f"dsa-bridge: the bootstrap server at {url} did not take this prefill rank in "
                    f"{REGISTER_WAIT_S:g}s ({attempts} attempt(s)); the last: "
                    f"{type(exc).__name__}: {exc}") from exc
            time.sleep(min(backoff, left))
            backoff = min(2 * backoff, REGISTER_BACKOFF_MAX_S)
    if response.status_code != 200:
        raise RuntimeError(f"dsa-bridge: the bootstrap server at {url} refused this prefill rank: "
                           f"{response.status_code} {response.text}")


def post_dp_rank(bootstrap_addr: str, room: int, dp_rank: int) -> None:
    """Tell the bootstrap server that DP rank ``dp_rank`` serves ``room`` (``POST
    /register_dp_rank``), which sglang's decode queries when it cannot compute it, as sglang's own
    senders do; a failure is logged (decode's query then waits for the room until its own
    timeout, as with sglang's)."""
    url = f"http://{bootstrap_addr}/register_dp_rank"
    try:
        response = requests.post(url, json={"bootstrap_room": room, "dp_rank": dp_rank},
                                 timeout=HTTP_TIMEOUT_S)
    except requests.RequestException as exc:
        log.error("dsa-bridge: room %s: registering its prefill DP rank failed: %s", room, exc)
        return
    if response.status_code != 200:
        log.error("dsa-bridge: room %s: registering its prefill DP rank failed: %d %s", room,
                  response.status_code, response.text)
