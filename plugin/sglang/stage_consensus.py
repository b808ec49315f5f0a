"""The prefill pipeline stages' consensus on each request's status (``manager.py``).

``StageConsensus``, one per prefill rank: with pipeline stages (``start``) it keeps every
stage's status of a room in sglang's ``PPConsensusStore`` on the pipeline group, as sglang's
managers do; stage 0 gives sglang its ``verdict`` over every stage (``poll_pp_consensus``), a later
stage's reporter thread sends its senders' statuses as they change. Without stages ``store`` stays
None and nothing is kept. Closing waits for sglang's store at most ``STORE_CLOSE_S``: its
``close()`` terminates a zmq context, which was seen to block for good on a later stage whose
stage 0 had already exited.
"""

from __future__ import annotations

import logging
import threading

from sglang.srt.disaggregation.base.conn import BaseKVSender, KVPoll
from sglang.srt.disaggregation.pp_consensus_store import PPConsensusStore

from .failures import TERMINAL

log = logging.getLogger(__name__)

STAGE_REPORT_S = 0.005  # how often a later pipeline stage reports its senders' statuses to stage 0
STORE_CLOSE_S = 5.0  # the longest the manager's shutdown waits for sglang's store to close


class StageConsensus:
    """One prefill rank's part of its stages' consensus (module docstring)."""

    def __init__(self, pp_size: int, pp_rank: int):
        self.pp_size, self.pp_rank = pp_size, pp_rank
        self.store: PPConsensusStore | None = None
        self._lock = threading.Lock()
        self._senders: dict[int, BaseKVSender] = {}
        self._stop = threading.Event()
        self._reporter: threading.Thread | None = None

    def start(self, pp_group) -> None:
        """sglang's ``PPConsensusStore`` over the pipeline group, as sglang's managers keep their
        request statuses with stages: stage 0 collects every stage's status of a room
        (``poll_pp_consensus``); a later stage's reporter thread sends its senders' statuses as
        they change (nothing else polls them there: sglang's later stages take stage 0's verdict)."""
        self.store = PPConsensusStore(self.pp_size, self.pp_rank, pp_group)
        if self.pp_rank > 0:
            self._reporter = threading.Thread(target=self._report_statuses, daemon=True,
                                              name=f"dsa-bridge-pp{self.pp_rank}-status")
            self._reporter.start()

    def track(self, sender: BaseKVSender) -> None:
        if self.store is not None and self.pp_rank > 0:
            with self._lock:
                self._senders[sender.bootstrap_room] = sender

    def forget(self, room: int) -> None:
        if self.store is not None:
            with self._lock:
                self._senders.pop(room, None)
            self.store.pop(room)

    def _report_statuses(self) -> None:
        reported: dict[int, int] = {}
        while not self._stop.wait(STAGE_REPORT_S):
            with self._lock:
                senders = list(self._senders.items())
            for room, sender in senders:
                status = int(sender.poll())
                if reported.get(room) != status:
                    self.store[room] = status
                    reported[room] = status
                if status in TERMINAL:
                    with self._lock:
                        self._senders.pop(room, None)
                    reported.pop(room, None)

    def verdict(self, room: int, own: int) -> int:
        """Stage 0's view of ``room`` over every stage (sglang's ``check_status_pp_consensus``),
        ``own`` being stage 0's status: Failed once any stage failed, Bootstrapping while a stage
        has not reported, else the least advanced status."""
        self.store[room] = int(own)
        statuses = self.store.collect(room)
        if KVPoll.Failed in statuses:
            return KVPoll.Failed
        if None in statuses:
            return KVPoll.Bootstrapping
        return min(statuses)

    def close(self) -> None:
        """Stop the reporter and close the store, waiting for it at most ``STORE_CLOSE_S`` (its
        close then goes on in a daemon thread, which does not hold the process's exit)."""
        self._stop.set()
        if self._reporter is not None:
            self._reporter.join()
        if self.store is None:
            return
        closer = threading.Thread(target=self.store.close, daemon=True,
                                  name=f"dsa-bridge-pp{self.pp_rank}-store-close")
        closer.start()
        closer.join(STORE_CLOSE_S)
        if closer.is_alive():
            log.warning("dsa-bridge: pipeline stage %d: sglang's PPConsensusStore did not close "
                        "within %.0fs (its zmq context's term blocked); left to a daemon thread",
                        self.pp_rank, STORE_CLOSE_S)
