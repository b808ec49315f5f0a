"""Suite-wide: which engines and devices this machine has, skips with reasons, a closing report
of every skipped suite so a green run cannot hide one, and the clearing of the engine settings a
caller may have exported (tests that start engines set what they need themselves)."""

from __future__ import annotations

import collections
import functools
import os

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


# Variables that change how an engine (UCX_, MC_, NIXL_), a node (DSA_BRIDGE_: secret, log level,
# the fault hooks of tests/faulty.py) or the SGLang adapter behaves.
ENGINE_ENV_PREFIXES = ("UCX_", "MC_", "NIXL_", "DSA_BRIDGE_", "SGLANG_")
INSTALL_PATHS = frozenset({"NIXL_PLUGIN_DIR", "UCX_MODULE_DIR"})  # where, not how: kept


def clear_engine_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset every engine, node and SGLang setting the caller exported (``UCX_NET_DEVICES=lo`` is
    common for UCX on loopback), for this process and the processes it starts; ``monkeypatch``
    restores them afterwards. A test then sets what it depends on itself."""
    for key in sorted(os.environ):
        if key.startswith(ENGINE_ENV_PREFIXES) and key not in INSTALL_PATHS:
            monkeypatch.delenv(key)


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
