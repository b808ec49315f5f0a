"""The bench's command channel (``transfer/bench/channel.py``): a driven process that cannot be
started leaves no ZMQ socket or context behind (an open one hangs the interpreter when the
context is collected), and one that starts is asked, answered and stopped by its PID."""

from __future__ import annotations

import sys

import pytest

from dsa_bridge.transfer.bench import channel
from dsa_bridge.transfer.bench.channel import Driven


def test_a_process_that_cannot_start_leaves_nothing_open(monkeypatch):
    made = []
    context_class = channel.zmq.Context

    def recording_context(*args, **kwargs):
        made.append(context_class(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(channel.zmq, "Context", recording_context)
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    with pytest.raises(FileNotFoundError):
        Driven("ghost", "json.tool", [], start_timeout_s=5, command_timeout_s=5)
    assert len(made) == 1 and made[0].closed


def test_a_started_process_answers_and_is_stopped_by_its_pid():
    driven = Driven("echo", "tests.bench.echo_driven", [], start_timeout_s=60,
                    command_timeout_s=30)
    try:
        assert driven.reply()["pid"] == driven.process.pid
        assert driven.call("echo", value=7) == {"ok": True, "value": 7}
        with pytest.raises(RuntimeError, match="unknown command 'nope'"):
            driven.call("nope")
    finally:
        driven.stop()
    assert driven.process.returncode == 0
