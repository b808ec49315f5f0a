"""The connector's pure parts, without vLLM: its extra config and the prefill's answer refused
key by key, the TP source ranks, and vLLM's cache tensors read as a dsa-bridge pool (uniform,
fewer indexers by global layer id, bf16) or refused naming the cache."""

from __future__ import annotations

import pytest
import torch

from dsa_bridge.plugin.vllm.caches import VllmCaches, caches_layout, layer_of
from dsa_bridge.plugin.vllm.options import (
    BridgeOptions,
    PrefillAnswer,
    SourceRanks,
    tp_position,
)
from dsa_bridge.transfer.backends import create_backend

from ..conftest import require_engine

GEOMETRY = dict(page_size=64, kv_lora_rank=512, rope_dim=64, index_head_dim=128)


def dsa_caches(layers=(0, 1, 2, 3), index_layers=None, blocks=6, mla_row=656, index_row=132):
    """Per-layer views into one allocation, as vLLM's ``allocate_kv_cache`` makes them."""
    index_layers = layers if index_layers is None else index_layers
    sizes = [blocks * 64 * mla_row] * len(layers) + [blocks * 64 * index_row] * len(index_layers)
    buf = torch.zeros(sum(sizes), dtype=torch.uint8)
    caches, offset = {}, 0
    for name, row in ([(f"model.layers.{i}.self_attn.attn", mla_row) for i in layers]
                      + [(f"model.layers.{i}.self_attn.indexer.k_cache", index_row) for i in index_layers]):
        caches[name] = buf[offset:offset + blocks * 64 * row].view(blocks, 1, 64, row)
        offset += blocks * 64 * row
    return caches


def test_options_defaults_and_refusals_by_key():
    options = BridgeOptions.parse({"engine": "nixl", "port": 7100, "checksums": True}, producer=True)
    assert (options.engine, options.checksums, options.endpoint(3)) == ("nixl", True, "127.0.0.1:7103")
    assert BridgeOptions.parse(None, producer=False) == BridgeOptions()
    for extra, key in (({"engine": "tcp"}, "'engine'"), ({"checksums": "yes"}, "'checksums'"),
                       ({"port": 70000}, "'port'"), ({"request_timeout_s": 0}, "'request_timeout_s'"),
                       ({"peer_timeout_s": float("nan")}, "'peer_timeout_s'"), ({"colour": 1}, "'colour'"),
                       ({"host": ""}, "'host'")):
        with pytest.raises(ValueError, match=key):
            BridgeOptions.parse(extra, producer=False)
    with pytest.raises(ValueError, match="'port'] is required on a prefill"):
        BridgeOptions.parse({}, producer=True)


def test_nixls_worker_threads_are_set_by_the_key_vllms_own_connector_reads():
    """``num_threads``, as in vLLM's NixlConnector: NIXL's UCX worker threads (fewer saves a
    Mellanox NIC's UARs); unset, dsa-bridge's default; Mooncake has none, so it is refused there."""
    assert BridgeOptions.parse({"engine": "nixl"}, producer=False).backend_options() == {}
    options = BridgeOptions.parse({"engine": "nixl", "num_threads": 0}, producer=False)
    assert options.backend_options() == {"backend_params": {"num_threads": "0"}}
    for value in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"\['num_threads'\] must be a whole number >= 0"):
            BridgeOptions.parse({"engine": "nixl", "num_threads": value}, producer=False)
    with pytest.raises(ValueError, match="'num_threads'] is NIXL's"):
        BridgeOptions.parse({"num_threads": 4}, producer=False)
    require_engine("nixl")
    backend = create_backend("nixl", **options.backend_options())
    try:
        assert backend._agent.get_backend_params("UCX")["num_threads"] == "0"
    finally:
        backend.close()


def test_the_prefill_answer_round_trips_and_is_refused_by_key():
    answer = PrefillAnswer(2**63 - 1, "10.0.0.1", 7100, 2, 130, "mooncake")
    params = answer.to_params()
    assert PrefillAnswer.from_params(params) == answer and answer.endpoint(1) == "10.0.0.1:7101"
    for key, value in (("remote_room", -1), ("remote_room", 2**63), ("remote_port", 0),
                       ("tp_size", 0), ("remote_num_tokens", 0), ("remote_host", ""),
                       ("remote_engine", 3), ("remote_room", True)):
        with pytest.raises(ValueError, match=key):
            PrefillAnswer.from_params({**params, key: value})
    with pytest.raises(ValueError, match="no 'remote_room'"):
        PrefillAnswer.from_params({k: v for k, v in params.items() if k != "remote_room"})


