"""The control loop: bounded work between ticks, fair across sockets, a bounded log, the socket
receive limit.

A socket queued full of messages (junk or valid) must not keep the tick from running: at most
``batch`` messages, and no more than the time budget allows, are handled between two ticks, and
the sockets take turns. The tick keeps its schedule when messages arrive one at a time (not one
tick per message). Messages beyond a socket's receive limit never reach the loop; the
connection they came on is closed and the sender may reconnect.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from dsa_bridge.transfer import control, protocol
from dsa_bridge.transfer.control import ControlLoop, limit_receive

from .helpers import wait_for

HEARTBEAT = protocol.encode(protocol.Heartbeat(1.0))


class Pair:
    """A PULL socket the loop owns and a PUSH socket the test floods it through."""

    def __init__(self, context: zmq.Context, limit: int = 0):
        self.inbox = context.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.setsockopt(zmq.RCVHWM, 0)
        if limit:
            limit_receive(self.inbox, limit)
        port = self.inbox.bind_to_random_port("tcp://127.0.0.1")
        self.push = context.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.setsockopt(zmq.SNDHWM, 0)
        self.push.connect(f"tcp://127.0.0.1:{port}")

    def close(self) -> None:
        self.push.close(0)
        self.inbox.close(0)


class Recorder:
    """The loop's callbacks: every message's socket and every tick's message count."""

    def __init__(self, cost_s: float = 0.0):
        self.cost_s = cost_s
        self.handled: list[zmq.Socket] = []
        self.at_tick: list[int] = []
        self.lock = threading.Lock()

    def on_message(self, sock, identity, message) -> None:
        if self.cost_s:
            time.sleep(self.cost_s)
        with self.lock:
            self.handled.append(sock)

    def on_tick(self, now: float) -> None:
        with self.lock:
            self.at_tick.append(len(self.handled))

    def steps(self) -> list[int]:
        """Messages handled between each two ticks."""
        return [b - a for a, b in zip(self.at_tick, self.at_tick[1:], strict=False)]


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def queued(pair: Pair, count: int, data: bytes = HEARTBEAT) -> None:
    """Queue ``count`` messages and wait until they reached the loop's socket's queue."""
    for _ in range(count):
        pair.push.send(data)
    wait_for(lambda: pair.inbox.poll(0), 10, "the first message queued")
    time.sleep(0.3)  # the rest of them cross loopback TCP


def run(loop: ControlLoop, recorder: Recorder, total: int, timeout_s: float = 30) -> None:
    loop.start()
    try:
        wait_for(lambda: len(recorder.handled) + loop.bad_messages >= total, timeout_s, "all handled")
    finally:
        loop.stop()


def flood(context, loop: ControlLoop, recorder: Recorder, count: int, data: bytes = HEARTBEAT) -> None:
    """Give ``loop`` one socket, queue ``count`` messages into it, then run the loop until every
    one is handled or counted bad."""
    pair = Pair(context)
    loop.add_socket(pair.inbox)
    try:
        queued(pair, count, data)
        run(loop, recorder, count)
    finally:
        pair.close()


def test_at_most_a_batch_is_handled_between_two_ticks(context):
    recorder = Recorder()
    loop = ControlLoop("t", recorder.on_message, recorder.on_tick, batch=16, budget_s=10.0)
    flood(context, loop, recorder, 5000)
    steps = recorder.steps()
    seen = f"{len(recorder.handled)} handled, {len(recorder.at_tick)} ticks, steps {steps[:40]}"
    assert len(recorder.handled) == 5000, seen
    assert max(steps) == 16, seen  # full batches while the queue lasted, never more
    assert len(recorder.at_tick) >= 5000 // 16, seen


def test_the_tick_keeps_its_schedule_while_messages_arrive_one_by_one(context):
    pair = Pair(context)
    recorder = Recorder()
    loop = ControlLoop("t", recorder.on_message, recorder.on_tick, poll_ms=20)
    loop.add_socket(pair.inbox)
    loop.start()
    try:
        started = time.monotonic()
        for _ in range(200):  # each one wakes the loop
            pair.push.send(HEARTBEAT)
            time.sleep(0.001)
        wait_for(lambda: len(recorder.handled) == 200, 10, "every message handled")
        elapsed = time.monotonic() - started
    finally:
        loop.stop()
        pair.close()
    # one tick per 20 ms, plus one per round a backlog of over 64 messages might cut short
    ticks = len(recorder.at_tick)
    assert 2 <= ticks <= elapsed / 0.020 + 1 + 200 // control.BATCH, f"{ticks} ticks in {elapsed:.2f} s"


