"""The DSA token-to-KV pool: per layer one MLA KV buffer and, where the layout says, one indexer.

Device-agnostic (CPU tensors in tests, CUDA on GPUs) and SGLang-compatible in names and shapes
(``kv_buffer``, ``index_k_with_scale_buffer``, ``get_contiguous_buf_infos``,
``get_state_buf_infos``, ``move_kv_cache``, ``get_cpu_copy``, ``load_cpu_copy``). Uniform (the
default): every layer has both buffers. Compact: an index-sharing layer has no indexer buffer at
all — absent, not empty: no zero-size tensor, no entry in any list, and asking for it is an error
naming its producer. No buffer is ever of zero size. The KV buffer is indexed by token row; the
indexer buffer by page (``loc // page_size``) and in-page offset (``loc % page_size``) — never by
token location. Every public operation validates all of its input before it touches a byte.
On the CPU the token operations share their copies (per layer and cache part) among
``torch.get_num_threads()`` threads (``plugin.workers``); on a device they are index_select /
index_copy_ kernels. The row copies themselves are ``plugin.row_copy``'s; token locations are
checked by ``plugin.token_locs``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .descriptors import BufferDescriptor, page_bytes, to_three_lists, validate_descriptors
from .layout import KV_DTYPES, DSALayout
from .row_copy import copy_rows_from_host, copy_rows_to_host, covering_rows, plan_row_copy, row_view
from .sizing import index_pages, kv_rows, resolve_index_buf_size
from .token_locs import check_targets, check_token_locs
from .workers import run_tasks

CANARY = 0xCD
GUARD_ALIGN = 8  # guard_bytes must keep every carved buffer aligned for its dtype
DEFAULT_CHUNK_TOKENS = 8192
POOL_BUFFERS = "the pool's buffers"
# helper threads share an operation's copies only from this mean size of a copy on: below it the
# copies are too short to release the GIL for long, and two threads only pass it back and forth
MIN_SHARED_COPY_BYTES = 256 * 1024


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_apart(spans: list[tuple[int, int, str]]) -> None:
    """Byte ranges (first, end, label) must not overlap; an error names the later one first,
    the pool's buffers (``POOL_BUFFERS``) last."""
    reach: tuple[int, int, str] | None = None  # the range reaching furthest so far
    for first, end, label in sorted((s for s in spans if s[1] > s[0]), key=lambda s: s[0]):
        if reach is not None and first < reach[1]:
            named = sorted((label, reach[2]), key=lambda x: x == POOL_BUFFERS)
            raise ValueError(f"{named[0]} overlaps {named[1]}")
        if reach is None or end > reach[1]:
            reach = (first, end, label)


def resolve_kv_dtype(dtype: Any, kv_cache_dim: int | None, kv_lora_rank: int, rope: int) -> str:
    """SGLang's (dtype, kv_cache_dim) -> one of KV_DTYPES. An fp8 dtype (float8_e4m3fn or its
    uint8 storage) is "fp8_raw" when kv_cache_dim == kv_lora_rank + rope, else "fp8" (flashmla)."""
    if isinstance(dtype, str):
        if dtype not in KV_DTYPES:
            raise ValueError(f"dtype must be one of {KV_DTYPES} or a torch dtype, got {dtype!r}")
        return dtype
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype in (torch.float8_e4m3fn, torch.uint8):
        return "fp8_raw" if kv_cache_dim == kv_lora_rank + rope else "fp8"
    raise ValueError(
        f"dtype must be torch.bfloat16, torch.float8_e4m3fn, torch.uint8 or one of {KV_DTYPES}, "
        f"got {dtype!r}"
    )


class AbsentIndexerError(ValueError):
    """A layer's indexer was asked for where the layout holds none (compact pool)."""