@pytest.mark.parametrize("rank,decode,prefill,want", [
    (0, 1, 1, SourceRanks(0, (), 1)), (3, 4, 2, SourceRanks(1, (), 2)),
    (1, 2, 4, SourceRanks(2, (3,), 1)), (0, 1, 8, SourceRanks(0, tuple(range(1, 8)), 1))])
def test_one_source_rank_per_decode_rank(rank, decode, prefill, want):
    assert SourceRanks.of(rank, decode, prefill) == want


def test_tp_widths_that_do_not_divide_are_refused():
    with pytest.raises(ValueError, match="prefill 3, decode 2"):
        SourceRanks.of(0, 2, 3)


def test_the_tp_rank_comes_from_vllms_parallel_state_where_it_is_initialised():
    assert tp_position((1, 2), 2) == (1, 2)  # worker 1 of vLLM's executor
    assert tp_position((0, 1), 1) == (0, 1)
    assert tp_position(None, 1) == (0, 1)  # no parallel state: rank 0 of the configured size
    assert tp_position(None, 4) == (0, 4)
    for state, size in (((0, 1), 2), ((1, 2), 4), ((2, 2), 2), ((-1, 2), 2)):
        with pytest.raises(ValueError, match=f"TP rank {state[0]} of {state[1]}, but its config "
                                             f"has tensor_parallel_size {size}$"):
            tp_position(state, size)


def test_vllm_caches_become_descriptors_by_global_layer_id():
    caches = dsa_caches()
    pool = VllmCaches(caches, **GEOMETRY)
    assert pool.layout.kv_dtype == "fp8" and pool.layout.index_layer_ids == (0, 1, 2, 3)
    descs = {(d.layer_id, d.kind): d for d in pool.buffer_descriptors()}
    kv = descs[(2, "kv")]
    assert (kv.ptr, kv.item_len, kv.nbytes) == (caches["model.layers.2.self_attn.attn"].data_ptr(),
                                                 64 * 656, 6 * 64 * 656)
    assert descs[(3, "index")].item_len == 8448
    caches["model.layers.1.self_attn.indexer.k_cache"][4].fill_(7)
    assert bool((pool.page_view(1, "index")[4] == 7).all()) and int(pool.page_view(1, "index")[3].sum()) == 0


def test_fewer_indexers_and_bf16_rows():
    layout, _, _ = caches_layout(dsa_caches(index_layers=(0, 3)), **GEOMETRY)
    assert layout.index_layer_ids == (0, 3)
    assert caches_layout(dsa_caches(mla_row=1152, index_layers=()), **GEOMETRY)[0].kv_dtype == "bf16"


@pytest.mark.parametrize("caches,message", [
    (lambda: dsa_caches(mla_row=600), "'model.layers.0.self_attn.attn': 600 bytes per token is no MLA row"),
    (lambda: dsa_caches(index_row=136),
     "indexer.k_cache': 8704 bytes per block, the layout's index page is 8448"),
    (lambda: {"model.embed.attn": torch.zeros(4, 64, 656, dtype=torch.uint8)}, "no 'layers.N.'"),
    (lambda: {**dsa_caches(), "model.layers.9.self_attn.indexer.k_cache":
              torch.zeros(6, 1, 64, 132, dtype=torch.uint8)}, "layer 9 has an indexer cache but no MLA"),
    (lambda: {"model.layers.0.self_attn.attn":
              torch.zeros(64, 6, 656, dtype=torch.uint8).transpose(0, 1)}, "not one after the other"),
])
def test_a_shape_not_served_is_refused_naming_the_cache(caches, message):
    with pytest.raises(ValueError, match=message):
        VllmCaches(caches(), **GEOMETRY)


def test_layer_names():
    assert layer_of("model.layers.17.self_attn.indexer.k_cache") == (17, "index")
    assert layer_of("language_model.model.layers.3.self_attn.attn") == (3, "kv")