def test_a_burst_of_sends_wakes_the_loop_once_and_every_message_leaves(context, monkeypatch):
    """Messages queued while the loop is busy (here: in a tick) cost one write to its wake-up
    pipe, not one each; all of them leave at its next flush, and a later send wakes it again."""
    pair, writes = Pair(context), []
    in_tick, release = threading.Event(), threading.Event()

    def on_tick(now: float) -> None:
        in_tick.set()
        release.wait(10)

    real_write = control.os.write
    monkeypatch.setattr(control.os, "write", lambda fd, data: (writes.append(fd), real_write(fd, data))[1])
    loop = ControlLoop("t", lambda *a: None, on_tick)
    loop.start()
    try:
        assert in_tick.wait(10)
        for _ in range(100):
            loop.send(pair.push, protocol.Heartbeat(2.0))
        assert writes.count(loop._wake_w) == 1
        release.set()
        for _ in range(100):
            assert pair.inbox.poll(10_000), "a queued message never left"
            assert isinstance(protocol.decode(pair.inbox.recv()), protocol.Heartbeat)
        loop.send(pair.push, protocol.Heartbeat(3.0))
        assert pair.inbox.poll(10_000) and protocol.decode(pair.inbox.recv()).sent_at == 3.0
    finally:
        release.set()
        loop.stop()
        pair.close()


def test_the_time_budget_ends_a_round_before_its_batch(context):
    recorder = Recorder(cost_s=0.004)
    loop = ControlLoop("t", recorder.on_message, recorder.on_tick, batch=1000, budget_s=0.01)
    flood(context, loop, recorder, 100)
    steps = recorder.steps()
    assert 1 < max(steps) <= 4  # 4 ms each: the budget of 10 ms is past after the third
    assert loop.max_tick_gap_s >= 0.008


def test_junk_is_bounded_per_round_too(context):
    recorder = Recorder()
    loop = ControlLoop("t", recorder.on_message, recorder.on_tick, batch=8, budget_s=10.0)
    counts: list[int] = []
    loop._on_tick = lambda now: counts.append(loop.bad_messages)
    flood(context, loop, recorder, 2000, b"\xc1junk")
    assert loop.bad_messages == 2000 and not recorder.handled
    assert max(b - a for a, b in zip(counts, counts[1:], strict=False)) == 8


def test_sockets_take_turns(context):
    flooded, quiet = Pair(context), Pair(context)
    recorder = Recorder()
    loop = ControlLoop("t", recorder.on_message, recorder.on_tick, batch=1000, budget_s=10.0)
    loop.add_socket(flooded.inbox)
    loop.add_socket(quiet.inbox)
    try:
        queued(flooded, 3000)
        queued(quiet, 3)
        run(loop, recorder, 3003)
    finally:
        flooded.close()
        quiet.close()
    first_quiet = [i for i, sock in enumerate(recorder.handled) if sock is quiet.inbox]
    assert len(first_quiet) == 3
    assert first_quiet[-1] < 10  # alternating with the flood, not after its 3,000 messages


def test_drops_beyond_a_burst_are_summarised(context, caplog):
    caplog.set_level(logging.WARNING, logger="dsa_bridge.transfer")
    recorder = Recorder()
    loop = ControlLoop("t", recorder.on_message, recorder.on_tick)
    flood(context, loop, recorder, 500, b"\xc1")
    lines = [r.getMessage() for r in caplog.records]
    one_by_one = [line for line in lines if "dropped a message: bad message" in line]
    summaries = [line for line in lines if "more messages in" in line]
    assert len(one_by_one) == control.LOG_BURST
    counted = sum(int(line.split("dropped ")[1].split()[0]) for line in summaries)
    assert counted == 500 - control.LOG_BURST and loop.bad_messages == 500
    assert all("last: bad message" in line for line in summaries)