class IndexerBuffers(Sequence):
    """``index_k_with_scale_buffer``: one entry per layer position, like ``kv_buffer``. In a
    compact pool a shared layer's entry is absent: indexing it raises AbsentIndexerError naming
    the layer and its producer (never a zero-size tensor); ``present()`` lists the others."""

    def __init__(self, layout: DSALayout, buffers: dict[int, torch.Tensor]):
        self._layout = layout
        self._buffers = buffers

    def __len__(self) -> int:
        return self._layout.num_layers

    def __getitem__(self, position):
        if isinstance(position, slice):
            raise TypeError("index_k_with_scale_buffer takes a layer position, not a slice")
        layer_id = self._layout.layer_ids[position]
        try:
            return self._buffers[layer_id]
        except KeyError:
            raise AbsentIndexerError(self._layout.absent_indexer(layer_id)) from None

    def present(self) -> list[tuple[int, torch.Tensor]]:
        """(global layer id, buffer) of every layer that holds an indexer, in layer order."""
        return list(self._buffers.items())


@dataclass(frozen=True)
class CpuCopy:
    """A host copy of some tokens' cache: per layer ``kv[i]`` (n, 1, kv_cache_dim), and per
    indexer layer (``layout.index_layer_ids``) ``index_keys[j]`` (n, index_head_dim) and
    ``index_scales[j]`` (n, scale bytes), CPU tensors, in the order of the token locations it was
    taken from. ``get_cpu_copy(..., out=copy)`` reuses one."""

    layout: DSALayout
    num_tokens: int
    kv: tuple[torch.Tensor, ...]
    index_keys: tuple[torch.Tensor, ...]
    index_scales: tuple[torch.Tensor, ...]


