"""Handshake checks, pure: the peer's protocol version, engine, layout and buffers against ours,
and which (layer, cache) buffers a prefill node writes into a decode node.

Both sides run the same checks on what the other sent; any difference is a HandshakeError whose
message names the first difference, before a single byte moves (invariants 1-3). The byte
geometry (page size, dtypes, dims) must be equal; the layer sets may differ:

- a prefill node may hold a layer range of decode's layers (a pipeline stage), never a layer
  decode lacks;
- for the layers prefill holds, it writes every KV buffer, and the indexer of every layer whose
  indexer decode holds **and reads**; it must hold each of those itself. So uniform prefill ->
  compact decode sends only decode's indexer layers; compact prefill -> uniform decode is refused
  unless decode declares it reads only the producer layers' indexers;
- the prefill nodes of one request together hold each of decode's layers exactly once.

What a peer announces is bounded before it is looked at one element at a time: the decoder
refuses more than ``protocol.MAX_BUFFERS`` buffers or ``MAX_LAYERS`` indexer reads, ``check_peer``
a layout of more than ``MAX_LAYERS`` layers before building it, ``pair_with_peer`` a buffer list
whose length is not exactly what the peer's layout holds before checking any buffer; every check
after that is linear in the (bounded) count, or n log n for the overlap sweep.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from ..plugin.descriptors import BufferDescriptor, BufferKey, validate_descriptors
from ..plugin.layout import DSALayout
from .plan import PairTable, PlanError, pair_buffers
from .protocol import MAX_BUFFERS, MAX_LAYERS, PROTOCOL_VERSION


class HandshakeError(RuntimeError):
    """The peer cannot be paired with this node; the message names the first difference."""


def pool_buffers(pool) -> list[BufferDescriptor]:
    """The pool's validated descriptors: every buffer it holds, registered, announced, planned."""
    return list(pool.buffer_descriptors())


def buffer_infos(buffers: list[BufferDescriptor]) -> list[BufferDescriptor]:
    """Our buffers as a Hello announces them; HandshakeError if the protocol cannot carry them."""
    if len(buffers) > MAX_BUFFERS:
        raise HandshakeError(f"buffers: this node holds {len(buffers)}, more than the "
                             f"{MAX_BUFFERS} a Hello carries")
    return list(buffers)


def check_layer_counts(peer_layout: object) -> None:
    """A peer's layout lists at most MAX_LAYERS layers (checked before it is built)."""
    if not isinstance(peer_layout, dict):
        return  # DSALayout.from_dict names the problem
    for name in ("layer_ids", "index_layer_ids"):
        value = peer_layout.get(name)
        if isinstance(value, (list, tuple)) and len(value) > MAX_LAYERS:
            raise HandshakeError(f"peer layout is invalid: {name} lists {len(value)} layers, more "
                                 f"than the {MAX_LAYERS} the protocol carries")


def check_peer(local: DSALayout, backend: str, *, version: int, peer_backend: str,
               peer_layout: dict, peer_hash: str) -> DSALayout:
    """The peer's layout if its byte geometry matches ours; HandshakeError naming the difference.
    Which layers each side holds is ``transfer_set``'s business."""
    if version != PROTOCOL_VERSION:
        raise HandshakeError(f"protocol version: peer {version} != local {PROTOCOL_VERSION}")
    if peer_backend != backend:
        raise HandshakeError(f"backend: peer {peer_backend!r} != local {backend!r}")
    check_layer_counts(peer_layout)
    try:
        layout = DSALayout.from_dict(peer_layout)
    except (ValueError, TypeError, KeyError) as exc:
        raise HandshakeError(f"peer layout is invalid: {exc}") from exc
    if layout.layout_hash() != peer_hash:
        raise HandshakeError("layout_hash: the peer's hash does not match the layout it sent")
    difference = local.geometry_difference(layout)
    if difference is not None:
        raise HandshakeError(f"layout mismatch: {difference} (local vs peer)")
    return layout


def check_index_reads(decode: DSALayout, reads: Iterable[int] | None) -> tuple[int, ...]:
    """The indexer layers decode's attention reads: all it holds by default; never one it lacks."""
    if reads is None:
        return decode.index_layer_ids
    ids = tuple(sorted(set(reads)))
    held = set(decode.index_layer_ids)
    stray = [lid for lid in ids if lid not in held]
    if stray:
        raise ValueError(f"index_reads: layer {stray[0]}: decode cannot read an indexer it lacks "
                         f"({decode.absent_indexer(stray[0])})")
    return ids