def test_a_handler_bug_is_counted_and_logged_with_its_traceback(context, caplog):
    caplog.set_level(logging.WARNING, logger="dsa_bridge.transfer")
    pair = Pair(context)
    ticks = []

    def broken(sock, identity, message):
        raise KeyError("bug")

    loop = ControlLoop("t", broken, ticks.append)
    loop.add_socket(pair.inbox)
    try:
        pair.push.send(HEARTBEAT)
        loop.start()
        wait_for(lambda: loop.bad_messages == 1, 10, "the bug counted")
        wait_for(lambda: len(ticks) > 10, 10, "ticks after the bug")
    finally:
        loop.stop()
        pair.close()
    bugs = [r for r in caplog.records if "handling a message failed" in r.getMessage()]
    assert len(bugs) == 1 and bugs[0].exc_info is not None
    assert loop.last_error == "KeyError: 'bug'"


def cut_off_and_back(monitor: zmq.Socket, timeout_s: float = 10.0) -> None:
    """Wait for the monitored socket's connection to be closed, then made again."""
    events: list[int] = []
    deadline = time.monotonic() + timeout_s

    def back() -> bool:
        return zmq.EVENT_DISCONNECTED in events and \
            zmq.EVENT_CONNECTED in events[events.index(zmq.EVENT_DISCONNECTED):]

    while not back():
        assert time.monotonic() < deadline, f"no disconnect and reconnect: {events}"
        if monitor.poll(100):
            events.append(recv_monitor_message(monitor)["event"])


def test_a_message_beyond_the_receive_limit_never_arrives_and_its_sender_reconnects(context):
    pair = Pair(context, limit=1000)
    recorder = Recorder()
    loop = ControlLoop("t", recorder.on_message, recorder.on_tick)
    loop.add_socket(pair.inbox)
    monitor = pair.push.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)
    loop.start()
    try:
        pair.push.send(HEARTBEAT)
        wait_for(lambda: len(recorder.handled) == 1, 10, "a message within the limit")
        pair.push.send(b"\x00" * 1001)
        cut_off_and_back(monitor)
        pair.push.send(HEARTBEAT)  # the PUSH socket reconnected by itself
        wait_for(lambda: len(recorder.handled) == 2, 10, "a message after the reconnect")
    finally:
        loop.stop()
        pair.push.disable_monitor()
        monitor.close(0)
        pair.close()
    assert loop.bad_messages == 0  # never decoded, never counted: ZMQ dropped it
    assert loop._limits[pair.inbox] == 1000


def test_the_decoder_takes_the_sockets_limit(context):
    pair = Pair(context)
    loop = ControlLoop("t", Recorder().on_message, lambda now: None)
    loop.add_socket(pair.inbox)
    pair.close()
    assert loop._limits[pair.inbox] == protocol.MAX_MESSAGE_BYTES  # no limit set: the protocol's


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="batch must be >= 1"):
        ControlLoop("t", Recorder().on_message, lambda now: None, batch=0)
    with pytest.raises(ValueError, match="max_bytes must be positive"):
        limit_receive(None, 0)


def test_work_another_thread_hands_back_runs_on_the_loop_thread_at_its_wake_up(context):
    """``on_round`` runs on the loop's thread after every round, so that work another thread
    hands back (decode's messages held behind staged slices) runs as soon as that thread's send
    wakes the loop, not at the next tick; a round that raises does not stop the loop."""
    rounds, failed_once = [], threading.Event()

    def on_round(now: float) -> None:
        rounds.append(threading.current_thread().name)
        if not failed_once.is_set():
            failed_once.set()
            raise KeyError("a bug in a round")

    loop = ControlLoop("t", lambda *a: None, lambda now: None, poll_ms=60_000, on_round=on_round)
    pair = Pair(context)
    loop.start()
    try:
        wait_for(lambda: failed_once.is_set(), 10, "the first round ran")
        time.sleep(0.2)  # the loop now sleeps until its next tick, a minute away
        before = len(rounds)
        sent = time.monotonic()
        threading.Thread(target=loop.send, args=(pair.push, protocol.Heartbeat(1.0))).start()
        wait_for(lambda: len(rounds) > before, 10, "a round after the wake-up")
        assert time.monotonic() - sent < 5, "the round waited for a tick"
        assert set(rounds) == {"t-control"}, rounds
    finally:
        loop.stop()
        pair.close()
