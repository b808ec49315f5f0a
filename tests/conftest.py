"""Suite-wide: which engines and devices this machine has, skips with reasons, a closing report
of every skipped suite so a green run cannot hide one, the clearing of the engine settings a
caller may have exported (tests that start engines set what they need themselves), one torch
thread per test process, the ``slow`` mark of the tiers that start OS processes, the fork
server those processes start from (``forkserver.py``: torch imported once), stopped at the end,
and the node fixtures the folders share (``engine``, ``made``, ``nodes``).

The folders are named after the code they test (``tests/test_structure.py``: ``TEST_FOLDERS``);
``integration``, ``reliability`` and ``gpu`` are the tiers that run the nodes as OS processes.

The edit loop's tier is ``pytest -m "not slow"``: every unit of the code over the fake and the real
engines, without the process tiers (``SLOW_TIERS``: each of their tests starts node processes and
runs for seconds), without the few tests marked ``slow`` where they stand (a process each, or
hundreds of generated examples), and with a test that runs once per engine run on NIXL only
(an agent starts in well under a second; a Mooncake engine takes about one to stop), except in
tests/backends, where the engine is the point.

One thread, because torch's intra-op threads wait for each other at every parallel operation:
on two cores shared with other processes, a byte check that takes 6 s ran for 3 min 42 s with
two threads and 9 s with one (``test_fuzz`` next to six busy processes). The processes the tests
start inherit it through ``OMP_NUM_THREADS``, unless the caller set it."""

from __future__ import annotations

import collections
import functools
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported, for this process too

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from dsa_bridge.transfer.backends import create_backend  # noqa: E402
from dsa_bridge.transfer.backends.base import BackendUnavailable  # noqa: E402
from dsa_bridge.transfer.decode import DecodeNode  # noqa: E402
from dsa_bridge.transfer.prefill import PrefillNode  # noqa: E402
from tests import forkserver  # noqa: E402
from tests.transfer.fake_backend import FakeBackend  # noqa: E402
from tests.transfer.helpers import make_pool  # noqa: E402

forkserver.preload(forkserver.MAIN_PRELOAD)  # the SGLang tier's conftest preloads sglang

# Hypothesis fails an example that runs over 200 ms of wall time: on two cores shared with other
# work a healthy example can (a loaded run failed test_pieces_cover_exactly_the_same_bytes so).
# pytest-timeout bounds a real hang; every generated example still runs.
settings.register_profile("dsa-bridge", deadline=None)
settings.load_profile("dsa-bridge")


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


# folders of tests/ whose tests start node processes: all ``slow``
SLOW_TIERS = ("integration", "reliability", "gpu")
ENGINE_PARAMS = ("engine", "backend", "backend_name")  # the fixtures and arguments naming one
FAST_TIER_ENGINE = "nixl"


# run first: the folders whose files take minutes, so that under ``-n`` (pytest-xdist hands whole
# files out in the order collected) the short files fill the end instead of waiting on a long one
LONG_FIRST = (*SLOW_TIERS, "bench")


def folder_of(item: pytest.Item) -> str:
    tests = Path(__file__).parent
    return item.path.relative_to(tests).parts[0] if item.path.is_relative_to(tests) else ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        folder = folder_of(item)
        params = getattr(getattr(item, "callspec", None), "params", {})
        engines = {params[name] for name in ENGINE_PARAMS if name in params}
        if folder in SLOW_TIERS or (folder != "backends" and engines - {FAST_TIER_ENGINE}):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: folder_of(item) not in LONG_FIRST)  # stable: files stay whole


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


@pytest.fixture(params=["mooncake", "nixl"])
def engine(request, monkeypatch):
    """Each real engine in turn (a missing one skips), the caller's engine settings cleared."""
    require_engine(request.param)
    clear_engine_environment(monkeypatch)
    return request.param


@pytest.fixture
def made():
    """The nodes a test made, closed at its end, the last made first."""
    nodes = []
    yield nodes
    for node in reversed(nodes):
        node.close()


@pytest.fixture
def nodes():
    """A prefill and a decode node over the fake engine; closed by the test's teardown."""
    made = []

    def build(prefill_pool=None, decode_pool=None, *, fail_every=0, **decode_kw):
        prefill = PrefillNode(prefill_pool or make_pool(), FakeBackend(fail_every=fail_every),
                              peer_timeout_s=1.0, heartbeat_s=0.1)
        made.append(prefill)
        decode = DecodeNode(decode_pool or make_pool(size=64 * 24, sentinel=True), FakeBackend(),
                            prefill.endpoint, **{"peer_timeout_s": 1.0, "heartbeat_s": 0.1, **decode_kw})
        made.append(decode)
        return prefill, decode

    yield build
    for node in reversed(made):
        node.close()


@pytest.fixture(scope="session", autouse=True)
def fork_server_stopped():
    """The node processes' fork server (``forkserver.py``), if a test started it, stopped at the
    end of the session."""
    yield
    forkserver.stop_server()
