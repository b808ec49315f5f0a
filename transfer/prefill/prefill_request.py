"""One request at prefill, all the node knows of it in one object: ``PrefillRequest``.

A room's request is known from the first of: decode's pages (``RequestPages``: one
``DecodeDestination`` per decode node that receives it, in ``Destinations``), a decode node's
``Reserve`` (deferred allocation: a ``Reservation``), or the application's ``KVSender``; and,
where decode's destination was lost before the sender came, why (``LostDestination``: the sender
fails at once when it is made). The node keeps one ``PrefillRequest`` per room
(``requests.RequestBook``) until nothing is left of it (``idle``); the writer's ``Job`` and the
``Result`` it hands the reporter carry it, so that a chunk's outcome updates its own request,
never a table of the node's.

Pure: no locks, threads or clocks; time is passed in, and the node's lock guards the object.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..request import KVPoll
from .records import DecodeDestination, DecodePeer, Destinations, KVSender, Reservation


@dataclass(frozen=True)
class LostDestination:
    """Why and when decode's destination of a request without a sender was lost."""

    reason: str
    at: float


@dataclass(eq=False)
class PrefillRequest:
    """One room's request: its sender, where decode wants its pages, who reserved it, and why its
    destination was lost before a sender came (see the module docstring)."""

    room: int
    sender: KVSender | None = None
    destinations: Destinations | None = None
    reservations: list[Reservation] = field(default_factory=list)
    lost: LostDestination | None = None

    @property
    def idle(self) -> bool:
        """Nothing is left of it: the node forgets the room."""
        return (self.sender is None and self.destinations is None and not self.reservations
                and self.lost is None)

    @property
    def writable(self) -> bool:
        """Every decode node that receives it announced its pages."""
        return self.destinations is not None and self.destinations.complete

    def to_write(self) -> list[DecodeDestination]:
        """The decode nodes prefill writes its chunks to (none before any announced, or when
        there is nothing to send)."""
        return [] if self.destinations is None else self.destinations.to_write()

    def destination_of(self, peer: DecodePeer) -> DecodeDestination | None:
        return None if self.destinations is None else self.destinations.of(peer)

    # ---- transitions ---------------------------------------------------------------------------

    def attach(self, sender: KVSender) -> LostDestination | None:
        """The application's sender for it; returns why decode's destination was lost before it
        came (the sender then fails at once), else None."""
        self.sender = sender
        lost, self.lost = self.lost, None
        return lost

    def announce(self, destination: DecodeDestination, copies: int, nothing_to_send: bool) -> None:
        """One decode node's pages for it (the first one says how many decode nodes receive it)."""
        if self.destinations is None:
            self.destinations = Destinations(copies, [], nothing_to_send)
        self.destinations.members.append(destination)
        destination.peer.rooms.add(self.room)

    def leave(self, destination: DecodeDestination) -> None:
        """``destination``'s decode node no longer receives it."""
        self.destinations.members.remove(destination)
        destination.peer.rooms.discard(self.room)
        if not self.destinations.members:
            self.destinations = None

    def drop_destinations(self) -> Destinations:
        """Forget every decode node's destination; returns them (each is refused)."""
        destinations, self.destinations = self.destinations, None
        for destination in destinations.members:
            destination.peer.rooms.discard(self.room)
        return destinations

    def lose(self, reason: str, now: float) -> None:
        """Decode's destination is lost before the application made the sender: a sender made
        later fails at once, with ``reason``."""
        self.lost = LostDestination(reason, now)

    def forget_lost(self, now: float, keep_s: float) -> None:
        """Forget a lost destination older than ``keep_s``."""
        if self.lost is not None and now - self.lost.at > keep_s:
            self.lost = None

    def reserve(self, peer: DecodePeer, now: float) -> bool:
        """``peer`` reserves it; False (nothing changes) for a repeat of the same node's."""
        if any(r.peer is peer for r in self.reservations):
            return False
        self.reservations.append(Reservation(peer, now))
        return True

    def untold(self) -> list[DecodePeer]:
        """The decode nodes that reserved it and are to be told now that its prefill finished
        (each once: marked told; not those refused)."""
        untold = [r for r in self.reservations if not (r.told or r.refused)]
        for reservation in untold:
            reservation.told = True
        return [r.peer for r in untold]

    def unrefused(self) -> list[DecodePeer]:
        """The decode nodes that only reserved it (no page of theirs was named, no write into
        them can run) and are to be refused now that it failed (each once: marked refused)."""
        unrefused = [r for r in self.reservations
                     if not (r.refused or self.destination_of(r.peer) is not None)]
        for reservation in unrefused:
            reservation.refused = True
        return [r.peer for r in unrefused]

    def unreserve(self, peer: DecodePeer) -> bool:
        """Forget ``peer``'s reservation; True if it had one."""
        kept = [r for r in self.reservations if r.peer is not peer]
        found = len(kept) != len(self.reservations)
        self.reservations = kept
        return found

    def finish(self) -> PrefillRequest | None:
        """Its sender finished and no write of it can still run: its destinations, reservations
        and lost destination are dropped (the sender keeps its state); returns the room's next
        request, holding the reservations that came after this one succeeded, if any."""
        if self.destinations is not None:
            self.drop_destinations()
        state = self.sender.state
        later = [r for r in self.reservations if state.status == KVPoll.Success
                 and r.received_at > state.finished_at]
        self.reservations = []
        self.lost = None
        return PrefillRequest(self.room, reservations=later) if later else None
