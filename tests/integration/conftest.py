"""The integration tests' engine parameter: every test module here runs once per engine."""

from __future__ import annotations

import pytest

from dsa_bridge.transfer.backends import BACKENDS

from ..conftest import require_engine


@pytest.fixture(params=BACKENDS, scope="module")
def backend(request):
    require_engine(request.param)
    return request.param
