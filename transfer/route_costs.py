"""Pure: the route ``auto`` gives a chunk, from what the writes into one decode node have cost.

``RouteCosts`` keeps, per size class of chunk (``size_class``: its average descriptor bytes, in
powers of two), each route's seconds per byte as the lower quartile of the last ``window`` writes
timed into that decode node (the rest of the machine only ever slows a write: a low quantile sees
through a loaded spell that a mean or a median would take for the route's cost). The
caller passes the seconds: the direct route's engine write with the chunk's checksums, the staged
route's write up to decode freeing its last slice. ``choose`` takes each route until it has been
taken or timed ``min_samples`` times in a class (a forced route's writes count too), then the
cheaper one, and the dearer one once every so many chunks of the class so that a change of the
costs is seen: the dearer it is, the rarer (``explore_every``: its extra cost at most ``budget``
of the class's time). No clocks,
threads or sockets inside; not thread-safe (its owner locks).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from .staging import DIRECT, STAGED, StagingError

MIN_SAMPLES = 2  # chunks of each route before a class compares them
WINDOW = 9  # writes per route and class whose lower quartile is its cost
QUANTILE = 0.25
BUDGET = 0.02  # the share of a class's time the dearer route's refreshes may cost
FEWEST_BETWEEN = 16  # chunks at least between two refreshes of the dearer route
MOST_BETWEEN = 1024  # ... and at most


def size_class(descriptors: int, nbytes: int) -> int:
    """The size class of a chunk of ``descriptors`` direct descriptors of ``nbytes`` in all: the
    bit length of its average descriptor bytes (1 KiB and 1.9 KiB share one, 2 KiB is the next)."""
    if descriptors <= 0 or nbytes <= 0:
        raise StagingError(f"a chunk of {descriptors} descriptors and {nbytes} bytes has no size "
                           "class: both must be > 0")
    return (nbytes // descriptors).bit_length()


def explore_every(ratio: float, budget: float = BUDGET) -> int:
    """Chunks between two refreshes of a route ``ratio`` times dearer than the other: enough that
    the refreshes cost at most ``budget`` of the time, within [FEWEST_BETWEEN, MOST_BETWEEN]."""
    if not ratio >= 1.0:
        raise StagingError(f"a cost ratio must be >= 1, got {ratio}")
    wanted = math.ceil((ratio - 1.0) / budget) if math.isfinite(ratio) else MOST_BETWEEN
    return min(MOST_BETWEEN, max(FEWEST_BETWEEN, wanted))


@dataclass
class ClassCosts:
    """One size class: each route's latest writes' seconds per byte (``recent``) and their lower
    quartile (``per_byte``, None before its first write), the chunks given each route, the writes timed on
    each, and the chunks since the dearer route was last taken."""

    window: int = WINDOW
    recent: dict[str, deque] = field(default_factory=dict)
    per_byte: dict[str, float | None] = field(default_factory=lambda: {DIRECT: None, STAGED: None})
    chosen: dict[str, int] = field(default_factory=lambda: {DIRECT: 0, STAGED: 0})
    timed: dict[str, int] = field(default_factory=lambda: {DIRECT: 0, STAGED: 0})
    since_refresh: int = 0

    def cheaper(self) -> str | None:
        """The route of the lower seconds per byte (None until both have one)."""
        direct, staged = self.per_byte[DIRECT], self.per_byte[STAGED]
        if direct is None or staged is None:
            return None
        return STAGED if staged < direct else DIRECT

    def ratio(self) -> float:
        """The dearer route's seconds per byte over the cheaper's (both known)."""
        low, high = sorted((self.per_byte[DIRECT], self.per_byte[STAGED]))
        return high / low if low > 0 else math.inf


class RouteCosts:
    """The routes' costs into one decode node, and ``auto``'s choice (module docstring)."""

    def __init__(self, *, min_samples: int = MIN_SAMPLES, window: int = WINDOW,
                 budget: float = BUDGET):
        if min_samples < 1 or window < 1 or not 0.0 < budget < 1.0:
            raise StagingError(f"route costs need min_samples >= 1, window >= 1 and "
                               f"0 < budget < 1, got {min_samples}, {window}, {budget}")
        self.min_samples, self.window, self.budget = min_samples, window, budget
        self.classes: dict[int, ClassCosts] = {}

    def choose(self, descriptors: int, nbytes: int) -> str:
        """The route of a chunk of ``descriptors`` direct descriptors and ``nbytes`` (an empty
        chunk goes direct: it writes nothing)."""
        if nbytes == 0 or descriptors == 0:
            return DIRECT
        costs = self._class(descriptors, nbytes)
        route = self._pick(costs)
        costs.chosen[route] += 1
        return route

    def _pick(self, costs: ClassCosts) -> str:
        for route in (DIRECT, STAGED):
            if max(costs.chosen[route], costs.timed[route]) < self.min_samples:
                return route
        cheaper = costs.cheaper()
        if cheaper is None:  # the first writes are still in flight: the one timed so far
            return DIRECT if costs.per_byte[STAGED] is None else STAGED
        costs.since_refresh += 1
        if costs.since_refresh >= explore_every(costs.ratio(), self.budget):
            costs.since_refresh = 0
            return STAGED if cheaper == DIRECT else DIRECT
        return cheaper

    def observe(self, route: str, descriptors: int, nbytes: int, seconds: float) -> None:
        """A chunk of ``descriptors`` direct descriptors and ``nbytes`` written on ``route`` in
        ``seconds``."""
        if route not in (DIRECT, STAGED):
            raise StagingError(f"a chunk's route is direct or staged, got {route!r}")
        if not (seconds >= 0.0 and math.isfinite(seconds)):
            raise StagingError(f"a write's seconds must be finite and >= 0, got {seconds}")
        costs = self._class(descriptors, nbytes)
        costs.timed[route] += 1
        recent = costs.recent.setdefault(route, deque(maxlen=costs.window))
        recent.append(seconds / nbytes)
        costs.per_byte[route] = sorted(recent)[int(len(recent) * QUANTILE)]

    def _class(self, descriptors: int, nbytes: int) -> ClassCosts:
        key = size_class(descriptors, nbytes)
        costs = self.classes.get(key)
        if costs is None:
            costs = self.classes[key] = ClassCosts(window=self.window)
        return costs

    def per_byte(self, descriptors: int, nbytes: int) -> dict[str, float | None]:
        """Each route's seconds per byte in the class of such a chunk (None: not timed yet)."""
        costs = self.classes.get(size_class(descriptors, nbytes))
        return dict(costs.per_byte) if costs else {DIRECT: None, STAGED: None}
