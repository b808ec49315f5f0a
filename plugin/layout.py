"""DSA pool geometry: which layers hold which caches, how many bytes per row and per page, and a
stable layout hash.

Pure byte math (no I/O) except the preset/config loader at the bottom. Everything both sides of a
transfer must agree on lives in ``DSALayout``; its ``layout_hash`` covers every byte-affecting field
plus ``LAYOUT_VERSION``.

Layer sets (invariant 7): every layer in ``layer_ids`` holds an MLA KV buffer; the layers in
``index_layer_ids`` also hold an indexer buffer. ``uniform`` (the default, what the seed reverted
to): all of them. ``compact`` (opt-in): only the layers that produce their own top-k; an
index-sharing ("shared", skip-topk) layer's indexer is *absent* — no buffer, no descriptor, no
entry of any kind — never a zero-size one. Both come from one function of the model config,
``index_layer_ids_for``.

Formulas (design §3), per layer and per token:

- MLA KV row: bf16 ``(kv_lora_rank + qk_rope_head_dim) * 2`` bytes; fp8 "flashmla"
  ``kv_lora_rank + kv_lora_rank // 128 * 4 + qk_rope_head_dim * 2`` (656 for DeepSeek);
  fp8 "raw" ``kv_lora_rank + qk_rope_head_dim`` (576, one byte per element).
- indexer row: ``index_head_dim`` fp8 key bytes + ``index_head_dim // index_quant_block * 4``
  fp32 scale bytes (132). A page is ``page_size`` of each (KV 41,984 fp8 / indexer 8,448 at p64).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

# Changelog (bump when a hashed field's meaning changes):
#   1: initial layout (layer ids, page size, MLA rows bf16/fp8/fp8_raw, indexer key+scale page).
#   2: index_layer_ids: which layers hold an indexer buffer (uniform: all; compact: producers).
LAYOUT_VERSION = 2

KV_DTYPES = ("bf16", "fp8", "fp8_raw")
PRESETS = ("deepseek-v3.2", "glm-5.2")
INDEXER_LAYOUTS = ("uniform", "compact")

FLASHMLA_QUANT_TILE = 128  # fp8 "flashmla" row: one fp32 scale per 128 latent elements
SCALE_BYTES = 4  # fp32

_INT_FIELDS = (
    "page_size",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "index_head_dim",
    "index_quant_block",
)
# Per-layer byte geometry, in the order geometry_difference compares it.
_GEOMETRY_FIELDS = ("page_size", "kv_dtype", *_INT_FIELDS[1:])
_DERIVED_FIELDS = ("kv_row_bytes", "kv_page_bytes", "index_row_bytes", "index_page_bytes")
_BASE_FIELDS = ("layer_ids", "kv_dtype", *_INT_FIELDS)


def _require_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _layer_tuple(name: str, value: Any, *, allow_empty: bool) -> tuple[int, ...]:
    """A tuple of non-negative, strictly increasing global layer ids, or ValueError naming it."""
    if not isinstance(value, (tuple, list, range)) or (not value and not allow_empty):
        raise ValueError(f"{name} must be a non-empty sequence, got {value!r}")
    ids = tuple(value)
    for i, lid in enumerate(ids):
        _require_int(f"{name}[{i}]", lid, minimum=0)
    for i in range(1, len(ids)):
        if ids[i] <= ids[i - 1]:
            raise ValueError(
                f"{name} must be unique and strictly increasing: {name}[{i}]={ids[i]} after {ids[i - 1]}"
            )
    return ids


@dataclass(frozen=True)
class DSALayout:
    """Geometry of a DSA pool: every layer in ``layer_ids`` has a KV buffer, every layer in
    ``index_layer_ids`` also an indexer buffer: ``index_layers``, or all layers when it is None
    (the uniform pool; a tuple equal to ``layer_ids`` is stored as None).

    Validation rules: ``layer_ids`` non-empty, non-negative, strictly increasing (global ids);
    ``index_layers`` a strictly increasing subset of them; ``page_size`` a power of two; all
    dims > 0; ``kv_lora_rank % 128 == 0`` for fp8 (flashmla scales); ``index_head_dim %
    index_quant_block == 0``.
    """

    layer_ids: tuple[int, ...]
    page_size: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    kv_dtype: str
    index_head_dim: int
    index_quant_block: int = 128
    index_layers: tuple[int, ...] | None = None  # None: every layer (uniform)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", _layer_tuple("layer_ids", self.layer_ids, allow_empty=False))
        if self.index_layers is not None:
            index_ids = _layer_tuple("index_layer_ids", self.index_layers, allow_empty=True)
            stray = sorted(set(index_ids) - set(self.layer_ids))
            if stray:
                raise ValueError(f"index_layer_ids: layer {stray[0]} is not in layer_ids")
            # one spelling per layout: "every layer" is None, so equal layouts compare equal
            object.__setattr__(self, "index_layers", None if index_ids == self.layer_ids else index_ids)
        for name in _INT_FIELDS:
            _require_int(name, getattr(self, name), minimum=1)
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if self.kv_dtype == "fp8" and self.kv_lora_rank % FLASHMLA_QUANT_TILE:
            raise ValueError(
                f"kv_lora_rank must be a multiple of {FLASHMLA_QUANT_TILE} for kv_dtype 'fp8', "
                f"got {self.kv_lora_rank}"
            )
        if self.index_head_dim % self.index_quant_block:
            raise ValueError(
                f"index_head_dim ({self.index_head_dim}) must be a multiple of index_quant_block "
                f"({self.index_quant_block})"
            )

    # ---- byte math -------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)

    @property
    def kv_row_bytes(self) -> int:
        """Bytes of one token's MLA KV row in one layer."""
        if self.kv_dtype == "bf16":
            return (self.kv_lora_rank + self.qk_rope_head_dim) * 2
        if self.kv_dtype == "fp8":
            scales = self.kv_lora_rank // FLASHMLA_QUANT_TILE * SCALE_BYTES
            return self.kv_lora_rank + scales + self.qk_rope_head_dim * 2
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kv_elem_bytes(self) -> int:
        """Bytes per element of the KV buffer's storage dtype (bf16 2; fp8 kinds are uint8: 1)."""
        return 2 if self.kv_dtype == "bf16" else 1

    @property
    def kv_cache_dim(self) -> int:
        """Last dim of the KV buffer in its storage dtype (576 bf16 / 656 fp8 / 576 fp8_raw)."""
        return self.kv_row_bytes // self.kv_elem_bytes

    @property
    def kv_page_bytes(self) -> int:
        """item_len of a KV page."""
        return self.kv_row_bytes * self.page_size

    @property
    def index_scale_bytes(self) -> int:
        """fp32 scale bytes of one token's indexer key."""
        return self.index_head_dim // self.index_quant_block * SCALE_BYTES

    @property
    def index_row_bytes(self) -> int:
        """Bytes of one token's indexer entry (key + scales)."""
        return self.index_head_dim + self.index_scale_bytes

    @property
    def index_page_bytes(self) -> int:
        """item_len of an indexer page: all keys of the page, then all their scales."""
        return self.page_size * self.index_row_bytes

    @property
    def bytes_per_token(self) -> int:
        """Every layer's KV row plus the indexer row of every layer that holds an indexer."""
        return self.num_layers * self.kv_row_bytes + len(self.index_layer_ids) * self.index_row_bytes

    # ---- layer sets ------------------------------------------------------------------------
    @property
    def index_layer_ids(self) -> tuple[int, ...]:
        """The layers that hold an indexer buffer, in order."""
        return self.layer_ids if self.index_layers is None else self.index_layers

    @property
    def indexer_layout(self) -> str:
        """"uniform" when every layer holds an indexer, else "compact"."""
        return "uniform" if self.index_layers is None else "compact"

    def holds_indexer(self, layer_id: int) -> bool:
        return layer_id in self.index_layer_ids

    def indexer_producer(self, layer_id: int) -> int | None:
        """The layer whose indexer (and top-k) ``layer_id`` reuses: the nearest layer at or
        before it that holds one; None when that layer is outside this layout."""
        before = [lid for lid in self.index_layer_ids if lid <= layer_id]
        return before[-1] if before else None

    def absent_indexer(self, layer_id: int) -> str:
        """Why layer ``layer_id`` has no indexer here, naming its producer."""
        producer = self.indexer_producer(layer_id)
        source = (f"it reuses layer {producer}'s" if producer is not None
                  else "its producer is outside this layout")
        return f"layer {layer_id} holds no indexer in this {self.indexer_layout} layout ({source})"

    # ---- identity --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Plain JSON/msgpack-safe dict: version, base fields, and the derived byte sizes."""
        d: dict[str, Any] = {"layout_version": LAYOUT_VERSION, "layer_ids": list(self.layer_ids),
                             "index_layer_ids": list(self.index_layer_ids)}
        d.update({name: getattr(self, name) for name in ("kv_dtype", *_INT_FIELDS)})
        d.update({name: getattr(self, name) for name in _DERIVED_FIELDS})
        return d

    def layout_hash(self) -> str:
        """sha256 hex of the canonical JSON of ``to_dict()`` (which includes LAYOUT_VERSION)."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DSALayout:
        """Inverse of ``to_dict``. Unknown keys, a missing base field, or a present
        ``layout_version``/derived size that disagrees -> ValueError naming it."""
        if not isinstance(d, dict):
            raise ValueError(f"layout must be a dict, got {type(d).__name__}")
        known = {"layout_version", "index_layer_ids", *_BASE_FIELDS, *_DERIVED_FIELDS}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown layout field(s): {', '.join(map(str, unknown))}")
        version = d.get("layout_version", LAYOUT_VERSION)
        if version != LAYOUT_VERSION:
            raise ValueError(f"layout_version: {version!r} != {LAYOUT_VERSION} (this build)")
        missing = [name for name in (*_BASE_FIELDS, "index_layer_ids")
                   if name not in d and name != "index_quant_block"]
        if missing:
            raise ValueError(f"layout field missing: {missing[0]}")
        for name in ("layer_ids", "index_layer_ids"):
            if not isinstance(d[name], (list, tuple)):
                raise ValueError(f"{name} must be a list, got {d[name]!r}")
        layout = cls(**{name: d[name] for name in _BASE_FIELDS if name in d},
                     index_layers=tuple(d["index_layer_ids"]))
        for name in _DERIVED_FIELDS:
            if name in d and d[name] != getattr(layout, name):
                raise ValueError(f"{name}: {d[name]!r} != {getattr(layout, name)} (computed)")
        return layout

    def first_difference(self, other: DSALayout) -> str | None:
        """None when equal, else ``"<field>: <mine> != <theirs>"`` for the first differing field:
        the layer sets (by count, then by id), then the byte geometry."""
        for name in ("layer_ids", "index_layer_ids"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if len(mine) != len(theirs):
                return f"{name}: {len(mine)} layers != {len(theirs)} layers"
            for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
                if a != b:
                    return f"{name}[{i}]: {a} != {b}"
        return self.geometry_difference(other)

    def geometry_difference(self, other: DSALayout) -> str | None:
        """Like ``first_difference`` but for the per-layer byte geometry only (page size, dtypes,
        dims): what two sides must share whatever layers each of them holds."""
        for name in _GEOMETRY_FIELDS:
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                return f"{name}: {a} != {b}"
        return None

    # ---- construction from model configs ------------------------------------------------
    @classmethod
    def from_hf_config(
        cls,
        config: dict[str, Any],
        *,
        page_size: int = 64,
        kv_dtype: str = "fp8",
        start_layer: int | None = None,
        end_layer: int | None = None,
        include_draft_layers: bool = False,
        indexer_layout: str = "uniform",
    ) -> DSALayout:
        """Layout of layers ``start_layer .. end_layer-1`` (global ids; default all hidden layers),
        plus the ``num_nextn_predict_layers`` draft/MTP layers (ids ``num_hidden_layers ..``) when
        ``include_draft_layers``; ``indexer_layout`` "uniform" or "compact" (see
        ``index_layer_ids_for``). A pool of a layer range is one pipeline stage."""
        n = _config_int(config, "num_hidden_layers")
        start = 0 if start_layer is None else start_layer
        end = n if end_layer is None else end_layer
        _require_int("start_layer", start, minimum=0)
        _require_int("end_layer", end, minimum=start + 1)
        if end > n:
            raise ValueError(f"end_layer ({end}) exceeds num_hidden_layers ({n})")
        layer_ids = list(range(start, end))
        if include_draft_layers:
            draft = _config_int(config, "num_nextn_predict_layers", minimum=0)
            layer_ids.extend(range(n, n + draft))
        return cls(
            layer_ids=tuple(layer_ids),
            index_layers=index_layer_ids_for(config, layer_ids, indexer_layout),
            page_size=page_size,
            kv_lora_rank=_config_int(config, "kv_lora_rank"),
            qk_rope_head_dim=_config_int(config, "qk_rope_head_dim"),
            kv_dtype=kv_dtype,
            index_head_dim=_config_int(config, "index_head_dim"),
            index_quant_block=_config_int(config, "index_quant_block", default=128),
        )

    @classmethod
    def preset(cls, name: str, **kw: Any) -> DSALayout:
        """``from_hf_config`` of a bundled preset ("deepseek-v3.2", "glm-5.2")."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
        return cls.from_hf_config(load_model_config(name), **kw)


