"""How a dsa-bridge request ends, in sglang's terms: ``TERMINAL`` statuses,
``BridgeTransferError`` (sglang's ``KVTransferError``), ``failure_reason`` (a checksum failure in
sglang's own words), ``FailedRequest`` (a request that failed before a dsa-bridge request existed
for it, or by another TP rank), and ``state_problem`` (sglang's DSA state indices checked against
the request's pages: a mismatch fails the request)."""

from __future__ import annotations

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import KVTransferError

TERMINAL = (KVPoll.Failed, KVPoll.Success)


class BridgeTransferError(KVTransferError, RuntimeError):
    """A failed request, as sglang's own managers raise it (``failure_reason`` is what sglang's
    decode records and aborts the request with)."""


CHECKSUM_MISMATCH = "KV checksum mismatch"  # sglang's own words for it (decode.py, the abort)


def failure_reason(reason: str) -> str:
    """``reason`` as sglang reads it: a checksum failure starts with sglang's own words."""
    return f"{CHECKSUM_MISMATCH} (dsa-bridge): {reason}" if "checksum" in reason else reason


class FailedRequest:
    """A request that failed before a dsa-bridge request existed for it, or that sglang failed
    because another TP rank's transfer of it failed (``from_another_rank``)."""

    def __init__(self, room: int, reason: str, from_another_rank: bool = False):
        self.room, self.reason, self.from_another_rank = room, reason, from_another_rank

    def exception(self) -> BridgeTransferError:
        return BridgeTransferError(self.room, f"room {self.room}: {self.reason}",
                                   is_from_another_rank=self.from_another_rank)


# sglang min-all-reduces its TP ranks' polls, then calls failure_exception on every rank
ANOTHER_RANK_FAILED = "stopped here: another TP rank's transfer of this request failed"


def state_problem(state_indices, pages: np.ndarray) -> str | None:
    """The DSA state indices sglang passes must be the request's KV pages (the indexer page ids
    are the KV page ids); None when they are, or when sglang passed none."""
    if len(state_indices) != 1:
        return f"{len(state_indices)} state components, but the pool has only the DSA indexer"
    given = state_indices[0]
    if given is None:
        return None
    given = np.asarray(given, dtype=np.int64).ravel()
    if not np.array_equal(given, pages):
        return (f"DSA state indices ({given.size} pages) are not the request's KV pages "
                f"({pages.size}): dsa-bridge moves page p of the indexer with KV page p")
    return None
