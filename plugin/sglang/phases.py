"""Per-phase deadlines of one request inside sglang, pure: sglang's own managers time each phase
of a request from its own start, with its own environment variable, not the whole request from
its creation; ``PhaseClock`` does the same for dsa-bridge's sender and receiver (the caller
passes ``now``).

- **bootstrapping**, from the sender's or receiver's creation: on prefill until decode's pages
  arrive (sglang's ``CommonKVSender`` times exactly this with
  ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``); on decode until ``send_metadata`` sends them —
  the wait in sglang's prealloc queue, bounded by the same variable because the prefill gives up
  on the request at that bound;
- **waiting**, from then to the end of the transfer: sglang's decode times it with
  ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` from ``send_metadata``; dsa-bridge's prefill uses the
  same bound from the moment decode's pages arrived (decode gives up on the request by then).

With sglang's ``prefill_complete`` policy (decode allocates once prefill has computed the
request) both start in **prefilling**: unbounded on prefill (sglang's prefill times nothing
before ``mark_prefill_complete``: its queues and the client's abort end the request), on decode
bounded by ``SGLANG_DISAGGREGATION_WAITING_TIMEOUT`` (sglang's decode waits that long for the
prefill's readiness); bootstrapping then starts at ``prefill_complete`` on prefill and at the
readiness on decode.

A request that waits long in one queue therefore keeps the whole bound of the next phase. The
dsa-bridge node under the plugin keeps a request deadline of its own (a backstop, run by its
tick while sglang does not poll): ``PhaseLimits.node_timeout_s``, the sum of both phases and a
margin, so that it never fires before a phase's deadline would.
"""

from __future__ import annotations

from dataclasses import dataclass

BOOTSTRAP_ENV = "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"
WAITING_ENV = "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"
NODE_MARGIN_S = 5.0  # the node's own deadline comes this long after the phases' latest one
PREFILLING, BOOTSTRAPPING, WAITING, DONE = "prefilling", "bootstrapping", "waiting", "done"

WHAT = {  # (side, phase) -> what the request was waiting for
    ("decode", PREFILLING): "the prefill did not finish computing it (sglang's prefill_complete "
                            "policy: decode allocates its pages once it has)",
    ("prefill", BOOTSTRAPPING): "decode's pages did not arrive (sglang's prefill bootstrap queue)",
    ("prefill", WAITING): "decode's pages arrived but the transfer did not finish (sglang's "
                          "prefill queues, the forward, the write)",
    ("decode", BOOTSTRAPPING): "its pages were not sent to the prefill (sglang's decode prealloc "
                               "queue; the prefill gives up at the same bound)",
    ("decode", WAITING): "its pages were sent but the transfer did not finish",
}


@dataclass(frozen=True)
class PhaseLimits:
    """The phases' bounds in seconds, from sglang's variables (defaults: 300 s each)."""

    bootstrap_s: float
    waiting_s: float

    @property
    def node_timeout_s(self) -> float:
        """The node's own request deadline: later than any phase's (a request's phases start no
        earlier than its node request, and last at most ``bootstrap_s + waiting_s``)."""
        return self.bootstrap_s + self.waiting_s + NODE_MARGIN_S


class PhaseClock:
    """One request's phase and its deadline: ``prefilled`` and ``advance`` when the next phase
    starts (once; later calls change nothing), ``finish`` once terminal, ``expired(now)`` the
    reason once the current phase has run past its bound (naming the phase and the variable to
    raise). ``deferred``: sglang's ``prefill_complete`` policy, the first phase prefilling."""

    def __init__(self, side: str, limits: PhaseLimits, now: float, *, deferred: bool = False):
        if side not in ("prefill", "decode"):
            raise ValueError(f"side must be 'prefill' or 'decode', got {side!r}")
        self.side = side
        self.limits = limits
        self.phase = PREFILLING if deferred else BOOTSTRAPPING
        self.started = now

    def prefilled(self, now: float) -> None:
        """The prefill finished computing the request: bootstrapping starts ``now``."""
        if self.phase == PREFILLING:
            self.phase, self.started = BOOTSTRAPPING, now

    def advance(self, now: float) -> None:
        """Bootstrapping is over: the waiting phase starts ``now``."""
        if self.phase in (PREFILLING, BOOTSTRAPPING):
            self.phase, self.started = WAITING, now

    def finish(self) -> None:
        """The request ended (Success or Failed): no deadline any more."""
        self.phase = DONE

    @property
    def bound_s(self) -> float | None:
        if self.phase == PREFILLING:  # sglang's prefill times nothing before it is complete
            return self.limits.waiting_s if self.side == "decode" else None
        return {BOOTSTRAPPING: self.limits.bootstrap_s, WAITING: self.limits.waiting_s}.get(self.phase)

    @property
    def env(self) -> str:
        return BOOTSTRAP_ENV if self.phase == BOOTSTRAPPING else WAITING_ENV

    def expired(self, now: float) -> str | None:
        """Why the request fails now, or None while its phase is within its bound."""
        bound = self.bound_s
        if bound is None or now - self.started < bound:
            return None
        return (f"timed out after {now - self.started:.1f}s {self.phase} ({self.side}): "
                f"{WHAT[self.side, self.phase]}; sglang bounds this phase by {self.env}="
                f"{bound:g}s: raise it (on both servers) if such waits are expected")
