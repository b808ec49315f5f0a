"""sglang's deferred decode release answered by dsa-bridge's fence (``manager.py``).

``DeferredRelease``, one per decode rank: sglang holds a failed request's pages from
``register_deferred_abort_room`` until ``is_abort_release_safe``, which is the fence's
``can_release`` for that room's request. A release the fence had not allowed
(``clear_deferred_abort_state`` at sglang's deadline, or a receiver's ``clear``) is counted
(``forced_releases``) and logged; a cleared request leaves its ``DecodeNode`` once its fence
lifts (``forget_released``, run from sglang's next call). ``log_release_bounds`` says at start-up
when sglang's deferral is off; with it on, sglang's deadline is the fence's bound
(``release_bound.py``), so a forced release is one of a sglang that did not take it.
"""

from __future__ import annotations

import logging

from sglang.srt.disaggregation.base.conn import BaseKVReceiver

from ...transfer.decode import DecodeNode, KVReceiver
from .decode_nodes import DecodeNodes
from .release_bound import RELEASE_TIMEOUT_ENV, ReleaseBound

log = logging.getLogger(__name__)

DEFERRED_RELEASE_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"


def log_release_bounds(enabled: bool) -> None:
    """Say once, at start-up, when sglang's deferral is off: its releases at once are unproven
    (with it on, the one bound is stated where sglang's queue takes it: ``hooks.py``)."""
    if not enabled:
        log.warning("dsa-bridge: %s is off: sglang frees a failed request's decode pages at once, "
                    "while a prefill write into them may still land (into the next request's "
                    "KV); dsa-bridge can only count and log each such release (forced_releases). "
                    "Unset it to keep the pages until dsa-bridge's fence lets them go",
                    DEFERRED_RELEASE_ENV)


class DeferredRelease:
    """The rooms sglang holds and the requests whose fence answers for them (module docstring);
    ``nodes`` are the rank's decode nodes, whose retired ones close once idle; ``bound`` the one
    release bound, which sglang's transfer queue holds once the hook gave it (``take_bound``)."""

    def __init__(self, nodes: DecodeNodes, bound: ReleaseBound):
        self.nodes = nodes
        self.bound = bound
        self.deadline_s = bound.sglang_s  # sglang's deferred-release deadline in force
        self.forced_releases = 0  # pages sglang released while the fence still held them
        self._abort_generation = 0  # sglang's wire id of a held room's abort (kept, not sent)
        self._armed: dict[int, int] = {}  # room -> generation, while sglang holds its pages
        self._live: dict[int, BaseKVReceiver] = {}  # room -> receiver with a dsa-bridge request
        self._unreleased: list[tuple[DecodeNode, KVReceiver]] = []  # cleared, fence still up

    def register_deferred_abort_room(self, bootstrap_room: int) -> int:
        """sglang holds ``bootstrap_room``'s pages from now on (its receiver's abort notification,
        which dsa-bridge's receiver sends as its own ``Abort``); returns the generation, as
        sglang's managers do."""
        self._abort_generation += 1
        self._armed[bootstrap_room] = self._abort_generation
        return self._abort_generation

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        """True exactly when dsa-bridge's fence lets the room's pages go (``can_release``): no
        prefill write into them can still land. A room without a dsa-bridge request (never asked
        of a prefill, or already released) is safe. ``required_acks`` (sglang's count of prefill
        ranks to ack) is not needed: the fence covers every prefill rank of the request."""
        self.forget_released()
        receiver = self._live.get(bootstrap_room)
        return receiver is None or receiver.can_release()

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        """sglang's ``_do_release`` is releasing the room's pages (drained, or at its deadline):
        a release while the fence still holds them is forced, counted and logged."""
        self._armed.pop(bootstrap_room, None)
        receiver = self._live.get(bootstrap_room)
        if receiver is not None and not receiver.can_release():
            receiver.release_forced(self.at_deadline())

    def take_bound(self) -> float:
        """sglang's transfer queue holds pages for the one bound from now on (the hook on its
        prefill-allocation queue): the deadline in force, returned."""
        self.deadline_s = self.bound.bound_s
        return self.deadline_s

    def at_deadline(self) -> str:
        """How a release at sglang's deadline is told: the deadline in force, and sglang's
        setting it came from."""
        raised = " raised to the one bound" if self.deadline_s != self.bound.sglang_s else ""
        return (f"at sglang's deferred-release deadline of {self.deadline_s:g}s "
                f"({RELEASE_TIMEOUT_ENV}={self.bound.sglang_s:g}s{raised})")

    def count_forced_release(self, room: int, how: str) -> None:
        self.forced_releases += 1
        log.warning("dsa-bridge: room %s: sglang released its decode pages %s while dsa-bridge's "
                    "fence still held them: a prefill write may land in them (%d such release(s))",
                    room, how, self.forced_releases)

    def track(self, receiver: BaseKVReceiver) -> None:
        """``receiver`` has a dsa-bridge request: its fence answers for its room."""
        self._live[receiver.bootstrap_room] = receiver

    def untrack(self, receiver: BaseKVReceiver, node: DecodeNode, request: KVReceiver) -> None:
        """sglang is done with ``receiver``: its request leaves the node now if the fence lets it,
        else once it does (``forget_released``)."""
        if self._live.get(receiver.bootstrap_room) is receiver:
            del self._live[receiver.bootstrap_room]
        self._unreleased.append((node, request))
        self.forget_released()

    def forget_released(self) -> None:
        """Remove from their nodes the cleared requests whose fence has lifted. Called from
        sglang's own calls on the scheduler thread (polls, clears, release checks), so no thread
        of its own; the list is bounded by the fence's own bound (``release_bound.py``)."""
        held = []
        for node, request in self._unreleased:
            if request.can_release():
                node.forget(request)
            else:
                held.append((node, request))
        self._unreleased = held
        if self.nodes.retired_nodes:
            self.nodes.close_idle_retired()

    @property
    def unreleased_receivers(self) -> int:
        """Requests sglang cleared whose fence still holds their pages (not yet forgotten)."""
        return len(self._unreleased)

    def fail_all(self, reason: str) -> int:
        """sglang's memory saver releases the cache: every tracked request fails with ``reason``
        and none is held any more (their pages leave with the memory: nothing can land there
        now); returns how many failed."""
        live = list(self._live.values())
        for receiver in live:
            receiver.fail(reason)
        self._live.clear()
        self._unreleased.clear()
        return len(live)
