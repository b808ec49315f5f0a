"""The factory: lazy engine imports, clear errors when an engine cannot be used."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dsa_bridge.transfer.backends import BACKENDS, create_backend
from dsa_bridge.transfer.backends.base import BackendError, BackendUnavailable
from dsa_bridge.transfer.backends.nixl import UCX_PARAMS

from ..conftest import require_engine

ENGINE_MODULES = {
    "mooncake": ("mooncake", "mooncake.engine"),
    "nixl": ("nixl_cu12._api", "nixl_cu13._api", "nixl._api"),
}


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_importing_the_package_imports_no_engine() -> None:
    code = (
        "import sys, dsa_bridge.transfer.backends, dsa_bridge.transfer.backends.mooncake, "
        "dsa_bridge.transfer.backends.nixl\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in "
        "('mooncake', 'nixl', 'nixl_cu12', 'nixl_cu13', 'torch')]\n"
        "sys.exit(1 if loaded else 0)"
    )
    result = run_python(code)
    assert result.returncode == 0, result.stderr


def test_unknown_backend() -> None:
    assert BACKENDS == ("mooncake", "nixl")
    with pytest.raises(BackendUnavailable, match="mooncake, nixl"):
        create_backend("gloo")


@pytest.mark.parametrize("name", BACKENDS)
def test_missing_package_names_what_to_install(name: str, monkeypatch) -> None:
    for module in ENGINE_MODULES[name]:
        monkeypatch.setitem(sys.modules, module, None)
    wheels = {"mooncake": ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine-cuda13",
                           "or mooncake-transfer-engine ("), "nixl": ("nixl-cu12", "nixl-cu13")}[name]
    with pytest.raises(BackendUnavailable) as info:
        create_backend(name)
    assert all(wheel in str(info.value) for wheel in wheels)  # CPU hosts' and CUDA hosts' wheels


def test_nixl_without_a_usable_ucx_transport_is_unavailable() -> None:
    code = (
        "import sys\n"
        "from dsa_bridge.transfer.backends import create_backend\n"
        "from dsa_bridge.transfer.backends.base import BackendError, BackendUnavailable\n"
        "try:\n"
        "    create_backend('nixl')\n"
        "except BackendUnavailable as exc:\n"
        "    sys.stderr.write(str(exc))\n"
        "    sys.exit(3)\n"
    )
    result = run_python(code, UCX_TLS="no-such-transport")
    assert result.returncode == 3, result.stderr
    assert "UCX_TLS=no-such-transport" in result.stderr


def test_mooncake_refuses_a_host_name() -> None:
    with pytest.raises(BackendError, match="numeric IPv4"):
        create_backend("mooncake", host="localhost")


@pytest.mark.parametrize("options", [{"max_batch": 0}, {"batches_in_flight": 0},
                                     {"max_batch": 1024, "batches_in_flight": 3},
                                     {"max_batch": 2049, "batches_in_flight": 1}])
def test_mooncake_refuses_more_entries_in_flight_than_a_peer_takes(options: dict) -> None:
    """Over 2048 entries in flight to one peer, Mooncake fails a batch with part of it written
    or stalls to its transfer timeout (measured): refused before an engine starts."""
    with pytest.raises(BackendError, match="must be between 1 and 2048"):
        create_backend("mooncake", **options)


def test_nixl_posts_on_worker_threads_unless_the_operator_says_otherwise() -> None:
    """NIXL's UCX backend splits a post of over ``split_batch_size`` descriptors across
    ``num_threads`` workers: a fragmented write moves about 1.5x faster (docs/engines.md). Given
    backend parameters win over these defaults; the others stay."""
    require_engine("nixl")
    threaded = create_backend("nixl")
    told = create_backend("nixl", backend_params={"num_threads": "0"})
    try:
        assert threaded._agent.get_backend_params("UCX") == UCX_PARAMS == {
            "num_threads": "2", "split_batch_size": "32"}
        assert told._agent.get_backend_params("UCX") == {"num_threads": "0",
                                                         "split_batch_size": "32"}
    finally:
        threaded.close()
        told.close()
