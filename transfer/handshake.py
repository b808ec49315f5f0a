"""Handshake checks, pure: the peer's protocol version, engine, layout and buffers against ours.

Both sides run the same checks on what the other sent; any difference is a HandshakeError whose
message names the first differing field, before a single byte moves (invariants 1-3).
"""

from __future__ import annotations

from dsa_bridge.plugin.descriptors import BufferDescriptor, validate_descriptors
from dsa_bridge.plugin.layout import DSALayout
from dsa_bridge.transfer.plan import Buffer, BufferPair, PlanError, pair_buffers
from dsa_bridge.transfer.protocol import PROTOCOL_VERSION, BufferInfo


class HandshakeError(RuntimeError):
    """The peer cannot be paired with this node; the message names the first difference."""


def pool_buffers(pool) -> list[Buffer]:
    """The pool's validated descriptors (both caches, every layer) as planner buffers."""
    return [Buffer(d.layer_id, d.kind, d.ptr, d.nbytes, d.item_len) for d in pool.buffer_descriptors()]


def buffer_infos(buffers: list[Buffer]) -> list[BufferInfo]:
    return [BufferInfo(b.layer_id, b.kind, b.ptr, b.nbytes, b.item_len) for b in buffers]


def check_peer(local: DSALayout, backend: str, *, version: int, peer_backend: str,
               peer_layout: dict, peer_hash: str) -> DSALayout:
    """The peer's layout if it matches ours exactly; HandshakeError naming the difference."""
    if version != PROTOCOL_VERSION:
        raise HandshakeError(f"protocol version: peer {version} != local {PROTOCOL_VERSION}")
    if peer_backend != backend:
        raise HandshakeError(f"backend: peer {peer_backend!r} != local {backend!r}")
    try:
        layout = DSALayout.from_dict(peer_layout)
    except (ValueError, TypeError, KeyError) as exc:
        raise HandshakeError(f"peer layout is invalid: {exc}") from exc
    if layout.layout_hash() != peer_hash:
        raise HandshakeError("layout_hash: the peer's hash does not match the layout it sent")
    difference = local.first_difference(layout)
    if difference is not None:
        raise HandshakeError(f"layout mismatch: {difference} (local vs peer)")
    return layout


def pair_with_peer(layout: DSALayout, local: list[Buffer], peer: list[BufferInfo]) -> list[BufferPair]:
    """Validate the peer's announced buffers against the agreed layout and pair them with ours
    by global layer id; the pairs are the only addresses writes may ever target."""
    announced = [Buffer(b.layer_id, b.kind, b.ptr, b.nbytes, b.item_len) for b in peer]
    try:
        validate_descriptors(
            [BufferDescriptor(b.layer_id, b.kind, b.ptr, b.nbytes, b.item_len, "peer") for b in announced],
            layout,
        )
        return pair_buffers(local, announced)
    except (ValueError, PlanError) as exc:
        raise HandshakeError(f"peer buffers: {exc}") from exc
