"""Transfer engine backends: the factory.

``create_backend("mooncake" | "nixl", host=..., **options)`` builds one backend. The engine
packages are imported only inside the backend constructors, and the backend modules here only
when ``create_backend`` asks for one, so importing this package (or the backend modules) never
loads Mooncake, NIXL or torch.

The modules: ``base`` (the ``TransferBackend`` interface, its errors, the checks made before any
engine call, and ``EngineBackend``, the base of both engines), ``environment`` (what the engines
read of the machine: RDMA devices, network interfaces, start-up environment), ``mooncake`` and
``nixl`` (one engine each), ``shared`` (one engine shared by the nodes of a process).
"""

from __future__ import annotations

from .base import BackendUnavailable, TransferBackend

BACKENDS = ("mooncake", "nixl")


def create_backend(name: str, *, host: str = "127.0.0.1", **options: object) -> TransferBackend:
    """Build the backend ``name`` (one of ``BACKENDS``); ``options`` go to its constructor."""
    if name == "mooncake":
        from .mooncake import MooncakeBackend

        return MooncakeBackend(host=host, **options)
    if name == "nixl":
        from .nixl import NixlBackend

        return NixlBackend(host=host, **options)
    raise BackendUnavailable(name, "create", f"unknown backend; choose one of {', '.join(BACKENDS)}")
