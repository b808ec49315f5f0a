"""DSALayout: validation, byte math (design §3 worked numbers), hash, serialisation, configs."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from dsa_bridge.plugin import (
    LAYOUT_VERSION,
    PRESETS,
    DSALayout,
    index_layer_ids_for,
    load_model_config,
    skip_topk_layer_ids,
)

BASE = DSALayout(
    layer_ids=tuple(range(61)),
    page_size=64,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    kv_dtype="fp8",
    index_head_dim=128,
)


# ---- byte math --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kv_dtype", "row", "page", "cell"),
    [
        ("fp8", 656, 41_984, 48_068),
        ("fp8_raw", 576, 36_864, 43_188),
        ("bf16", 1152, 73_728, 78_324),
    ],
)
def test_deepseek_v32_byte_math(kv_dtype, row, page, cell):
    layout = DSALayout.preset("deepseek-v3.2", kv_dtype=kv_dtype)
    assert layout.num_layers == 61
    assert layout.kv_row_bytes == row
    assert layout.kv_page_bytes == page
    assert layout.index_row_bytes == 132
    assert layout.index_page_bytes == 8_448
    assert layout.bytes_per_token == cell


def test_deepseek_v32_with_mtp_draft_layer():
    layout = DSALayout.preset("deepseek-v3.2", include_draft_layers=True)
    assert layout.layer_ids == tuple(range(62))
    assert layout.bytes_per_token == 48_856 == 48_068 + 788


def test_glm52_uniform_cell():
    layout = DSALayout.preset("glm-5.2", kv_dtype="fp8_raw")
    assert layout.num_layers == 78
    assert layout.bytes_per_token == 55_224


def test_kv_cache_dim_per_dtype():
    assert dataclasses.replace(BASE, kv_dtype="bf16").kv_cache_dim == 576
    assert BASE.kv_cache_dim == 656
    assert dataclasses.replace(BASE, kv_dtype="fp8_raw").kv_cache_dim == 576


def test_index_row_scales_with_quant_blocks():
    layout = dataclasses.replace(BASE, index_head_dim=256, index_quant_block=64)
    assert layout.index_scale_bytes == 16
    assert layout.index_row_bytes == 272
    assert layout.index_page_bytes == 64 * 272


# ---- validation -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"layer_ids": ()}, "layer_ids"),
        ({"layer_ids": (0, 0)}, "layer_ids"),
        ({"layer_ids": (2, 1)}, "layer_ids"),
        ({"layer_ids": (-1,)}, r"layer_ids\[0\]"),
        ({"layer_ids": (0, True)}, r"layer_ids\[1\]"),
        ({"page_size": 0}, "page_size"),
        ({"page_size": 48}, "page_size"),
        ({"page_size": 64.0}, "page_size"),
        ({"kv_lora_rank": 500}, "kv_lora_rank"),
        ({"kv_lora_rank": -512}, "kv_lora_rank"),
        ({"qk_rope_head_dim": 0}, "qk_rope_head_dim"),
        ({"kv_dtype": "fp16"}, "kv_dtype"),
        ({"index_head_dim": 100}, "index_head_dim"),
        ({"index_quant_block": 0}, "index_quant_block"),
    ],
)
def test_invalid_field_names_it(change, field):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(BASE, **change)


def test_kv_lora_rank_constraint_only_for_flashmla_fp8():
    assert dataclasses.replace(BASE, kv_dtype="fp8_raw", kv_lora_rank=500).kv_row_bytes == 564
    assert dataclasses.replace(BASE, kv_dtype="bf16", kv_lora_rank=500).kv_row_bytes == 1128


def test_layer_ids_list_becomes_tuple_and_layout_is_frozen():
    layout = dataclasses.replace(BASE, layer_ids=[3, 4])
    assert layout.layer_ids == (3, 4)
    assert dataclasses.replace(BASE, layer_ids=range(3, 5)) == layout
    hash(layout)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.page_size = 32  # type: ignore[misc]


# ---- hash, serialisation, differences ------------------------------------------------------
# A change of any byte-affecting field must change the hash.
CHANGES = [
    ("layer_ids", tuple(range(60))),
    ("layer_ids", tuple(range(1, 62))),
    ("page_size", 32),
    ("kv_lora_rank", 384),
    ("qk_rope_head_dim", 32),
    ("kv_dtype", "bf16"),
    ("kv_dtype", "fp8_raw"),
    ("index_head_dim", 256),
    ("index_quant_block", 64),
    ("index_layers", (0, 1, 2, 6)),
    ("index_layers", ()),
]


def test_hash_equal_for_equal_layouts():
    again = DSALayout.preset("deepseek-v3.2")
    assert again == BASE
    assert again.layout_hash() == BASE.layout_hash()
    assert len(BASE.layout_hash()) == 64
    int(BASE.layout_hash(), 16)


@pytest.mark.parametrize(("field", "value"), CHANGES)
def test_hash_changes_with_every_field(field, value):
    other = dataclasses.replace(BASE, **{field: value})
    assert other.layout_hash() != BASE.layout_hash()


def test_hash_golden_value():
    # Pinned on purpose: if this changes, the hashed fields' meaning changed -> bump LAYOUT_VERSION
    # (peers on the old version must then fail the handshake) and update the literal.
    assert LAYOUT_VERSION == 2
    assert BASE.layout_hash() == "472dae3ec5d8881ded3815fbcd90829f4f73fe81bce07ef840a9f61e47a05afa"


def test_hash_stable_across_processes():
    code = (
        "from dsa_bridge.plugin.layout import DSALayout;"
        "print(DSALayout.preset('deepseek-v3.2').layout_hash())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == BASE.layout_hash()


@pytest.mark.parametrize(("field", "value"), [(None, None), *CHANGES])
def test_to_dict_from_dict_round_trip(field, value):
    layout = BASE if field is None else dataclasses.replace(BASE, **{field: value})
    d = json.loads(json.dumps(layout.to_dict()))
    assert d["layout_version"] == LAYOUT_VERSION
    assert d["kv_page_bytes"] == layout.kv_page_bytes
    back = DSALayout.from_dict(d)
    assert back == layout
    assert back.layout_hash() == layout.layout_hash()


def test_from_dict_defaults_quant_block_and_accepts_no_derived_fields():
    base = ("layer_ids", "index_layer_ids", "page_size", "kv_lora_rank", "qk_rope_head_dim", "kv_dtype")
    d = {k: v for k, v in BASE.to_dict().items() if k in (*base, "index_head_dim")}
    assert DSALayout.from_dict(d) == BASE


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.pop("page_size"), "page_size"),
        (lambda d: d.pop("layer_ids"), "layer_ids"),
        (lambda d: d.pop("index_layer_ids"), "index_layer_ids"),
        (lambda d: d.update(index_layer_ids=[0, 99]), "index_layer_ids"),
        (lambda d: d.update(index_layer_ids=[3, 2]), "index_layer_ids"),
        (lambda d: d.update(layer_ids="0-60"), "layer_ids"),
        (lambda d: d.update(kv_dtype="int4"), "kv_dtype"),
        (lambda d: d.update(kv_page_bytes=40_000), "kv_page_bytes"),
        (lambda d: d.update(index_page_bytes=0), "index_page_bytes"),
        (lambda d: d.update(layout_version=LAYOUT_VERSION + 1), "layout_version"),
        (lambda d: d.update(colour="blue"), "colour"),
    ],
)
def test_from_dict_names_bad_field(mutate, field):
    d = BASE.to_dict()
    mutate(d)
    with pytest.raises(ValueError, match=field):
        DSALayout.from_dict(d)


def test_from_dict_refuses_non_dict():
    with pytest.raises(ValueError, match="dict"):
        DSALayout.from_dict([1, 2])  # type: ignore[arg-type]


def test_first_difference():
    assert BASE.first_difference(DSALayout.preset("deepseek-v3.2")) is None
    r = dataclasses.replace
    assert BASE.first_difference(r(BASE, page_size=32)) == "page_size: 64 != 32"
    assert (
        BASE.first_difference(r(BASE, layer_ids=tuple(range(60))))
        == "layer_ids: 61 layers != 60 layers"
    )
    other_ids = (0, 1, 2, 4, *range(5, 62))
    assert BASE.first_difference(r(BASE, layer_ids=other_ids)) == "layer_ids[3]: 3 != 4"
    assert BASE.first_difference(r(BASE, kv_dtype="bf16")) == "kv_dtype: fp8 != bf16"
    # several differences: the first in comparison order is reported
    many = r(BASE, page_size=32, kv_lora_rank=256, index_head_dim=256)
    assert BASE.first_difference(many) == "page_size: 64 != 32"


@pytest.mark.parametrize(("field", "value"), CHANGES)
def test_first_difference_names_each_field(field, value):
    msg = BASE.first_difference(dataclasses.replace(BASE, **{field: value}))
    assert msg is not None and msg.startswith("index_layer_ids" if field == "index_layers" else field)


# ---- model configs ------------------------------------------------------------------------------
def test_from_hf_config_pipeline_slice_keeps_global_ids():
    config = load_model_config("deepseek-v3.2")
    tail = DSALayout.from_hf_config(config, start_layer=30)
    assert tail.layer_ids == tuple(range(30, 61))
    head = DSALayout.from_hf_config(config, end_layer=30, include_draft_layers=True)
    assert head.layer_ids == (*range(30), 61)
    mid = DSALayout.from_hf_config(config, start_layer=10, end_layer=20, page_size=32)
    assert mid.layer_ids == tuple(range(10, 20))
    assert mid.page_size == 32


@pytest.mark.parametrize(
    "key", ["num_hidden_layers", "kv_lora_rank", "qk_rope_head_dim", "index_head_dim"]
)
def test_from_hf_config_missing_key(key):
    config = load_model_config("deepseek-v3.2")
    del config[key]
    with pytest.raises(ValueError, match=key):
        DSALayout.from_hf_config(config)


def test_from_hf_config_draft_layers_need_the_key():
    config = load_model_config("deepseek-v3.2")
    del config["num_nextn_predict_layers"]
    assert DSALayout.from_hf_config(config).num_layers == 61
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        DSALayout.from_hf_config(config, include_draft_layers=True)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"start_layer": -1}, "start_layer"),
        ({"end_layer": 62}, "end_layer"),
        ({"start_layer": 30, "end_layer": 30}, "end_layer"),
        ({"page_size": 100}, "page_size"),
        ({"kv_dtype": "fp4"}, "kv_dtype"),
    ],
)
def test_from_hf_config_bad_arguments(kw, field):
    with pytest.raises(ValueError, match=field):
        DSALayout.from_hf_config(load_model_config("deepseek-v3.2"), **kw)


def test_from_hf_config_reads_index_quant_block():
    config = {**load_model_config("deepseek-v3.2"), "index_quant_block": 64}
    assert DSALayout.from_hf_config(config).index_row_bytes == 136


def test_preset_names():
    assert PRESETS == ("deepseek-v3.2", "glm-5.2")
    with pytest.raises(ValueError, match="deepseek-v3.2, glm-5.2"):
        DSALayout.preset("llama")


def test_load_model_config_paths(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(load_model_config("glm-5.2")))
    assert load_model_config(str(tmp_path)) == load_model_config("glm-5.2")
    assert load_model_config(tmp_path / "config.json")["num_hidden_layers"] == 78
    with pytest.raises(ValueError, match="neither a preset"):
        load_model_config("no-such-model")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        load_model_config(str(tmp_path / "bad.json"))
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match="not a JSON object"):
        load_model_config(str(tmp_path / "list.json"))


# ---- index sharing and the one "who owns an indexer" function -------------------
GLM_FULL = (0, 1, 2, *range(6, 75, 4))


def test_glm52_skip_rule_from_indexer_types():
    config = load_model_config("glm-5.2")
    skipped = skip_topk_layer_ids(config)
    assert len(skipped) == 57
    assert sorted(set(range(78)) - set(skipped)) == list(GLM_FULL)
    assert len(GLM_FULL) == 21 and GLM_FULL[-1] == 74


def test_glm52_skip_rule_from_freq_and_offset_agrees():
    config = load_model_config("glm-5.2")
    del config["indexer_types"]
    assert skip_topk_layer_ids(config) == skip_topk_layer_ids(load_model_config("glm-5.2"))


def test_indexer_types_win_over_freq():
    config = {**load_model_config("glm-5.2"), "indexer_types": ["full"] * 77 + ["shared"]}
    assert skip_topk_layer_ids(config) == (77,)


def test_index_topk_pattern():
    config = {"num_hidden_layers": 4, "index_topk_pattern": "FSFS", "index_topk_freq": 4}
    assert skip_topk_layer_ids(config) == (1, 3)


def test_deepseek_has_no_skip_layers():
    assert skip_topk_layer_ids(load_model_config("deepseek-v3.2")) == ()
    assert skip_topk_layer_ids({"num_hidden_layers": 8, "index_topk_freq": 1}) == ()


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"index_topk_freq": 4}, "index_skip_topk_offset"),
        ({"index_topk_freq": 0, "index_skip_topk_offset": 3}, "index_topk_freq"),
        ({"indexer_types": ["full"] * 3}, "indexer_types"),
        ({"indexer_types": ["full"] * 7 + ["sparse"]}, "indexer_types"),
        ({"index_topk_pattern": "FS"}, "index_topk_pattern"),
    ],
)
def test_skip_rule_bad_config(extra, field):
    with pytest.raises(ValueError, match=field):
        skip_topk_layer_ids({"num_hidden_layers": 8, **extra})


def test_uniform_is_the_default_and_every_layer_holds_an_indexer():
    layout = DSALayout.preset("glm-5.2", kv_dtype="fp8_raw", include_draft_layers=True)
    assert layout.index_layer_ids == layout.layer_ids == tuple(range(79))
    assert layout.indexer_layout == "uniform"
    assert index_layer_ids_for(load_model_config("glm-5.2"), range(78), "uniform") == tuple(range(78))
