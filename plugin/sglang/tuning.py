"""sglang's transfer tuning variables, as dsa-bridge takes them (``manager.py`` reads them once).

``read_tuning(settings)``, pure: ``settings`` maps each variable's name to its value as sglang
parses it, for the variables the operator set (sglang's defaults are not an operator's choice).
What it answers (``Tuning``):

- honoured: ``SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL`` and ``..._HEARTBEAT_MAX_FAILURE`` give
  how long a silent peer lives, as sglang counts it (the interval at least 2 s, failures at
  least 1, their product): the nodes' ``peer_timeout_s`` on both sides. dsa-bridge's own
  heartbeat stays ``HEARTBEAT_S`` (a prefill's death is told by its silence, sooner with a
  shorter beat); with neither set, dsa-bridge's ``PEER_TIMEOUT_S``.
- ignored, each named with why (``ignored``): ``SGLANG_DISAGGREGATION_THREAD_POOL_SIZE`` and
  ``..._QUEUE_SIZE`` (sglang's transfer threads and queues: dsa-bridge writes through one lane
  per decode node, its engine's own threads moving the bytes), and
  ``SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES`` (sglang's cap on one engine batch: dsa-bridge
  writes a chunk's page runs, coalesced, in one engine call).

``heartbeat_line`` and ``ignored_lines``: what the manager says at start-up, once per rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

HEARTBEAT_INTERVAL_ENV = "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL"
HEARTBEAT_FAILURES_ENV = "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE"
HEARTBEAT_S = 0.5  # dsa-bridge's own beat (the nodes' default)
PEER_TIMEOUT_S = 5.0  # a peer silent this long is dead, unless sglang's heartbeat is set
SGLANG_HEARTBEAT = (5.0, 2)  # sglang 0.5.23's defaults: interval, failures
SGLANG_MIN_HEARTBEAT = (2.0, 1)  # sglang's floors (common/conn.py)

IGNORED = {
    "SGLANG_DISAGGREGATION_THREAD_POOL_SIZE":
        "sglang's transfer threads; dsa-bridge writes through one lane per decode node and its "
        "engine's own threads",
    "SGLANG_DISAGGREGATION_QUEUE_SIZE":
        "sglang's transfer queues; dsa-bridge queues each decode node's chunks in its own lane",
    "SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES":
        "sglang's cap on one engine batch; dsa-bridge writes a chunk's page runs, coalesced, in "
        "one engine call",
}
TUNING_ENVS = (HEARTBEAT_INTERVAL_ENV, HEARTBEAT_FAILURES_ENV, *IGNORED)


@dataclass(frozen=True)
class Tuning:
    peer_timeout_s: float  # both nodes': a peer silent this long is dead
    heartbeat_s: float
    heartbeat_from_sglang: bool  # peer_timeout_s is sglang's heartbeat, as the operator set it
    ignored: tuple[tuple[str, object, str], ...]  # (variable, its value, why), those set


def read_tuning(settings: Mapping[str, object]) -> Tuning:
    """What dsa-bridge does with the tuning variables set (module docstring)."""
    from_sglang = HEARTBEAT_INTERVAL_ENV in settings or HEARTBEAT_FAILURES_ENV in settings
    peer_timeout_s = PEER_TIMEOUT_S
    if from_sglang:
        interval = max(float(settings.get(HEARTBEAT_INTERVAL_ENV, SGLANG_HEARTBEAT[0])),
                       SGLANG_MIN_HEARTBEAT[0])
        failures = max(int(settings.get(HEARTBEAT_FAILURES_ENV, SGLANG_HEARTBEAT[1])),
                       SGLANG_MIN_HEARTBEAT[1])
        peer_timeout_s = interval * failures
    ignored = tuple((name, settings[name], why) for name, why in IGNORED.items() if name in settings)
    return Tuning(peer_timeout_s, HEARTBEAT_S, from_sglang, ignored)


def heartbeat_line(tuning: Tuning) -> str:
    """The start-up line saying how long a silent peer lives, and where that came from."""
    source = (f"sglang's heartbeat ({HEARTBEAT_INTERVAL_ENV} x {HEARTBEAT_FAILURES_ENV})"
              if tuning.heartbeat_from_sglang else "dsa-bridge's default; sglang's heartbeat "
              "variables are not set")
    return (f"a silent peer is dead after {tuning.peer_timeout_s:g}s ({source}), dsa-bridge "
            f"beating every {tuning.heartbeat_s:g}s")


def ignored_lines(tuning: Tuning) -> list[str]:
    """A start-up warning for each tuning variable set that dsa-bridge does not use."""
    return [f"{name}={value} is ignored: {why}" for name, value, why in tuning.ignored]
