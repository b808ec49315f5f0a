"""SGLang's ``KVArgs`` as dsa-bridge buffers: pure, no sglang import, no I/O (each buffer's device
comes from the caller's ``device_of``).

SGLang's scheduler fills one ``KVArgs`` per rank (prefill ``_init_kv_manager`` and decode
``_init_kv_manager``, then ``setup_state_kv_args``) and hands it to the transfer's KVManager. For
a DSA pool it holds the KV buffers of every layer (``kv_data_ptrs/lens/item_lens``, the draft
pool's appended, ``num_draft_entries`` of them), one state component ``StateType.DSA`` with one
indexer entry per KV entry (0-row entries for index-sharing layers), and the aux (metadata)
buffers. It does **not** name the layers: for DSA pools sglang 0.5.23 leaves ``kv_layer_ids``
and ``state_layer_ids`` empty (``build_kv_layer_ids`` only names hybrid pools' layers), and
pairs its own entries by position. dsa-bridge derives the ids, the way sglang lays the lists
out:

- target entry ``i`` is global layer ``start_layer + i`` — prefill's ``prefill_start_layer``
  (the pool's ``start_layer``, a pipeline stage's first layer), 0 on decode (one stage), as
  sglang's own MLA span (``start, start + entries``); ``prefill_end_layer`` is not used: for
  these pools it is the pool's ``end_layer``, inclusive, and ``layer_num - 1`` by default
  whatever ``start_layer`` is;
- the draft (MTP) pool's entries follow as the next ids (layers ``num_hidden_layers ..``, as
  sglang's own ``_remap_draft_layer_ids`` numbers them): the model's draft band, since the
  range then ends at the last layer (with pipeline stages only the last stage runs the draft
  and registers its pool, ``EAGLEWorkerV2._hosts_draft``; a stage that did otherwise would name
  the next stage's first layer, and decode refuses stages that hold a layer twice);
- the DSA state list has exactly one entry per KV entry and takes the same ids.

Ids sglang does give are checked against these. The geometry comes from the item lengths
(DSA models' MLA latent is 512 + 64 rope, so a KV row of 1152 bytes is bf16, 656 fp8 "flashmla"
and 576 fp8 "raw"; an indexer row of ``d * 33 / 32`` bytes is head dim ``d`` with one fp32 scale
per 128), and which layers hold an indexer from which state entries have bytes: 0-row entries
make a compact layout, as ``BufferSet.from_buf_infos`` then drops them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

from ...transfer.plan import on_index_pages
from ..descriptors import BufferSet
from ..layout import DSALayout

DSA_STATE = "dsa"
KV_LORA_RANK = 512  # every DSA model sglang builds a DSATokenToKVPool for (DeepSeek-V3.2, GLM-5.x)
QK_ROPE_HEAD_DIM = 64
INDEX_QUANT_BLOCK = 128
KV_DTYPE_BY_ROW = {1152: "bf16", 656: "fp8", 576: "fp8_raw"}


@dataclass(frozen=True)
class BridgeBuffers:
    """What a dsa-bridge node takes from one rank's ``KVArgs``."""

    buffers: BufferSet  # the pool's validated descriptors (``.layout``, ``.buffer_descriptors()``)
    kv_layer_ids: list[int]
    aux: list[tuple[int, int, int]]  # (ptr, nbytes, item_len) of each aux buffer, in order
    aux_devices: list[str]  # where each aux buffer is ("cpu" or "cuda:N")
    draft_layer_ids: list[int]  # the draft (MTP) pool's entries' layer ids (the last entries)

    @property
    def layout(self) -> DSALayout:
        return self.buffers.layout

    @property
    def aux_buffers(self) -> list[tuple[int, int, int, str]]:
        """The aux buffers as a node takes them: (ptr, nbytes, item_len, device)."""
        return [(*info, device) for info, device in zip(self.aux, self.aux_devices, strict=True)]


def dsa_problem(args) -> str | None:
    """None when ``args`` describe a DSA pool dsa-bridge can move; otherwise why not (sglang's
    own connector then moves it)."""
    types = [str(getattr(t, "value", t)) for t in (getattr(args, "state_types", None) or [])]
    if types != [DSA_STATE]:
        return f"state types {types or 'none'} are not exactly sglang's DSA indexer state"
    kv, state = list(args.kv_data_ptrs or []), list(args.state_data_ptrs[0] or [])
    if not kv or len(state) != len(kv):
        return (f"{len(kv)} KV entries but {len(state)} DSA state entries (dsa-bridge needs one "
                "indexer entry per KV entry)")
    return None


