"""Decode's bookkeeping of one request (room), pure: no sockets, threads or clocks.

A request is fed by one prefill node or by several pipeline stages (named by their endpoints).

``RequestParts`` counts what each of them reported (bytes, verified checksums, last chunk) and says
whether a part is complete and reported once, and whether every part is.

``RequestFence`` knows who may still write into the request's pages:

- **outstanding**: prefill nodes that may still write (no final word yet);
- **quarantined**: those that went silent while they might still write. A silent node is not a
  stopped one (a frozen process resumes and finishes its write), so its part of the fence stays
  up until the node is *proven* unable to write: it answered a new handshake (it answers only
  once none of its old session's writes can still run), or its process is gone (its control
  connection torn down and its port refusing connections);
- **in_flight_until**: a prefill reported a failed engine write whose bytes may still land; the
  engine's own bound for those (``in_flight_grace_s``) runs from the report.

``release_time`` is the fence's decision: when the pages may be reused by proof, or None while a
writer may remain. ``decide`` adds the configured upper bound: a request held that long is released
anyway, and that is reported as an expiry (counted, never silent).
"""

from __future__ import annotations

from collections.abc import Iterable


class RequestParts:
    """What each prefill part of one request reported: bytes, verified checksums, last chunk."""

    def __init__(self, peers: Iterable[str]):
        self.peers = list(peers)
        self.received = dict.fromkeys(self.peers, 0)  # bytes each prefill reported written
        self.verified = dict.fromkeys(self.peers, 0)  # (buffer, page) checksums verified
        self.finished: set[str] = set()  # prefills whose last chunk arrived

    def chunk(self, peer: str, nbytes: int) -> None:
        self.received[peer] += nbytes

    def verify(self, peer: str, count: int) -> None:
        self.verified[peer] += count

    def part_done(self, peer: str, expected_bytes: int, detail: str = "") -> str:
        """``peer``'s last chunk arrived: "" if its part is complete and reported once, else the
        problem."""
        if peer in self.finished:
            return f"prefill {peer} reported its last chunk twice"
        self.finished.add(peer)
        if self.received[peer] != expected_bytes:
            return (f"prefill {peer} wrote {self.received[peer]} bytes, expected {expected_bytes}"
                    + (f" ({detail})" if detail else ""))
        return ""

    @property
    def complete(self) -> bool:
        return len(self.finished) == len(self.peers)


class RequestFence:
    """The prefill nodes that may still write into one request's pages, and when they may go."""

    def __init__(self, peers: Iterable[str]):
        self.outstanding: set[str] = set(peers)  # prefills that may still write
        self.quarantined: set[str] = set()  # went silent while they might still write
        self.in_flight_until: float | None = None  # a reported failed write may land until then
        self.expired = False  # released by the upper bound, not by proof

    def nothing_sent(self) -> None:
        """No prefill node was ever asked for this request: none can write into its pages."""
        self.outstanding.clear()
        self.quarantined.clear()

    def confirmed(self, peer: str, now: float, *, in_flight: bool = False,
                  grace_s: float = 0.0) -> None:
        """``peer`` will write no more into the pages (its last chunk, its final failure report,
        or a proof that it is gone); ``in_flight``: a failed write of its may still land for
        ``grace_s``."""
        self.outstanding.discard(peer)
        self.quarantined.discard(peer)
        if in_flight:
            until = now + grace_s
            self.in_flight_until = until if self.in_flight_until is None else max(
                self.in_flight_until, until)

    def silent(self, peer: str) -> bool:
        """``peer`` stopped answering: if it may still write, quarantine the pages on it.
        Returns True when this put the request into quarantine."""
        if peer not in self.outstanding:
            return False
        self.outstanding.discard(peer)
        was = bool(self.quarantined)
        self.quarantined.add(peer)
        return not was

    def release_time(self) -> float | None:
        """When the pages may be reused by proof; None while a prefill may still write."""
        if self.outstanding or self.quarantined:
            return None
        return self.in_flight_until if self.in_flight_until is not None else float("-inf")

    def decide(self, failed_at: float, now: float, bound_s: float) -> tuple[float | None, bool]:
        """The decision for a failed request: (release time or None, released by expiry). Once
        ``bound_s`` has passed since the failure, the pages go back even without proof, and the
        second value is True (once; the caller counts it)."""
        at = self.release_time()
        if at is not None and at <= failed_at + bound_s:
            return at, False
        if now < failed_at + bound_s:  # not provably free within the bound: decided then
            return None, False
        first = not self.expired
        self.expired = True
        self.outstanding.clear()
        self.quarantined.clear()
        self.in_flight_until = None
        return failed_at + bound_s, first
