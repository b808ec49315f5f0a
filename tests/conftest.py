"""Suite-wide: which engines and devices this machine has, skips with reasons, and a closing
report of every skipped suite so a green run cannot hide one."""

from __future__ import annotations

import collections
import functools

import pytest

from dsa_bridge.transfer.backends import create_backend
from dsa_bridge.transfer.backends.base import BackendUnavailable


@functools.cache
def engine_problem(name: str) -> str | None:
    """None when engine ``name`` starts here; otherwise why not."""
    try:
        create_backend(name).close()
    except BackendUnavailable as exc:
        return str(exc)
    return None


def require_engine(name: str) -> None:
    problem = engine_problem(name)
    if problem:
        pytest.skip(f"engine {name} unavailable: {problem}")


def pytest_terminal_summary(terminalreporter):
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        terminalreporter.write_line("dsa-bridge: no suite was skipped")
        return
    reasons = collections.Counter(str(report.longrepr[2]) for report in skipped
                                  if isinstance(report.longrepr, tuple))
    terminalreporter.section("dsa-bridge: skipped suites")
    for reason, count in reasons.most_common():
        terminalreporter.write_line(f"{count:4d} skipped: {reason}")
