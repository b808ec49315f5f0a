"""Typed buffer descriptors (what registration and transfer see) and their validation.

A descriptor is one registered region: ``(layer_id, kind, ptr, nbytes, item_len, device)``, page
``p`` of it at ``ptr + p * item_len``. ``validate_descriptors`` is the gate every list passes
before it is registered or published: no zero-size or null region (the seed's IMA), no overlap,
every layer with a KV buffer, indexer buffers exactly where the layout has them, item lengths
equal to the layout's page sizes.

``BufferSet.from_buf_infos`` takes buffers in SGLang's three-list form with their layer ids —
including SGLang 0.5.23's zero-row form, where an index-sharing layer's indexer entry is
``(0, 0, 0)`` — and normalises them by layer id: a zero-length indexer entry becomes an absent
one (logged, never registered or planned); anything else odd is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Annotated, Literal

import msgspec

from .layout import DSALayout

log = logging.getLogger(__name__)

CacheKind = Literal["kv", "index"]
CACHE_KINDS: tuple[str, ...] = ("kv", "index")
BufferKey = tuple[int, str]  # (global layer id, cache kind): one buffer of a pool
ADDRESS_LIMIT = 2**63  # no real buffer ends there; engines take addresses as int64
MAX_KIND_CHARS = 8  # "kv", "index", "aux", "raw"
MAX_DEVICE_CHARS = 16  # "cpu", "cuda:15"


class BufferDescriptor(msgspec.Struct, frozen=True, array_like=True):
    """One registered region, the one type the pool publishes, the engines register, the
    handshake sends and the planner addresses: a buffer of one layer, ``kind`` "kv" (MLA pages)
    or "index" (indexer pages), page ``p`` at ``ptr + p * item_len``; an aux buffer (``kind``
    "aux", ``layer_id`` its position, one request slot per item); or, from ``raw_region``, raw
    memory registered with an engine outside any pool (``kind`` "raw"). ``kind`` and ``device``
    are bounded so that a peer's list decodes within a known size."""

    layer_id: int
    kind: Annotated[str, msgspec.Meta(max_length=MAX_KIND_CHARS)]
    ptr: int
    nbytes: int
    item_len: int
    device: Annotated[str, msgspec.Meta(max_length=MAX_DEVICE_CHARS)] = "cpu"

    @property
    def num_items(self) -> int:
        return self.nbytes // self.item_len

    @property
    def end(self) -> int:
        return self.ptr + self.nbytes

    def name(self) -> str:
        return f"layer {self.layer_id} {self.kind}"


def raw_region(ptr: int, nbytes: int, device: str = "cpu") -> BufferDescriptor:
    """Raw memory to register with an engine, outside any pool (one item of ``nbytes``)."""
    return BufferDescriptor(-1, "raw", ptr, nbytes, max(nbytes, 1), device)


def page_bytes(layout: DSALayout, kind: str) -> int:
    """The item_len a buffer of ``kind`` must have under ``layout``."""
    if kind == "kv":
        return layout.kv_page_bytes
    if kind == "index":
        return layout.index_page_bytes
    raise ValueError(f"kind must be one of {CACHE_KINDS}, got {kind!r}")


def _check_one(d: BufferDescriptor) -> None:
    """One descriptor on its own; the error names the field: layer_id, kind, ptr, nbytes,
    item_len. Constant time: the gate a peer's announced buffers pass one by one."""
    for field in ("layer_id", "ptr", "nbytes", "item_len"):
        value = getattr(d, field)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"layer {d.layer_id!r}: {field} must be an int, got {value!r}")
    if d.layer_id < 0:
        raise ValueError(f"layer {d.layer_id}: layer_id must be >= 0")
    if d.kind not in CACHE_KINDS:
        raise ValueError(f"layer {d.layer_id}: kind must be one of {CACHE_KINDS}, got {d.kind!r}")
    if d.nbytes <= 0:
        raise ValueError(f"{d.name()}: nbytes is {d.nbytes} (zero-size buffer)")
    if d.ptr <= 0:
        raise ValueError(f"{d.name()}: {'null' if d.ptr == 0 else 'negative'} pointer (ptr={d.ptr})")
    if d.end >= ADDRESS_LIMIT:
        raise ValueError(f"{d.name()}: ptr + nbytes = {d.end:#x} reaches past 2**63 "
                         f"(ptr={d.ptr:#x}, nbytes={d.nbytes})")
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
    seen: dict[BufferKey, BufferDescriptor] = {}
    for d in descs:
        _check_one(d)
        key = (d.layer_id, d.kind)
        if key in seen:
            raise ValueError(f"{d.name()}: duplicate descriptor")
        seen[key] = d
    for lid, kind in sorted(seen):
        if kind == "index" and (lid, "kv") not in seen:
            raise ValueError(f"layer {lid}: has an index buffer but no kv buffer")
    _check_overlap(descs)
    if layout is None:
        return
    for d in descs:
        want = page_bytes(layout, d.kind)
        if d.item_len != want:
            raise ValueError(f"{d.name()}: item_len {d.item_len} != layout's {want}")
    layers = {lid for lid, _ in seen}
    index_layers = {lid for lid, kind in seen if kind == "index"}
    held, indexed = set(layout.layer_ids), set(layout.index_layer_ids)
    mismatches: tuple[tuple[set[int], Callable[[int], str]], ...] = (  # layer ids, what is wrong
        (held - layers, lambda lid: "in the layout but has no buffers"),
        (layers - held, lambda lid: "has buffers but is not in the layout"),
        (indexed - index_layers, lambda lid: "the layout holds its indexer but no index buffer is given"),
        (index_layers - indexed, lambda lid: f"has an index buffer but {layout.absent_indexer(lid)}"),
    )
    for layer_ids, problem in mismatches:
        if layer_ids:
            first = min(layer_ids)
            raise ValueError(f"layer {first}: {problem(first)}")


