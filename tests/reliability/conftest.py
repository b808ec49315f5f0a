"""Fixtures of the reliability tier: hosts (namespaces or loopback), processes, the ledger.

- ``hosts``: a factory of ``Host`` lists, parametrized ``netns`` (each node its own network
  namespace) and ``loopback`` (every node on 127.0.0.1). Exactly one of the two runs: the netns
  variant where namespaces can be made, else it skips with the reason and the loopback variant
  runs the same scenario. Namespaces are deleted at teardown whatever happened.
- ``procs``: the test's process registry; teardown stops every process by PID and asserts that
  none is left.
- ``ledger``: what the test injected or tried and what came out; the run's table is printed at the
  end of the session (docs/reliability.md is that table). A test that fails because a bounded wait
  expired (``Hang``, a subprocess timeout, or ``wait_for``'s "... not reached within ...") counts
  as a hang.
- ``engine_environment`` (every test): the engine, node and SGLang settings the caller exported
  are cleared, in this process and so in every process a test starts; a test sets what it needs.
- Tests marked ``soak`` (the long variants) run only when selected with ``-m soak``.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields

import pytest

from ..conftest import clear_engine_environment
from .netns import Host, Topology, loopback_hosts, unavailable
from .procs import Hang, Processes

TIMED_OUT = "not reached within"  # the message of tests.transfer.helpers.wait_for's timeout


@dataclass
class Row:
    tests: int = 0
    tried: int = 0
    ok: int = 0
    failed: int = 0
    bytes_verified: int = 0
    bytes_lost: int = 0
    hangs: int = 0


HEADERS = ("tests", "injected / tried", "requests ok", "failed or refused with a reason",
           "bytes verified", "bytes lost", "hangs")
ORDER = ("multi-node", "faults injected", "bad inputs tried", "requests under load")
_rows: dict[str, Row] = {}
_categories: dict[str, str] = {}


class Ledger:
    def __init__(self, category: str):
        self.category = category

    def record(self, *, tried: int, ok: int = 0, failed: int = 0, bytes_verified: int = 0,
               bytes_lost: int = 0) -> None:
        row = _rows.setdefault(self.category, Row())
        row.tried += tried
        row.ok += ok
        row.failed += failed
        row.bytes_verified += bytes_verified
        row.bytes_lost += bytes_lost


@pytest.fixture(autouse=True)
def engine_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_engine_environment(monkeypatch)


@pytest.fixture
def ledger(request: pytest.FixtureRequest) -> Ledger:
    return Ledger(request.module.CATEGORY)


@pytest.fixture
def procs(tmp_path) -> Iterator[Processes]:
    registry = Processes(tmp_path)
    try:
        yield registry
    finally:
        registry.stop_all()


@pytest.fixture(scope="session")
def secret_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("secret") / "secret"
    path.write_text("reliability-tier-shared-secret\n")
    path.chmod(0o600)
    return str(path)


@pytest.fixture(params=["netns", "loopback"])
def hosts(request: pytest.FixtureRequest) -> Iterator[Callable[[int], list[Host]]]:
    """``hosts(n)``: n hosts, each its own namespace and address (or all on 127.0.0.1)."""
    made: list[Topology] = []
    reason = unavailable()
    if request.param == "netns" and reason:
        pytest.skip(f"netns variant skipped: {reason}; the loopback variant runs instead")
    if request.param == "loopback" and not reason:
        pytest.skip("loopback variant skipped: the netns variant ran the same scenario")

    def make(count: int) -> list[Host]:
        if request.param == "loopback":
            return loopback_hosts(count)
        made.append(Topology(count))
        return made[-1].hosts

    try:
        yield make
    finally:
        for topology in made:
            topology.delete()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    selected = "soak" in (config.option.markexpr or "")
    for item in items:
        category = getattr(item.module, "CATEGORY", None)
        if category is None:
            continue
        _categories[item.nodeid] = category
        if item.get_closest_marker("soak") and not selected:
            item.add_marker(pytest.mark.skip(reason="long soak: run with -m soak"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    category = _categories.get(item.nodeid)
    report = outcome.get_result()
    if category is None or report.skipped or (call.when != "call" and not report.failed):
        return
    row = _rows.setdefault(category, Row())
    row.tests += call.when == "call"
    if call.excinfo is not None and (call.excinfo.errisinstance((Hang, subprocess.TimeoutExpired))
                                     or str(call.excinfo.value).startswith("Timeout")
                                     or TIMED_OUT in str(call.excinfo.value)):
        row.hangs += 1


def pytest_terminal_summary(terminalreporter) -> None:
    if not _rows:
        return
    write = terminalreporter.write_line
    write("")
    write("dsa-bridge reliability tier (docs/reliability.md):")
    write("| | " + " | ".join(HEADERS) + " |")
    write("|---" * (len(HEADERS) + 1) + "|")
    total = Row()
    for category, row in sorted(_rows.items(), key=lambda item: ORDER.index(item[0])):
        write(f"| {category} | " + " | ".join(f"{getattr(row, f.name):,}" for f in fields(row)) + " |")
        for f in fields(row):
            setattr(total, f.name, getattr(total, f.name) + getattr(row, f.name))
    write("| **total** | " + " | ".join(f"{getattr(total, f.name):,}" for f in fields(total)) + " |")
