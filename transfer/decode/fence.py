"""Decode's bookkeeping of one request (room), pure: no sockets, threads or clocks.

A request is fed by one prefill node, by several pipeline stages (each writing its layers of
every page), or by share writers (each writing every layer of its share of the pages, which only
the prefill knows: each chunk names its pages), all named by their endpoints.

``RequestParts`` counts what each of them reported (bytes, verified checksums, last chunk, and a
share writer's pages) and says whether a part is complete and reported once, and whether every
part is: for share writers, whether each of the request's pages was written by exactly one.

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

from collections.abc import Iterable, Sequence

import numpy as np


class RequestParts:
    """What each prefill part of one request reported: bytes, verified checksums, last chunk;
    with ``shares``, the pages each share writer wrote."""

    def __init__(self, peers: Iterable[str], *, shares: bool = False):
        self.peers = list(peers)
        self.shares = shares
        self.received = dict.fromkeys(self.peers, 0)  # bytes each prefill reported written
        self.verified = dict.fromkeys(self.peers, 0)  # (buffer, page) checksums verified
        self.finished: set[str] = set()  # prefills whose last chunk arrived
        self.share_pages = dict.fromkeys(self.peers, 0)  # pages each share writer wrote
        self._written: np.ndarray | None = None  # share writers: which of the pages were written

    def start(self, num_pages: int) -> None:
        """The request's page count is known (decode's ``init``)."""
        if self.shares:
            self._written = np.zeros(num_pages, dtype=bool)

    def chunk(self, peer: str, nbytes: int) -> None:
        self.received[peer] += nbytes

    def positions(self, peer: str, positions: Sequence[int] | None) -> str:
        """The pages (positions in the request) a chunk of ``peer`` names: "" if they fit how
        this request is written, else the problem. Share writers must name theirs: ascending,
        within the request, none written before by any writer; the others name none."""
        if not self.shares:
            return "" if positions is None else (
                f"prefill {peer} wrote a share of the request's pages, and decode reads the whole "
                "request from it")
        if positions is None:
            return (f"prefill {peer} wrote a chunk without naming its pages, and decode reads a "
                    f"share of them from each of {len(self.peers)} prefill nodes")
        if self._written is None:
            return f"prefill {peer} wrote a share of the pages before decode named them"
        pages = np.asarray(positions, dtype=np.int64)
        if pages.size == 0:
            return ""
        if (pages[1:] <= pages[:-1]).any():
            return f"prefill {peer} named its pages out of order or twice"
        if pages[0] < 0 or pages[-1] >= self._written.size:
            return (f"prefill {peer} wrote page {int(pages[-1] if pages[0] >= 0 else pages[0])} "
                    f"of a request of {self._written.size} pages")
        again = pages[self._written[pages]]
        if again.size:
            return f"page {int(again[0])} of the request was written by two prefill nodes"
        self._written[pages] = True
        self.share_pages[peer] += int(pages.size)
        return ""

    def pages_of(self, peer: str, num_pages: int) -> int:
        """The pages ``peer`` writes of a request of ``num_pages``: its share, or all of them."""
        return self.share_pages[peer] if self.shares else num_pages

    def unwritten(self) -> str:
        """Once every part finished: "" if every page was written, else the problem."""
        if self._written is None or self._written.all():
            return ""
        missing = np.flatnonzero(~self._written)
        return (f"{missing.size} of the request's {self._written.size} pages were written by no "
                f"prefill node (the first: page {int(missing[0])})")

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
