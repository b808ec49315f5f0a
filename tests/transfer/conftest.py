"""Fixtures of the transfer tests that run real nodes in one process: ``engine``, each real engine
in turn (a missing one skips), and ``made``, the nodes a test made, closed at its end."""

from __future__ import annotations

import pytest

from ..conftest import clear_engine_environment, require_engine


@pytest.fixture(params=["mooncake", "nixl"])
def engine(request, monkeypatch):
    require_engine(request.param)
    clear_engine_environment(monkeypatch)
    return request.param


@pytest.fixture
def made():
    nodes = []
    yield nodes
    for node in reversed(nodes):
        node.close()
