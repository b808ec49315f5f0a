"""The chunks of an early send held until their forward finished (``plugin/sglang/early_send.py``):
the pure ``HeldChunks`` (order, chunks behind a held one, the deadline) and the dispatcher's thread
over a stand-in of the node's sender (the real node and sglang: ``test_sglang_rank_failure.py``).
"""

from __future__ import annotations

from dsa_bridge.plugin.sglang.early_send import EarlySendDispatcher, HeldChunks
from dsa_bridge.transfer.request import KVPoll, RequestState
from tests.transfer.helpers import wait_for


class Event:
    def __init__(self, done: bool = False):
        self.done = done

    def query(self) -> bool:
        return self.done


def completed(event) -> bool:
    return event.done


def test_chunks_go_in_order_once_the_event_before_them_completed():
    held, first, second = HeldChunks(), Event(), Event()
    held.add([1, 2], first, now=0.0, wait_s=5.0)
    held.add([3], None, now=0.0, wait_s=5.0)  # no event of its own: waits behind the first
    held.add([4], second, now=0.0, wait_s=5.0)
    assert held.release(1.0, completed) == ([], None) and held.waiting
    first.done = True
    assert held.release(2.0, completed) == ([[1, 2], [3]], None)
    second.done = True
    assert held.release(3.0, completed) == ([[4]], None) and not held.waiting


def test_an_event_past_its_deadline_fails_the_request_naming_it():
    held = HeldChunks()
    held.add([1, 2], Event(), now=0.0, wait_s=5.0)
    held.add([3], None, now=0.0, wait_s=5.0)
    assert held.release(5.0, completed) == ([], None)
    ready, reason = held.release(5.1, completed)
    assert ready == [] and not held.waiting
    assert "2 page(s) sent early had not finished 5s" in reason and "_early_send_wait_event" in reason


class Sender:
    """The node's ``KVSender`` as the dispatcher uses it: ``room``, ``state``, ``send``, ``abort``."""

    def __init__(self, room: int):
        self.room = room
        self.state = RequestState(room, 60.0, now=0.0)
        self.sent: list = []
        self.aborted: list[str] = []

    def send(self, pages) -> None:
        self.sent.append(pages)

    def abort(self, reason: str) -> None:
        self.aborted.append(reason)
        self.state.fail(reason, 0.0)


def test_the_dispatcher_hands_held_chunks_on_in_order_and_never_blocks_the_caller():
    dispatcher = EarlySendDispatcher("test", wait_s=30.0, completed=completed)
    try:
        direct, early, dropped = Sender(1), Sender(2), Sender(3)
        dispatcher.send(direct, [9])  # nothing held, no event: at once
        assert direct.sent == [[9]]
        event = Event()
        dispatcher.send(early, [1], event)
        dispatcher.send(early, [2])  # behind the held chunk
        dispatcher.send(dropped, [5], Event())
        assert early.sent == [] and dropped.sent == []
        dropped.abort("aborted by sglang")  # failed meanwhile: its chunk is never read
        event.done = True
        wait_for(lambda: early.sent == [[1], [2]], 10, "the held chunks")
        dispatcher.send(early, [3])  # nothing held any more: at once
        assert early.sent == [[1], [2], [3]] and dropped.sent == []
    finally:
        dispatcher.close()


def test_the_dispatcher_aborts_a_request_whose_forward_never_finishes():
    dispatcher = EarlySendDispatcher("test", wait_s=0.2, completed=completed)
    try:
        sender = Sender(1)
        dispatcher.send(sender, [1, 2, 3], Event())
        wait_for(lambda: sender.aborted, 10, "the deadline")
        assert sender.sent == [] and sender.state.status == KVPoll.Failed
        assert "had not finished 0.2s after sglang's early send" in sender.aborted[0]
    finally:
        dispatcher.close()
