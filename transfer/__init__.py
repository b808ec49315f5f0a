"""dsa_bridge.transfer: the wire side, what a user of the transfer needs in one import.

    from dsa_bridge.transfer import PrefillNode, DecodeNode, create_backend, KVPoll

The nodes (``PrefillNode`` with a ``KVSender`` per request, ``DecodeNode`` with a
``KVReceiver``), the engine backends' factory, the request states and the errors a caller may
catch. The modules behind them, and the order to read them in: docs/architecture.md.

Each name is imported from its module on first use, so that importing one submodule (the
backends, the launcher's option checks) does not load the nodes and torch with it.
"""

from __future__ import annotations

import importlib

EXPORTS = {
    "BACKENDS": ".backends",
    "create_backend": ".backends",
    "BackendError": ".backends.base",
    "BackendUnavailable": ".backends.base",
    "TransferBackend": ".backends.base",
    "TransferTimeout": ".backends.base",
    "DecodeNode": ".decode",
    "KVReceiver": ".decode",
    "HandshakeError": ".handshake",
    "PlanError": ".plan",
    "KVSender": ".prefill",
    "PrefillNode": ".prefill",
    "ProtocolError": ".protocol",
    "KVPoll": ".request",
    "TERMINAL": ".request",
    "TransferFailed": ".request",
}
__all__ = sorted(EXPORTS)


def __getattr__(name: str) -> object:
    if name not in EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *EXPORTS})
