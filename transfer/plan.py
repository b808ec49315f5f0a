"""Pure transfer planning: page ids -> coalesced, bounds-checked (src, dst, length) writes.

No I/O and no engine here. The node pairs the buffers it writes with the peer's by global layer
id and cache kind (``pair_buffers``; which ones is the handshake's ``transfer_set``), then for
each chunk of a request turns the paired page ids into one write per run of consecutive pages,
per paired buffer (``plan_writes``); a peer's pairs are a ``PairTable``, which holds the arrays
every chunk's plan reads, built once at the handshake. A request's indexer page ids are its KV
page ids (page p of a KV buffer is row p of the indexer buffer): one list of page ids addresses
both caches, unless decode names its own indexer pages (``index_pages``: sglang's HiSparse
decode holds the KV in a host pool and the indexer in its device pool, each with its own page
ids). Page 0 is padding, never written, but in a destination whose KV buffers hold no padding
page (``kv_page_zero``: that host pool). Every page id is checked against the registered
regions of both sides before a single address is produced.

Aux buffers (SGLang's metadata buffers: one slot per request in each) are paired by position
(``pair_aux``); a request's slot is written with its last chunk (``with_aux_writes``).
``plan_chunk`` is the whole plan of one chunk of a request, as the prefill node's writer asks
for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ..plugin.descriptors import CACHE_KINDS, BufferDescriptor

PADDING_PAGE = 0
INDEX_KIND = "index"


class PlanError(ValueError):
    """A request or a buffer pairing that must not reach the engine."""


@dataclass(frozen=True)
class BufferPair:
    """A local (source) buffer and the peer's (destination) buffer of the same layer and kind."""

    src: BufferDescriptor
    dst: BufferDescriptor