class DSATokenToKVPool:
    """DSA pool, uniform or compact; see the module docstring. ``layout`` describes its
    geometry and which layers hold an indexer."""

    state_type = "dsa"

    def __init__(
        self,
        size: int,
        page_size: int,
        kv_lora_rank: int,
        dtype: Any,
        qk_rope_head_dim: int,
        layer_num: int,
        device: str | torch.device = "cpu",
        index_head_dim: int = 128,
        enable_memory_saver: bool = False,
        kv_cache_dim: int | None = None,
        start_layer: int | None = None,
        end_layer: int | None = None,
        index_buf_size: int | None = None,
        *,
        index_quant_block: int = 128,
        index_layer_ids: Sequence[int] | None = None,
        guard_bytes: int = 0,
    ) -> None:
        if enable_memory_saver:
            raise ValueError("enable_memory_saver=True is not supported (no torch_memory_saver)")
        _check_int("layer_num", layer_num, 1)
        _check_int("kv_lora_rank", kv_lora_rank, 1)
        _check_int("qk_rope_head_dim", qk_rope_head_dim, 1)
        start = 0 if start_layer is None else start_layer
        _check_int("start_layer", start, 0)
        end = start + layer_num if end_layer is None else end_layer
        _check_int("end_layer", end, 0)
        if end - start != layer_num:
            raise ValueError(
                f"end_layer ({end}) - start_layer ({start}) must equal layer_num ({layer_num})"
            )
        layout = DSALayout(
            layer_ids=tuple(range(start, end)),
            page_size=page_size,
            kv_lora_rank=kv_lora_rank,
            qk_rope_head_dim=qk_rope_head_dim,
            kv_dtype=resolve_kv_dtype(dtype, kv_cache_dim, kv_lora_rank, qk_rope_head_dim),
            index_head_dim=index_head_dim,
            index_quant_block=index_quant_block,
            index_layers=None if index_layer_ids is None else tuple(index_layer_ids),
        )
        if kv_cache_dim is not None and kv_cache_dim != layout.kv_cache_dim:
            raise ValueError(
                f"kv_cache_dim {kv_cache_dim} does not match kv_dtype {layout.kv_dtype!r} "
                f"(expected {layout.kv_cache_dim})"
            )
        self._allocate(layout, size, device, index_buf_size, guard_bytes)

    @classmethod
    def from_layout(
        cls,
        layout: DSALayout,
        size: int,
        device: str | torch.device = "cpu",
        index_buf_size: int | None = None,
        *,
        guard_bytes: int = 0,
    ) -> DSATokenToKVPool:
        """A pool holding exactly ``layout.layer_ids`` (which need not be contiguous)."""
        if not isinstance(layout, DSALayout):
            raise TypeError(f"layout must be a DSALayout, got {type(layout).__name__}")
        pool = cls.__new__(cls)
        pool._allocate(layout, size, device, index_buf_size, guard_bytes)
        return pool

    def _allocate(
        self,
        layout: DSALayout,
        size: int,
        device: str | torch.device,
        index_buf_size: int | None,
        guard_bytes: int,
    ) -> None:
        self.index_buf_size = resolve_index_buf_size(layout, size, index_buf_size)
        _check_int("guard_bytes", guard_bytes, 0)
        if guard_bytes % GUARD_ALIGN:
            raise ValueError(f"guard_bytes must be a multiple of {GUARD_ALIGN}, got {guard_bytes}")
        self.layout = layout
        self.size = size
        self.page_size = layout.page_size
        self.layer_num = layout.num_layers
        self.start_layer = layout.layer_ids[0]
        self.end_layer = layout.layer_ids[-1] + 1  # the span; ids inside it may be absent
        self.kv_lora_rank = layout.kv_lora_rank
        self.qk_rope_head_dim = layout.qk_rope_head_dim
        self.kv_cache_dim = layout.kv_cache_dim
        self.index_head_dim = layout.index_head_dim
        bf16 = layout.kv_dtype == "bf16"
        self.dtype = torch.bfloat16 if bf16 else torch.float8_e4m3fn
        self.store_dtype = torch.bfloat16 if bf16 else torch.uint8
        self.guard_bytes = guard_bytes
        self._guards: list[torch.Tensor] = []
        self._positions = {lid: i for i, lid in enumerate(layout.layer_ids)}
        rows = kv_rows(layout, size)
        self.num_kv_pages = rows // layout.page_size
        dev = torch.device(device)
        self.kv_buffer = [
            self._alloc((rows, 1, layout.kv_cache_dim), self.store_dtype, dev)
            for _ in layout.layer_ids
        ]
        pages = index_pages(layout, self.index_buf_size)
        self.index_k_with_scale_buffer = IndexerBuffers(layout, {
            lid: self._alloc((pages, layout.index_page_bytes), torch.uint8, dev)
            for lid in layout.index_layer_ids
        })
        self.kv_layer_ids = list(layout.layer_ids)
        self.state_layer_ids = list(layout.index_layer_ids)
        self.device = str(self.kv_buffer[0].device)
        # Row views for the token operations, per layer: (KV, indexer keys, indexer scales); a
        # layer without an indexer has just (KV,). [0] by token: keys and scales as rows of the
        # widest size that divides them and every (page, offset) position of them. [1] by page,
        # for tokens that fill whole pages (a request's): a page's keys, and its scales, as one
        # (strided) row each.
        page_bytes, split = layout.index_page_bytes, layout.page_size * layout.index_head_dim
        key_w = math.gcd(layout.index_head_dim, page_bytes)
        scale_w = math.gcd(layout.index_scale_bytes, page_bytes, split)
        page_align = math.gcd(page_bytes, split)
        kv_part = (layout.kv_row_bytes, layout.kv_row_bytes)
        self._parts = (  # (row bytes, word alignment) of each part of a row view
            (kv_part, (key_w, key_w), (scale_w, scale_w)),
            (kv_part, (split, page_align), (page_bytes - split, page_align)),
        )
        self._row_views: tuple[list[tuple[torch.Tensor, ...]], ...] = ([], [])
        indexers = dict(self.index_k_with_scale_buffer.present())
        for lid, kv in zip(layout.layer_ids, self.kv_buffer, strict=True):
            token_rows = row_view(kv, layout.kv_row_bytes)
            ix = indexers.get(lid)
            if ix is None:
                self._row_views[0].append((token_rows,))
                self._row_views[1].append((token_rows,))
                continue
            self._row_views[0].append((token_rows, row_view(ix, key_w), row_view(ix, scale_w)))
            pages = row_view(ix, page_bytes, page_align)
            cut = pages.shape[1] * split // page_bytes
            self._row_views[1].append((token_rows, pages[:, :cut], pages[:, cut:]))

    def _alloc(self, shape: tuple[int, ...], dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
        if not self.guard_bytes:
            return torch.zeros(shape, dtype=dtype, device=dev)
        g, nbytes = self.guard_bytes, math.prod(shape) * dtype.itemsize
        base = torch.full((g + nbytes + g,), CANARY, dtype=torch.uint8, device=dev)
        body = base[g : g + nbytes]
        body.zero_()
        self._guards.append(base)
        return body.view(dtype).view(shape)

    # ---- geometry and views ------------------------------------------------------------------
    @property
    def guard_allocations(self) -> tuple[torch.Tensor, ...]:
        """With guard_bytes > 0: the uint8 allocations the buffers are carved from (all KV
        buffers, then every indexer buffer); buffer bytes at ``[guard_bytes, len - guard_bytes)``."""
        return tuple(self._guards)

    def layer_index(self, layer_id: int) -> int:
        """Position of global ``layer_id`` in ``kv_buffer`` / ``index_k_with_scale_buffer``."""
        if isinstance(layer_id, bool) or not isinstance(layer_id, int):
            raise TypeError(f"layer_id must be an int, got {type(layer_id).__name__}")
        try:
            return self._positions[layer_id]
        except KeyError:
            ids = self.layout.layer_ids
            raise ValueError(
                f"layer_id {layer_id} is not held by this pool (layer ids {ids[0]}..{ids[-1]}, "
                f"{len(ids)} layers)"
            ) from None

    def page_view(self, layer_id: int, kind: str) -> torch.Tensor:
        """uint8 (pages, item_len) view of one buffer, sharing its storage; AbsentIndexerError
        for the indexer of a layer that holds none."""
        i = self.layer_index(layer_id)
        if kind == "kv":
            raw = self.kv_buffer[i].view(torch.uint8)
            return raw.view(self.num_kv_pages, self.layout.kv_page_bytes)
        if kind == "index":
            return self.index_k_with_scale_buffer[i]
        raise ValueError(f"kind must be 'kv' or 'index', got {kind!r}")

    def buffer_keys(self) -> list[tuple[int, str]]:
        """(layer id, kind) of every buffer the pool holds, in descriptor order."""
        return [(d.layer_id, d.kind) for d in self.buffer_descriptors()]

    def _whole_pages(self, locs: torch.Tensor) -> bool:
        """True when ``locs`` are whole pages, each one's tokens in order (a request's tokens)."""
        ps = self.page_size
        if locs.numel() == 0 or locs.numel() % ps:
            return False
        grid = locs.reshape(-1, ps)
        return bool((grid[:, :1] % ps == 0).all()) and bool(
            (grid - grid[:, :1] == torch.arange(ps, device=locs.device)).all())

    def _row_index(self, locs: torch.Tensor, by_page: bool) -> tuple[torch.Tensor, ...]:
        """Rows of token locations in the row views ``self._row_views[by_page]`` (the same in
        every layer): the KV row, and the indexer's keys and scales — by page, or by (page,
        offset): key bytes at ``offset * head_dim`` and scale bytes at ``page_size * head_dim +
        offset * scale_bytes`` of the page. Never by token location."""
        lay = self.layout
        page, off = locs // self.page_size, locs % self.page_size
        if by_page:
            pages = page[:: self.page_size].contiguous()
            return locs, pages, pages
        base = page * lay.index_page_bytes
        keys = base + off * lay.index_head_dim
        scales = base + self.page_size * lay.index_head_dim + off * lay.index_scale_bytes
        (_, (key_w, _), (scale_w, _)) = self._parts[0]
        return (locs, covering_rows(keys, key_w, lay.index_head_dim),
                covering_rows(scales, scale_w, lay.index_scale_bytes))

    # ---- descriptors ---------------------------------------------------------------------------
    def _buffers(self) -> list[tuple[int, str, torch.Tensor]]:
        """(layer id, kind, tensor) of every buffer held, ordered by layer, KV before indexer."""
        indexers = dict(self.index_k_with_scale_buffer.present())
        out = []
        for lid, kv in zip(self.layout.layer_ids, self.kv_buffer, strict=True):
            out.append((lid, "kv", kv))
            if lid in indexers:
                out.append((lid, "index", indexers[lid]))
        return out

    def buffer_descriptors(self) -> list[BufferDescriptor]:
        """Every buffer held, ordered by (layer_id, kv then index); validated. A compact pool
        lists no indexer entry at all for a layer without one."""
        descs = [
            BufferDescriptor(
                layer_id=lid,
                kind=kind,
                ptr=buf.data_ptr(),
                nbytes=buf.numel() * buf.element_size(),
                item_len=page_bytes(self.layout, kind),
                device=str(buf.device),
            )
            for lid, kind, buf in self._buffers()
        ]
        validate_descriptors(descs, self.layout)
        return descs

    def get_contiguous_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """KV buffers as SGLang's (data_ptrs, data_lens, item_lens), in the order of
        ``kv_layer_ids``."""
        return to_three_lists([d for d in self.buffer_descriptors() if d.kind == "kv"])

    def get_state_buf_infos(self) -> tuple[list[int], list[int], list[int]]:
        """Indexer buffers as SGLang's (data_ptrs, data_lens, item_lens), in the order of
        ``state_layer_ids`` (the layers that hold one: a compact pool has fewer entries, none
        empty)."""
        return to_three_lists([d for d in self.buffer_descriptors() if d.kind == "index"])

    def get_kv_size_bytes(self) -> int:
        """Bytes of all KV and indexer buffers, padding included, guard bytes excluded."""
        return sum(t.numel() * t.element_size() for _, _, t in self._buffers())

    def canaries_intact(self) -> bool:
        """False if any guard byte around any buffer changed; True when guard_bytes == 0."""
        g = self.guard_bytes
        return all(
            bool((base[:g] == CANARY).all()) and bool((base[-g:] == CANARY).all())
            for base in self._guards
        )

    # ---- token operations ----------------------------------------------------------------------
    def _check_locs(self, name: str, locs: Any, *, target: bool) -> torch.Tensor:
        """Validate token locations; targets may not be in padding page 0 nor repeat."""
        locs = check_token_locs(name, locs, device=self.kv_buffer[0].device,
                                rows=self.size + self.page_size)
        if target:
            check_targets(name, locs, self.page_size)
        return locs

    def _run(self, tasks: list[Callable[[], None]], tokens: int) -> None:
        """Independent copies of ``tokens`` tokens' cache: on the CPU shared among
        ``torch.get_num_threads()`` threads (the caller and helpers, ``plugin.workers``) when
        they are long enough; on a device one after another."""
        shared = (self.kv_buffer[0].device.type == "cpu"
                  and tokens * self.layout.bytes_per_token >= MIN_SHARED_COPY_BYTES * len(tasks))
        run_tasks(tasks, torch.get_num_threads() if shared else 1)

    @staticmethod
    def _overlap(tgt: torch.Tensor, src: torch.Tensor) -> bool:
        """Whether any target is also a source. On the CPU through numpy: torch.isin sorts on
        intra-op threads, which took 12 ms instead of 0.6 on two busy cores."""
        if tgt.device.type == "cpu":
            return bool(np.isin(tgt.numpy(), src.numpy()).any())
        return bool(torch.isin(tgt, src).any())

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """Copy token rows src -> tgt in every layer, KV and indexer (key + scale bytes).
        Overlapping src/tgt behave as a copy from a snapshot of the sources."""
        tgt = self._check_locs("tgt_loc", tgt_loc, target=True)
        src = self._check_locs("src_loc", src_loc, target=False)
        if tgt.numel() != src.numel():
            raise ValueError(f"tgt_loc has {tgt.numel()} locations but src_loc has {src.numel()}")
        if tgt.numel() == 0:
            return
        by_page = self._whole_pages(src) and self._whole_pages(tgt)
        src_rows, tgt_rows = self._row_index(src, by_page), self._row_index(tgt, by_page)
        widths = [width for width, _ in self._parts[by_page]]
        layers = self._row_views[by_page]
        # a layer without an indexer has only its KV view: each zip over a layer's views stops
        # after it
        if not self._overlap(tgt, src):  # disjoint: straight across, every layer at once
            copies = [plan_row_copy(t, s, w) for t, s, w in zip(tgt_rows, src_rows, widths, strict=True)]
            self._run([functools.partial(copy, view, view) for views in layers
                       for copy, view in zip(copies, views, strict=False)], tgt.numel())
            return
        # overlapping: each cache part's sources are first gathered into a snapshot, reused by
        # every layer in turn
        gathers = [plan_row_copy(None, s, w) for s, w in zip(src_rows, widths, strict=True)]
        scatters = [plan_row_copy(t, None, w) for t, w in zip(tgt_rows, widths, strict=True)]
        widest = max(layers, key=len)  # a layer with every cache part
        snapshots = [view.new_empty((rows.numel(), view.shape[1]))
                     for view, rows in zip(widest, src_rows, strict=False)]
        for views in layers:
            for view, gather, scatter, snapshot in zip(views, gathers, scatters, snapshots,
                                                       strict=False):
                gather(snapshot, view)
                scatter(view, snapshot)

    def get_cpu_copy(
        self, token_locs: torch.Tensor, mamba_indices: Any = None, req_pool_index: Any = None, *,
        chunk_size: int = DEFAULT_CHUNK_TOKENS, out: CpuCopy | None = None,
    ) -> CpuCopy:
        """Host copy of these tokens' KV rows (every layer) and indexer key+scale bytes (every
        layer that holds an indexer), exactly these tokens' bytes (a partial page's other tokens
        are not copied), taken ``chunk_size`` tokens at a time (bounds the device-side
        temporaries; any positive size).
        ``mamba_indices`` / ``req_pool_index``: SGLang's retraction call form
        (``get_cpu_copy(token_indices, mamba_indices=..., req_pool_index=...)``), accepted as
        SGLang's own DSA pool accepts them, and unused: this pool holds no mamba state and no
        per-request indexer tail (SGLang's reads ``req_pool_index`` only for
        ``index_kpool_compress``).
        ``out``: a CpuCopy of as many tokens (an earlier result, say), written into and returned
        instead of new host tensors — reused host memory does not pay the page faults of fresh
        memory. Its tensors must be contiguous CPU tensors, apart from each other and the pool."""
        locs = self._check_locs("token_locs", token_locs, target=False)
        _check_int("chunk_size", chunk_size, 1)
        n, lay = locs.numel(), self.layout
        if out is None:
            copy = CpuCopy(
                layout=lay, num_tokens=n,
                kv=tuple(torch.empty((n, 1, lay.kv_cache_dim), dtype=self.store_dtype)
                         for _ in self.kv_buffer),
                index_keys=tuple(torch.empty((n, lay.index_head_dim), dtype=torch.uint8)
                                 for _ in lay.index_layer_ids),
                index_scales=tuple(torch.empty((n, lay.index_scale_bytes), dtype=torch.uint8)
                                   for _ in lay.index_layer_ids),
            )
        else:
            self._check_copy(out, "out", writable=True)
            if out.num_tokens != n:
                raise ValueError(f"out holds {out.num_tokens} tokens but token_locs has {n}")
            copy = out
        self._walk_host_copy(copy, locs, chunk_size, load=False)
        return copy

    def _walk_host_copy(self, copy: CpuCopy, locs: torch.Tensor, chunk_size: int, *,
                        load: bool) -> None:
        """What ``get_cpu_copy`` (``load`` False: pool -> host) and ``load_cpu_copy`` (``load``
        True: host -> pool) share: ``chunk_size`` tokens at a time, every part of every layer's
        rows between the pool's row views and the copy's host tensors, the row copy planned once
        per chunk and part. Checked by the caller."""
        dev = self.kv_buffer[0].device
        move = functools.partial(copy_rows_from_host, dev=dev) if load else copy_rows_to_host
        host = self._copy_parts(copy.kv, copy.index_keys, copy.index_scales)
        for start in range(0, copy.num_tokens, chunk_size):
            chunk = locs[start : start + chunk_size]
            by_page, end = self._whole_pages(chunk), start + chunk.numel()
            parts = self._parts[by_page]
            copies = [plan_row_copy(index, None, width) if load else plan_row_copy(None, index, width)
                      for index, (width, _) in zip(self._row_index(chunk, by_page), parts, strict=True)]
            tasks = []
            for views, tensors in zip(self._row_views[by_page], host, strict=True):
                tasks += [functools.partial(move, row_copy, view, t[start:end], part)
                          for row_copy, view, t, part in zip(copies, views, tensors, parts,
                                                               strict=False)]
            self._run(tasks, chunk.numel())

    def _copy_parts(self, kv, keys, scales) -> list[tuple[torch.Tensor, ...]]:
        """Per layer position, the host tensors of a copy that match its row views: (kv,) for a
        layer without an indexer, (kv, keys, scales) otherwise."""
        index_position = {lid: j for j, lid in enumerate(self.layout.index_layer_ids)}
        out = []
        for i, lid in enumerate(self.layout.layer_ids):
            j = index_position.get(lid)
            out.append((kv[i],) if j is None else (kv[i], keys[j], scales[j]))
        return out

    def _check_copy(self, copy: Any, name: str = "copy", *, writable: bool = False) -> None:
        """A CpuCopy of this layout, every tensor of its shape and dtype and holding bytes (not
        on meta); ``writable`` (``out=``): contiguous CPU tensors that overlap neither each other
        nor the pool's buffers."""
        if not isinstance(copy, CpuCopy):
            raise TypeError(f"{name} must be a CpuCopy from get_cpu_copy, got {type(copy).__name__}")
        diff = self.layout.first_difference(copy.layout)
        if diff is not None:
            raise ValueError(f"{name} was taken from a different layout: {diff}")
        lay, n = self.layout, copy.num_tokens
        index_layers = len(lay.index_layer_ids)
        expected = (
            ("kv", copy.kv, (n, 1, lay.kv_cache_dim), self.store_dtype, lay.num_layers),
            ("index_keys", copy.index_keys, (n, lay.index_head_dim), torch.uint8, index_layers),
            ("index_scales", copy.index_scales, (n, lay.index_scale_bytes), torch.uint8, index_layers),
        )
        spans = []  # (first byte, end, label) of every tensor written
        for field, tensors, shape, dtype, layers in expected:
            if len(tensors) != layers:
                raise ValueError(f"{name}.{field} has {len(tensors)} layers, expected {layers}")
            for i, t in enumerate(tensors):
                label = f"{name}.{field}[{i}]"
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"{label} must be a torch.Tensor, got {type(t).__name__}")
                if tuple(t.shape) != shape or t.dtype != dtype:
                    raise ValueError(f"{label} is {tuple(t.shape)} {t.dtype}, expected {shape} {dtype}")
                if writable and t.device.type != "cpu":
                    raise ValueError(f"{label} is on {t.device}, expected cpu")
                if t.is_meta:
                    raise ValueError(f"{label} is on meta, which holds no bytes")
                if writable and not t.is_contiguous():
                    raise ValueError(f"{label} is not contiguous")
                spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), label))
        if writable:
            if self.kv_buffer[0].device.type == "cpu":
                spans += [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size(), POOL_BUFFERS)
                          for _, _, b in self._buffers()]
            _check_apart(spans)

    def load_cpu_copy(
        self, copy: CpuCopy, token_locs: torch.Tensor, mamba_indices: Any = None,
        req_pool_index: Any = None, *, chunk_size: int = DEFAULT_CHUNK_TOKENS,
    ) -> None:
        """Write a ``get_cpu_copy`` result into ``token_locs`` (same count; may differ from the
        locations it was taken from; none in padding page 0, none twice), every layer (indexer
        bytes where the pool holds an indexer), chunked (any positive size). Other tokens of a
        page are untouched. ``mamba_indices`` / ``req_pool_index``: SGLang's call form, unused
        (see ``get_cpu_copy``)."""
        self._check_copy(copy)
        locs = self._check_locs("token_locs", token_locs, target=True)
        _check_int("chunk_size", chunk_size, 1)
        if locs.numel() != copy.num_tokens:
            raise ValueError(
                f"token_locs has {locs.numel()} locations but the copy holds {copy.num_tokens}"
            )
        self._walk_host_copy(copy, locs, chunk_size, load=True)