def draft_entries(args) -> int:
    """How many of the last KV entries of ``args`` are the draft (MTP) pool's."""
    return int(getattr(args, "num_draft_entries", 0) or 0)


def derive_layer_ids(args, *, start_layer: int) -> list[int]:
    """The global layer id of every KV (and DSA state) entry of ``args`` (module docstring)."""
    total = len(args.kv_data_ptrs)
    draft = draft_entries(args)
    if not 0 <= draft < total:
        raise ValueError(f"num_draft_entries {draft} does not fit {total} KV entries")
    ids = list(range(start_layer, start_layer + total))
    for name, given in (("kv_layer_ids", getattr(args, "kv_layer_ids", None)),
                        ("state_layer_ids", (getattr(args, "state_layer_ids", None) or [[]])[0])):
        if given and list(given) != ids:
            raise ValueError(f"{name} {list(given)} differ from the ids of sglang's layout {ids}")
    return ids


def derive_layout(args, layer_ids: Sequence[int]) -> DSALayout:
    """The pool's ``DSALayout`` from the item lengths and the non-empty state entries."""
    page = int(args.page_size)
    kv_items, lens = set(args.kv_item_lens), list(args.state_data_lens[0])
    state_items = {item for item, n in zip(args.state_item_lens[0], lens, strict=True) if n}
    if len(kv_items) != 1 or len(state_items) != 1:
        raise ValueError(f"KV item lengths {sorted(kv_items)} and indexer item lengths "
                         f"{sorted(state_items)} must each be one value (one geometry per pool)")
    kv_row, index_row = kv_items.pop() / page, state_items.pop() / page
    kv_dtype = KV_DTYPE_BY_ROW.get(kv_row)
    head_dim = index_row * 32 / 33
    if kv_dtype is None or head_dim != int(head_dim):
        raise ValueError(f"a KV row of {kv_row:g} bytes and an indexer row of {index_row:g} bytes "
                         "are not a DSA geometry dsa-bridge knows (KV 1152/656/576 bytes)")
    return DSALayout(
        layer_ids=tuple(layer_ids), page_size=page, kv_lora_rank=KV_LORA_RANK,
        qk_rope_head_dim=QK_ROPE_HEAD_DIM, kv_dtype=kv_dtype, index_head_dim=int(head_dim),
        index_quant_block=INDEX_QUANT_BLOCK,
        index_layers=tuple(lid for lid, n in zip(layer_ids, lens, strict=True) if n))


def bridge_buffers(args, *, start_layer: int,
                   device_of: Callable[[int], str] = lambda ptr: "cpu",
                   split_devices: bool = False) -> BridgeBuffers:
    """One rank's ``KVArgs`` as validated dsa-bridge buffers, each registered as ``device_of`` its
    pointer ("cpu" or "cuda:N", ``memory_kinds``); ValueError naming what does not fit, and for a
    pool whose buffers are not all on one device. ``split_devices`` (sglang's HiSparse decode):
    the target's KV on one device (its host pool), and the indexer with the draft pool's KV on
    one, maybe another (its device pools)."""
    problem = dsa_problem(args)
    if problem:
        raise ValueError(problem)
    ids = derive_layer_ids(args, start_layer=start_layer)
    draft = ids[len(ids) - draft_entries(args):]
    with_indexer = frozenset(draft)  # the KV layers kept with the indexer, under HiSparse
    layout = derive_layout(args, ids)
    found = BufferSet.from_buf_infos(
        layout, (args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens), ids,
        (args.state_data_ptrs[0], args.state_data_lens[0], args.state_item_lens[0]), ids)
    descs = [msgspec.structs.replace(d, device=device_of(d.ptr))
             for d in found.buffer_descriptors()]
    groups = ({"target KV buffers": False, "indexer and draft KV buffers": True}
              if split_devices else {"KV and indexer buffers": None})
    for what, on_index in groups.items():
        devices = sorted({d.device for d in descs if on_index is None
                          or on_index_pages((d.layer_id, d.kind), with_indexer) == on_index})
        if len(devices) > 1:
            raise ValueError(f"the pool's {what} are on {devices}: dsa-bridge moves a pool held on "
                             "one device")
    aux = list(zip(getattr(args, "aux_data_ptrs", None) or [], getattr(args, "aux_data_lens", None) or [],
                   getattr(args, "aux_item_lens", None) or [], strict=True))
    return BridgeBuffers(BufferSet(layout, descs), ids, aux, [device_of(ptr) for ptr, _, _ in aux],
                         draft)
