"""The integration tests' engine parameter: every test module here runs once per engine, with the
engine settings the caller exported cleared (the processes a module starts inherit that)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dsa_bridge.transfer.backends import BACKENDS

from ..conftest import clear_engine_environment, require_engine


@pytest.fixture(scope="module", autouse=True)
def engine_environment() -> Iterator[None]:
    """Module-scoped (the modules' own fixtures start processes once per module): the caller's
    UCX_, MC_, NIXL_, DSA_BRIDGE_ and SGLANG_ settings cleared, restored after the module."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        clear_engine_environment(monkeypatch)
        yield


@pytest.fixture(params=BACKENDS, scope="module")
def backend(request):
    require_engine(request.param)
    return request.param