def _config_int(
    config: dict[str, Any], key: str, *, minimum: int = 1, default: int | None = None
) -> int:
    if not isinstance(config, dict):
        raise ValueError(f"model config must be a dict, got {type(config).__name__}")
    if key not in config:
        if default is None:
            raise ValueError(f"model config is missing {key!r}")
        return default
    _require_int(f"config[{key!r}]", config[key], minimum=minimum)
    return config[key]


def index_layer_ids_for(config: dict[str, Any], layer_ids: Any, indexer_layout: str) -> tuple[int, ...]:
    """The layers of ``layer_ids`` that hold an indexer buffer (invariant 7): all of them for
    "uniform"; for "compact" all but the model's skip-topk (index-sharing) layers, which never
    read an indexer cache. Draft/MTP layers always keep theirs."""
    if indexer_layout not in INDEXER_LAYOUTS:
        raise ValueError(f"indexer_layout must be one of {INDEXER_LAYOUTS}, got {indexer_layout!r}")
    if indexer_layout == "uniform":
        return tuple(layer_ids)
    skipped = set(skip_topk_layer_ids(config))
    return tuple(lid for lid in layer_ids if lid not in skipped)


def skip_topk_layer_ids(config: dict[str, Any]) -> tuple[int, ...]:
    """Hidden layers that reuse another layer's top-k (GLM-5.2 index sharing).

    ``indexer_types[l]`` ("full"/"shared") wins; else ``index_topk_pattern`` ("S" = skip); else
    layer l skips iff ``max(l - index_skip_topk_offset + 1, 0) % index_topk_freq != 0`` (the offset
    is required when freq > 1). Draft/MTP layers never skip. No such keys (DeepSeek-V3.2) -> ().
    """
    n = _config_int(config, "num_hidden_layers")
    types = config.get("indexer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != n:
            raise ValueError(f"indexer_types must be a list of {n} entries (num_hidden_layers)")
        bad = [t for t in types if t not in ("full", "shared")]
        if bad:
            raise ValueError(f"indexer_types entries must be 'full' or 'shared', got {bad[0]!r}")
        return tuple(i for i, t in enumerate(types) if t == "shared")
    pattern = config.get("index_topk_pattern")
    if pattern is not None:
        if not isinstance(pattern, str) or len(pattern) != n:
            raise ValueError(f"index_topk_pattern must be a string of {n} characters")
        return tuple(i for i, c in enumerate(pattern) if c == "S")
    freq = _config_int(config, "index_topk_freq", default=1)
    if freq == 1:
        return ()
    if "index_skip_topk_offset" not in config:
        raise ValueError(
            "model config has index_topk_freq > 1 but is missing 'index_skip_topk_offset'"
        )
    offset = _config_int(config, "index_skip_topk_offset", minimum=0)
    return tuple(i for i in range(n) if max(i - offset + 1, 0) % freq != 0)


def load_model_config(name_or_path: str | Path) -> dict[str, Any]:
    """A bundled preset by name, or an HF ``config.json`` (a file, or a directory holding one)."""
    if isinstance(name_or_path, str) and name_or_path in PRESETS:
        text = resources.files(__package__).joinpath("presets", f"{name_or_path}.json").read_text()
        return json.loads(text)
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"model config {str(name_or_path)!r} is neither a preset ({', '.join(PRESETS)}) "
            "nor a config.json file"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read model config {str(path)!r}: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"model config {str(path)!r} is not a JSON object")
    return config