def check_kv_on_index_pages(decode: DSALayout, layers: Iterable[int]) -> frozenset[int]:
    """The layers whose KV decode keeps with its indexer (``plan.on_index_pages``): each a layer
    of its layout, none named twice; ValueError otherwise."""
    ids = list(layers)
    if len(set(ids)) != len(ids):
        raise ValueError("kv_on_index_pages names a layer twice")
    stray = [lid for lid in ids if lid not in set(decode.layer_ids)]
    if stray:
        raise ValueError(f"kv_on_index_pages: layer {stray[0]} is not a layer of decode's pool")
    return frozenset(ids)


def transfer_set(prefill: DSALayout, decode: DSALayout, index_reads: Sequence[int]) -> list[BufferKey]:
    """The (layer, kind) buffers prefill writes into decode for every request, in layer order;
    HandshakeError naming the first layer that makes the pair impossible (see module docstring)."""
    stray = [lid for lid in prefill.layer_ids if lid not in decode.layer_ids]
    if stray:
        raise HandshakeError(f"layer sets: prefill holds layer {stray[0]}, which decode does not")
    reads = set(index_reads)
    keys: list[BufferKey] = []
    for lid in prefill.layer_ids:
        keys.append((lid, "kv"))
        if decode.holds_indexer(lid) and lid in reads:
            if not prefill.holds_indexer(lid):
                raise HandshakeError(
                    f"layer sets: layer {lid}: decode holds and reads its indexer, but "
                    f"{prefill.absent_indexer(lid)} on prefill; a decode that reads only the "
                    "producer layers' indexers must say so")
            keys.append((lid, "index"))
    return keys


def check_stages(decode: DSALayout, stages: Sequence[tuple[str, DSALayout]]) -> None:
    """The prefill nodes ``(name, layout)`` of one request hold each of decode's layers exactly
    once; ValueError naming the first layer held twice or by none."""
    owner: dict[int, str] = {}
    for name, layout in stages:
        for lid in layout.layer_ids:
            if lid in owner:
                raise ValueError(f"layer {lid} is held by both prefill {owner[lid]} and prefill {name}")
            owner[lid] = name
    missing = [lid for lid in decode.layer_ids if lid not in owner]
    if missing:
        names = ", ".join(name for name, _ in stages)
        raise ValueError(f"layer {missing[0]}: none of the request's prefill nodes ({names}) holds it")


def check_shares(decode: DSALayout, writers: Sequence[tuple[str, DSALayout]]) -> None:
    """The prefill nodes ``(name, layout)`` that each write a share of a request's pages hold
    every one of decode's layers; ValueError naming the first layer one of them lacks."""
    for name, layout in writers:
        missing = [lid for lid in decode.layer_ids if lid not in set(layout.layer_ids)]
        if missing:
            raise ValueError(f"layer {missing[0]}: prefill {name} writes a share of the pages "
                             "and does not hold it")


def pair_with_peer(peer_layout: DSALayout, local: list[BufferDescriptor], peer: list[BufferDescriptor],
                   keys: Sequence[BufferKey]) -> PairTable:
    """Validate the peer's announced buffers against its layout and pair the ``keys`` buffers
    with ours by global layer id; the pairs are the only addresses writes may ever target. The
    count is checked first: exactly one buffer per layer and one per indexer of its layout."""
    expected = peer_layout.num_layers + len(peer_layout.index_layer_ids)
    if len(peer) != expected:
        raise HandshakeError(f"peer buffers: {len(peer)} announced, but its layout holds {expected} "
                             f"({peer_layout.num_layers} KV, {len(peer_layout.index_layer_ids)} indexer)")
    try:  # one address space: the device names a peer gives cannot separate overlapping buffers
        validate_descriptors([msgspec.structs.replace(b, device="peer") for b in peer], peer_layout)
        return pair_buffers(local, list(peer), keys)
    except (ValueError, PlanError) as exc:
        raise HandshakeError(f"peer buffers: {exc}") from exc
