"""The ``dsa-bridge`` command as the process tests start it: the real ``dsa_bridge.transfer.launcher.cli``
whose engine backends are wrapped in ``tests/faulty.py``'s test-only fault injection when a
``DSA_BRIDGE_FAULT_*`` variable is set (unchanged otherwise). Run as ``python -m tests.fault_cli``
from the repository root."""

from __future__ import annotations

import sys

from dsa_bridge.transfer import backends
from dsa_bridge.transfer.launcher import cli

from .faulty import wrap_from_env

_create_backend = backends.create_backend


def _create_faulty_backend(name: str, **options):
    return wrap_from_env(_create_backend(name, **options))


if __name__ == "__main__":
    backends.create_backend = _create_faulty_backend  # the command imports it when it runs
    sys.exit(cli.main())
