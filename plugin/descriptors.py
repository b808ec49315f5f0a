"""Typed buffer descriptors (what registration and transfer see) and their validation.

A descriptor is one registered region: ``(layer_id, kind, ptr, nbytes, item_len, device)``, page
``p`` of it at ``ptr + p * item_len``. ``validate_descriptors`` is the gate every list passes
before it is registered or published: no zero-size or null region (the seed's IMA), no overlap,
every layer paired with both caches, item lengths equal to the layout's page sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from .layout import DSALayout

CacheKind = Literal["kv", "index"]
CACHE_KINDS: tuple[str, ...] = ("kv", "index")


@dataclass(frozen=True)
class BufferDescriptor:
    """One registered buffer of one layer: ``kind`` "kv" (MLA pages) or "index" (indexer pages)."""

    layer_id: int
    kind: str
    ptr: int
    nbytes: int
    item_len: int
    device: str

    @property
    def num_items(self) -> int:
        return self.nbytes // self.item_len

    @property
    def end(self) -> int:
        return self.ptr + self.nbytes

    def name(self) -> str:
        return f"layer {self.layer_id} {self.kind}"


def page_bytes(layout: DSALayout, kind: str) -> int:
    """The item_len a buffer of ``kind`` must have under ``layout``."""
    if kind == "kv":
        return layout.kv_page_bytes
    if kind == "index":
        return layout.index_page_bytes
    raise ValueError(f"kind must be one of {CACHE_KINDS}, got {kind!r}")


def _check_one(d: BufferDescriptor) -> None:
    if d.kind not in CACHE_KINDS:
        raise ValueError(f"layer {d.layer_id}: kind must be one of {CACHE_KINDS}, got {d.kind!r}")
    if d.nbytes <= 0:
        raise ValueError(f"{d.name()}: nbytes is {d.nbytes} (zero-size buffer)")
    if d.ptr <= 0:
        raise ValueError(f"{d.name()}: {'null' if d.ptr == 0 else 'negative'} pointer {d.ptr}")
    if d.item_len <= 0:
        raise ValueError(f"{d.name()}: item_len is {d.item_len}")
    if d.nbytes % d.item_len:
        raise ValueError(
            f"{d.name()}: nbytes {d.nbytes} is not a multiple of item_len {d.item_len}"
        )


def _check_overlap(descs: Sequence[BufferDescriptor]) -> None:
    """Any two buffers on the same device overlapping -> error naming both (sort + sweep)."""
    ordered = sorted(descs, key=lambda d: (d.device, d.ptr))
    widest: BufferDescriptor | None = None  # the buffer reaching furthest so far on this device
    for d in ordered:
        if widest is not None and widest.device == d.device and d.ptr < widest.end:
            raise ValueError(
                f"{d.name()} [{d.ptr:#x}, {d.end:#x}) overlaps {widest.name()} "
                f"[{widest.ptr:#x}, {widest.end:#x})"
            )
        if widest is None or widest.device != d.device or d.end > widest.end:
            widest = d


def validate_descriptors(
    descs: Sequence[BufferDescriptor], layout: DSALayout | None = None
) -> None:
    """Raise ValueError naming the layer (and kind) on the first problem; see module docstring."""
    seen: dict[tuple[int, str], BufferDescriptor] = {}
    for d in descs:
        _check_one(d)
        key = (d.layer_id, d.kind)
        if key in seen:
            raise ValueError(f"{d.name()}: duplicate descriptor")
        seen[key] = d
    layers = sorted({lid for lid, _ in seen})
    for lid in layers:
        for kind in CACHE_KINDS:
            if (lid, kind) not in seen:
                other = "an index" if kind == "kv" else "a kv"
                raise ValueError(f"layer {lid}: has {other} buffer but no {kind} buffer")
    _check_overlap(descs)
    if layout is None:
        return
    for d in descs:
        want = page_bytes(layout, d.kind)
        if d.item_len != want:
            raise ValueError(f"{d.name()}: item_len {d.item_len} != layout's {want}")
    missing = sorted(set(layout.layer_ids) - set(layers))
    if missing:
        raise ValueError(f"layer {missing[0]}: in the layout but has no buffers")
    extra = sorted(set(layers) - set(layout.layer_ids))
    if extra:
        raise ValueError(f"layer {extra[0]}: has buffers but is not in the layout")


def to_three_lists(
    descs: Sequence[BufferDescriptor],
) -> tuple[list[int], list[int], list[int]]:
    """SGLang's ``KVArgs`` form: ``(data_ptrs, data_lens, item_lens)`` in the given order."""
    return [d.ptr for d in descs], [d.nbytes for d in descs], [d.item_len for d in descs]
