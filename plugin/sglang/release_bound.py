"""One bound on how long a failed request's decode pages are held, for sglang and the fence (pure).

sglang's decode holds a failed request's pages until its manager says no write can land
(``is_abort_release_safe``: dsa-bridge's fence) or until its own deadline,
``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT`` (30 s by default), after which it
releases them unproven. The fence proves most releases early, but for a prefill that went silent
it may hold the pages up to its own bound (``FENCE_BOUND_S``, counted from the failure), then
releases them as an expiry. A deadline of sglang's shorter than the fence's bound would let sglang
reuse pages a frozen prefill may still write into.

``release_bound(sglang_s)`` makes one bound of the two: the larger. sglang's deadline is raised to
it (the hook on sglang's prefill-allocation queue sets its transfer queue's deadline, once the
manager exists), and the fence's bound follows sglang's setting where that is the larger. So the
fence always decides first (its clock starts at the failure, sglang's when its queue sees it),
and a page is never released to reuse while the fence cannot prove a write will not land, except
by the fence's own counted expiry. The other option, keeping pages sglang freed out of its
allocator, is not open to a connector: sglang owns its allocator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RELEASE_TIMEOUT_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT"
FENCE_BOUND_S = 600.0  # the fence's longest hold of a silent prefill's pages, from the failure


@dataclass(frozen=True)
class ReleaseBound:
    """The one bound (``bound_s``) and sglang's setting it was derived from (``sglang_s``)."""

    bound_s: float
    sglang_s: float

    @property
    def raised(self) -> bool:
        """Whether sglang's deadline was raised to the fence's bound."""
        return self.bound_s > self.sglang_s

    def line(self) -> str:
        """The start-up line that states the bound."""
        how = (f"sglang's {RELEASE_TIMEOUT_ENV}={self.sglang_s:g}s raised to dsa-bridge's fence bound"
               if self.raised else f"sglang's {RELEASE_TIMEOUT_ENV}={self.sglang_s:g}s, the fence's "
               "bound too")
        return (f"a failed request's decode pages are held at most {self.bound_s:g}s, by sglang and "
                f"by the fence alike ({how}); released earlier once no write can land")


def release_bound(sglang_s: float, fence_s: float = FENCE_BOUND_S) -> ReleaseBound:
    """The one bound for sglang's setting ``sglang_s`` (module docstring); a setting that is not a
    number of seconds >= 0 is refused by name."""
    try:
        value = float(sglang_s)
    except (TypeError, ValueError):
        raise ValueError(f"{RELEASE_TIMEOUT_ENV} must be a number of seconds >= 0, "
                         f"got {sglang_s!r}") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{RELEASE_TIMEOUT_ENV} must be a number of seconds >= 0, got {sglang_s!r}")
    return ReleaseBound(bound_s=max(value, fence_s), sglang_s=value)