def ordered(descs: Sequence[BufferDescriptor]) -> list[BufferDescriptor]:
    """Descriptors by (layer id, kv before index)."""
    return sorted(descs, key=lambda d: (d.layer_id, CACHE_KINDS.index(d.kind)))


def to_three_lists(
    descs: Sequence[BufferDescriptor],
) -> tuple[list[int], list[int], list[int]]:
    """SGLang's ``KVArgs`` form: ``(data_ptrs, data_lens, item_lens)`` in the given order."""
    return [d.ptr for d in descs], [d.nbytes for d in descs], [d.item_len for d in descs]


class BufferSet:
    """A layout and its validated buffer descriptors: what a transfer node registers and pairs.

    A pool is one (``DSATokenToKVPool.buffer_descriptors``); buffers another engine allocated are
    another, built with ``from_buf_infos``."""

    def __init__(self, layout: DSALayout, descriptors: Sequence[BufferDescriptor]):
        validate_descriptors(descriptors, layout)
        self.layout = layout
        self._descriptors = ordered(descriptors)

    def buffer_descriptors(self) -> list[BufferDescriptor]:
        return list(self._descriptors)

    @classmethod
    def from_buf_infos(
        cls,
        layout: DSALayout,
        kv: tuple[Sequence[int], Sequence[int], Sequence[int]],
        kv_layer_ids: Sequence[int],
        state: tuple[Sequence[int], Sequence[int], Sequence[int]],
        state_layer_ids: Sequence[int],
        device: str = "cpu",
    ) -> BufferSet:
        """Buffers in SGLang's ``KVArgs`` form: ``kv`` and ``state`` as (data_ptrs, data_lens,
        item_lens), each entry's global layer id in ``*_layer_ids``.

        A state (indexer) entry of zero length is an index-sharing layer's placeholder (SGLang
        0.5.23 gives those layers 0-row tensors): it is dropped — absent, not empty — and the
        layers dropped are logged; the result must then match ``layout``'s indexer layers. A
        zero-length KV entry, a null pointer with bytes behind it, ragged lists or unknown layer
        ids are refused (ValueError naming the entry)."""
        descs = _entries("kv", kv, kv_layer_ids, device, keep_empty=False)
        states = _entries("index", state, state_layer_ids, device, keep_empty=True)
        dropped = [d.layer_id for d in states if d.nbytes == 0]
        if dropped:
            log.info("indexer entries of layers %s are zero-length (index-sharing placeholders): "
                     "absent, not registered", dropped)
        return cls(layout, descs + [d for d in states if d.nbytes != 0])


def _entries(kind: str, lists, layer_ids: Sequence[int], device: str, *,
             keep_empty: bool) -> list[BufferDescriptor]:
    """Three lists + layer ids -> descriptors; zero-length entries only where ``keep_empty``."""
    name = "kv" if kind == "kv" else "state"
    if not isinstance(lists, (tuple, list)) or len(lists) != 3:
        raise ValueError(f"{name} buffer infos must be (data_ptrs, data_lens, item_lens)")
    ptrs, lens, items = (list(x) for x in lists)
    ids = list(layer_ids)
    if not len(ptrs) == len(lens) == len(items) == len(ids):
        raise ValueError(f"{name} buffer infos are ragged: {len(ptrs)} ptrs, {len(lens)} lens, "
                         f"{len(items)} item_lens, {len(ids)} layer ids")
    out = []
    for i, (lid, ptr, nbytes, item_len) in enumerate(zip(ids, ptrs, lens, items, strict=True)):
        for label, value in (("layer id", lid), ("ptr", ptr), ("len", nbytes), ("item_len", item_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} entry {i}: {label} must be a non-negative int, got {value!r}")
        if nbytes == 0 and keep_empty:
            out.append(BufferDescriptor(lid, kind, ptr, 0, item_len, device))
            continue
        problem = ("zero-length buffer" if nbytes == 0 else "null pointer" if ptr == 0
                   else "item_len of 0" if item_len == 0 else "")
        if problem:
            raise ValueError(f"{name} entry {i} (layer {lid}): ptr={ptr:#x}, len={nbytes}, "
                             f"item_len={item_len}: a {problem} is never registered")
        out.append(BufferDescriptor(lid, kind, ptr, nbytes, item_len, device))
    return out