class PairTable(Sequence[BufferPair]):
    """Buffer pairs, and the arrays every chunk's plan reads from them (pointers, item lengths,
    the smallest page count of either side), built once per peer instead of once per chunk."""

    def __init__(self, pairs: Iterable[BufferPair], kv_on_index_pages: Iterable[int] = ()):
        self._pairs = tuple(pairs)
        self.kv_on_index_pages = frozenset(kv_on_index_pages)  # decode's Hello: see on_index_pages
        self.src_ptr = np.array([p.src.ptr for p in self._pairs], dtype=np.int64)
        self.dst_ptr = np.array([p.dst.ptr for p in self._pairs], dtype=np.int64)
        self.item_len = np.array([p.src.item_len for p in self._pairs], dtype=np.int64)
        self.src_pages = min((p.src.num_items for p in self._pairs), default=0)
        self.dst_pages = min((p.dst.num_items for p in self._pairs), default=0)
        self._split: tuple[PairTable, PairTable] | None = None

    def split_index(self) -> tuple[PairTable, PairTable]:
        """(the pairs addressed by a request's KV pages, those addressed by its indexer pages:
        ``on_index_pages``), each a table (made once)."""
        if self._split is None:
            def at_index(pair: BufferPair) -> bool:
                return on_index_pages((pair.src.layer_id, pair.src.kind), self.kv_on_index_pages)

            self._split = (PairTable(p for p in self._pairs if not at_index(p)),
                           PairTable(p for p in self._pairs if at_index(p)))
        return self._split

    def __getitem__(self, index):
        return self._pairs[index]

    def __len__(self) -> int:
        return len(self._pairs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    __hash__ = None


def on_index_pages(key: tuple[int, str], kv_on_index_pages: frozenset[int]) -> bool:
    """Whether the buffer ``key`` (layer id, kind) is addressed by a request's indexer pages
    (``index_pages``): every indexer buffer, and the KV buffers of the layers decode keeps with
    its indexer (``kv_on_index_pages``, from its Hello: sglang's HiSparse decode holds a draft
    model's KV on the device, in the indexer's pages, and the target's in a host pool)."""
    layer_id, kind = key
    return kind == INDEX_KIND or layer_id in kv_on_index_pages


def as_table(pairs: Sequence[BufferPair]) -> PairTable:
    return pairs if isinstance(pairs, PairTable) else PairTable(pairs)


@dataclass(frozen=True)
class WritePlan:
    """Flat arrays ready for ``TransferBackend.write``; ``runs`` counts page runs per buffer."""

    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray
    runs: int

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    @property
    def descriptors(self) -> int:
        return len(self.length)


NO_WRITES = WritePlan(*(np.zeros(0, dtype=np.uint64) for _ in range(3)), runs=0)


def buffer_order(key: tuple[int, str]) -> tuple[int, int]:
    """Sort (layer id, kind) by layer, then KV before indexer."""
    layer_id, kind = key
    return layer_id, CACHE_KINDS.index(kind) if kind in CACHE_KINDS else len(CACHE_KINDS)


def pair_buffers(local: Sequence[BufferDescriptor], remote: Sequence[BufferDescriptor],
                 keys: Iterable[tuple[int, str]] | None = None) -> PairTable:
    """Pair the ``keys`` buffers (global layer id, kind) of both sides, never by position;
    ``None``: every local buffer, and the peer must hold exactly the same set. Item lengths must
    be equal; empty or null buffers are refused."""
    by_key = {(b.layer_id, b.kind): b for b in remote}
    if len(by_key) != len(remote):
        raise PlanError("peer announced the same (layer, cache) twice")
    local_by_key = {(b.layer_id, b.kind): b for b in local}
    if len(local_by_key) != len(local):
        raise PlanError("local buffers list the same (layer, cache) twice")
    every = keys is None
    pairs = []
    for key in sorted(local_by_key if every else set(keys), key=buffer_order):
        layer, kind = key
        if key not in local_by_key:
            raise PlanError(f"this side has no {kind} buffer for layer {layer}")
        if key not in by_key:
            raise PlanError(f"peer has no {kind} buffer for layer {layer}")
        src, dst = local_by_key[key], by_key[key]
        for side, buf in (("local", src), ("peer", dst)):
            if buf.ptr <= 0 or buf.nbytes <= 0 or buf.item_len <= 0:
                raise PlanError(
                    f"{side} {buf.kind} buffer of layer {buf.layer_id} is empty or null "
                    f"(ptr={buf.ptr:#x}, nbytes={buf.nbytes}, item_len={buf.item_len})"
                )
        if src.item_len != dst.item_len:
            raise PlanError(
                f"{src.kind} item_len of layer {src.layer_id}: local {src.item_len} != peer {dst.item_len}"
            )
        pairs.append(BufferPair(src, dst))
    extra = sorted(by_key.keys() - local_by_key.keys(), key=buffer_order) if every else []
    if extra:
        layer, kind = extra[0]
        raise PlanError(f"peer has a {kind} buffer for layer {layer} that this side lacks")
    return PairTable(pairs)


def as_page_ids(pages: object, name: str) -> np.ndarray:
    """A 1-D int64 array of page ids, or PlanError naming the argument."""
    arr = np.asarray(pages)
    if arr.ndim != 1:
        raise PlanError(f"{name} must be a 1-D sequence of page ids, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise PlanError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _ascending(pages: np.ndarray) -> bool:
    """Each id above the one before it (compared, not subtracted: no int64 overflow)."""
    return bool((pages[1:] > pages[:-1]).all())


def check_pages(pages: np.ndarray, limit: int, name: str, *, first: int = PADDING_PAGE + 1) -> None:
    """Every page id in [first, limit) and none twice: page 0 is padding and never transferred
    (``first`` 0: buffers without a padding page), and
    two writes into one page would leave it holding whichever landed last. Ascending ids (what
    allocators hand out) hold no repeat and are bounded by their ends, so only other lists are
    sorted (a sort releases the GIL, which another thread then holds for up to its switch
    interval; and not ``np.unique``, whose first call imports numpy.ma, ~140 ms)."""
    if pages.size == 0:
        raise PlanError(f"{name} is empty")
    ordered = pages if _ascending(pages) else np.sort(pages)
    low, high = int(ordered[0]), int(ordered[-1])
    if low < first:
        raise PlanError(f"{name} contains page {low}: " + ("page 0 is padding and ids must be >= 1"
                                                           if first > PADDING_PAGE else
                                                           "ids must be >= 0"))
    if high >= limit:
        raise PlanError(f"{name} contains page {high}, beyond the registered {limit} pages")
    if ordered is not pages and (ordered[1:] == ordered[:-1]).any():
        raise PlanError(f"{name} lists a page more than once")


def check_destination(pairs: Sequence[BufferPair], dst_pages: object, index_pages: object = None,
                      *, kv_page_zero: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """Decode's page ids for a request, checked against every buffer it announced: its KV pages
    (from page 0 with ``kv_page_zero``), and its indexer pages (``index_pages``, as many; None:
    the KV pages, then checked against the indexer buffers too), each against the buffers it
    addresses (``on_index_pages``)."""
    dst = as_page_ids(dst_pages, "dst_pages")
    index = None if index_pages is None else as_page_ids(index_pages, "index_pages")
    kv_table, index_table = as_table(pairs).split_index()
    check_page_lists(dst, index, kv_table.dst_pages, index_table.dst_pages,
                     kv_page_zero=kv_page_zero)
    return dst, index


def check_page_lists(kv_pages: np.ndarray, index_pages: np.ndarray | None, kv_limit: int,
                     index_limit: int, *, kv_page_zero: bool = False,
                     names: tuple[str, str] = ("dst_pages", "index_pages")) -> None:
    """A request's KV pages in ``[first, kv_limit)`` (from page 0 with ``kv_page_zero``) and its
    indexer pages (``index_pages``, as many; None: the KV pages) in ``[1, index_limit)`` (0: no
    indexer held), each list named as ``names`` says; PlanError otherwise."""
    kv_name, index_name = names
    if index_pages is not None and index_pages.size != kv_pages.size:
        raise PlanError(f"{index_name} has {index_pages.size} pages but {kv_name} has "
                        f"{kv_pages.size}")
    check_pages(kv_pages, kv_limit, kv_name, first=0 if kv_page_zero else 1)
    if index_limit:
        check_pages(kv_pages if index_pages is None else index_pages, index_limit,
                    kv_name if index_pages is None else index_name)


def coalesce_runs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split paired page ids into maximal runs where both sides step by +1.

    Returns (src_start, dst_start, run_len)."""
    if src.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    breaks = (np.diff(src) != 1) | (np.diff(dst) != 1)
    if not breaks.any():  # one run: the usual chunk
        return src[:1], dst[:1], np.array([src.size], dtype=np.int64)
    starts = np.flatnonzero(np.concatenate(([True], breaks)))
    lengths = np.diff(np.concatenate((starts, [src.size])))
    return src[starts], dst[starts], lengths


def plan_writes(pairs: Sequence[BufferPair], src_pages: object, dst_pages: object,
                index_pages: object = None, *, kv_page_zero: bool = False) -> WritePlan:
    """One write per run of consecutive pages, for every paired buffer (all layers, both caches):
    the KV buffers into ``dst_pages`` (from page 0 with ``kv_page_zero``), the indexer buffers
    and the KV of decode's ``kv_on_index_pages`` into ``index_pages`` (None: ``dst_pages`` too).

    Raises PlanError, before producing any address, when the page lists differ in length, hold
    page 0, a page beyond either side's smallest registered buffer, or a repeated page."""
    src = as_page_ids(src_pages, "src_pages")
    dst = as_page_ids(dst_pages, "dst_pages")
    if src.size != dst.size:
        raise PlanError(f"src_pages has {src.size} pages but dst_pages has {dst.size}")
    if not pairs:
        raise PlanError("no buffers to transfer")
    table = as_table(pairs)
    if index_pages is None and not kv_page_zero:
        return _plan_table(table, src, dst, "dst_pages")
    index = dst if index_pages is None else as_page_ids(index_pages, "index_pages")
    if index.size != src.size:
        raise PlanError(f"src_pages has {src.size} pages but index_pages has {index.size}")
    kv_table, index_table = table.split_index()
    plans = [_plan_table(kv_table, src, dst, "dst_pages", first=0 if kv_page_zero else 1),
             *([_plan_table(index_table, src, index, "index_pages")] if index_table else [])]
    return WritePlan(*join_plans(plans), runs=sum(p.runs for p in plans))


def join_plans(plans: Sequence[WritePlan]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The (src, dst, length) arrays of one engine write of every plan, in order."""
    return tuple(np.concatenate([getattr(p, key) for p in plans]) for key in ("src", "dst", "length"))


def _plan_table(table: PairTable, src: np.ndarray, dst: np.ndarray, dst_name: str, *,
                first: int = PADDING_PAGE + 1) -> WritePlan:
    """``plan_writes`` over one table and one destination page list."""
    check_pages(src, table.src_pages, "src_pages")
    check_pages(dst, table.dst_pages, dst_name, first=first)
    src_start, dst_start, run_len = coalesce_runs(src, dst)
    item_len = table.item_len[:, None]
    return WritePlan(
        src=(table.src_ptr[:, None] + src_start * item_len).ravel().view(np.uint64),
        dst=(table.dst_ptr[:, None] + dst_start * item_len).ravel().view(np.uint64),
        length=(run_len * item_len).ravel().view(np.uint64),
        runs=int(run_len.size),
    )


# ---- aux buffers: one slot per request in each (SGLang's metadata buffers) ------------------
AUX_KIND = "aux"


def as_aux_buffers(infos: Iterable[tuple]) -> list[BufferDescriptor]:
    """Aux buffers from ``(ptr, nbytes, item_len)`` triples (host memory) or ``(ptr, nbytes,
    item_len, device)``, numbered by position (they carry no layer id: SGLang's metadata buffers
    are one list, in the same order on both sides); an empty, null or ragged one is refused."""
    out = []
    for i, (ptr, nbytes, item_len, *device) in enumerate(infos):
        for label, value in (("ptr", ptr), ("nbytes", nbytes), ("item_len", item_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise PlanError(f"aux buffer {i}: {label} must be a positive int, got {value!r}")
        if nbytes % item_len:
            raise PlanError(f"aux buffer {i}: nbytes {nbytes} is not a multiple of item_len {item_len}")
        out.append(BufferDescriptor(i, AUX_KIND, ptr, nbytes, item_len, *device))
    return out


def pair_aux(local: Sequence[BufferDescriptor], remote: Sequence[BufferDescriptor]) -> list[BufferPair]:
    """Pair aux buffers by position: the same count on both sides and equal item lengths."""
    if len(local) != len(remote):
        raise PlanError(f"aux buffers: this side holds {len(local)}, the peer {len(remote)}")
    pairs = []
    for src, dst in zip(local, remote, strict=True):
        if dst.ptr <= 0 or dst.nbytes <= 0 or dst.item_len <= 0 or dst.nbytes % dst.item_len:
            raise PlanError(f"peer aux buffer {dst.layer_id} is empty, null or ragged "
                            f"(ptr={dst.ptr:#x}, nbytes={dst.nbytes}, item_len={dst.item_len})")
        if src.item_len != dst.item_len:
            raise PlanError(f"aux buffer {src.layer_id}: item_len local {src.item_len} != "
                            f"peer {dst.item_len}")
        pairs.append(BufferPair(src, dst))
    return pairs


def check_aux_index(buffers: Sequence[BufferDescriptor], index: int | None, name: str) -> int | None:
    """``index`` (None or -1: no slot) checked against every aux buffer: a slot in all of them."""
    if index is None or index == -1:
        return None
    if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
        raise PlanError(f"{name} must be an int, got {index!r}")
    if not buffers:
        raise PlanError(f"{name} is {index} but there are no aux buffers")
    limit = min(b.num_items for b in buffers)
    if not 0 <= index < limit:
        raise PlanError(f"{name} {index} is outside the aux buffers' {limit} slots")
    return int(index)


def with_aux_writes(plan: WritePlan, pairs: Sequence[BufferPair], src_index: int | None,
                    dst_index: int | None) -> WritePlan:
    """``plan`` plus one write per aux buffer from slot ``src_index`` into the peer's slot
    ``dst_index`` (both bounds-checked first); unchanged when the peer asked for no slot."""
    if dst_index is None:
        return plan
    if src_index is None:
        raise PlanError(f"decode asked for aux slot {dst_index} but this request has none")
    src = check_aux_index([p.src for p in pairs], src_index, "aux_index")
    dst = check_aux_index([p.dst for p in pairs], dst_index, "decode's aux_index")
    item = np.array([p.src.item_len for p in pairs], dtype=np.int64)
    src_ptr = np.array([p.src.ptr for p in pairs], dtype=np.int64) + src * item
    dst_ptr = np.array([p.dst.ptr for p in pairs], dtype=np.int64) + dst * item
    return WritePlan(
        src=np.concatenate((plan.src, src_ptr.astype(np.uint64))),
        dst=np.concatenate((plan.dst, dst_ptr.astype(np.uint64))),
        length=np.concatenate((plan.length, item.astype(np.uint64))),
        runs=plan.runs,
    )


def plan_chunk(pairs: Sequence[BufferPair], src_pages: object, dst_pages: object, *, last: bool,
               aux_pairs: Sequence[BufferPair] = (), aux_src: int | None = None,
               aux_dst: int | None = None, index_pages: object = None,
               kv_page_zero: bool = False) -> WritePlan:
    """One chunk of a request: its pages in every paired buffer (``plan_writes``, with decode's
    ``index_pages`` and ``kv_page_zero``) and, when it is the request's ``last`` chunk, its aux
    slot ``aux_src`` into decode's ``aux_dst`` (``with_aux_writes``). A last chunk may hold no
    page (a share writer whose share ended earlier): then only its aux slot, if any. Raises
    PlanError before producing any address."""
    src, dst = as_page_ids(src_pages, "src_pages"), as_page_ids(dst_pages, "dst_pages")
    plan = NO_WRITES if last and src.size == 0 and dst.size == 0 else plan_writes(
        pairs, src, dst, index_pages, kv_page_zero=kv_page_zero)
    return with_aux_writes(plan, aux_pairs, aux_src, aux_dst) if last else plan
