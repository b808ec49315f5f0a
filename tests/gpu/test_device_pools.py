"""Pools on the device: DeepSeek-V3.2 uniform (61 layers, fp8 656-byte rows and bf16) and GLM-5.2
compact; their descriptors carry the buffers' own pointers and the memory kind (and on CUDA the
driver agrees); each engine registers them; a bad region is refused before the engine sees any
of the batch."""

from __future__ import annotations

import msgspec
import pytest
import torch

from dsa_bridge.plugin import DSALayout, DSATokenToKVPool
from dsa_bridge.plugin.descriptors import BufferDescriptor, raw_region
from dsa_bridge.transfer.backends import create_backend
from dsa_bridge.transfer.backends.base import BackendError
from dsa_bridge.transfer.memory_kinds import kind_of, pointer_info

from .conftest import POOLS

PAGES = 4  # and the padding page


def device_pool(name: str, device: str) -> DSATokenToKVPool:
    model, kv_dtype, layout = POOLS[name]
    return DSATokenToKVPool.from_layout(
        DSALayout.preset(model, kv_dtype=kv_dtype, indexer_layout=layout), size=PAGES * 64,
        device=device)


@pytest.mark.parametrize("name, layers, indexers, row", [
    ("deepseek-v3.2-fp8", 61, 61, 656), ("deepseek-v3.2-bf16", 61, 61, 1152),
    ("glm-5.2-compact", 78, 21, 656)])
def test_descriptors_carry_the_device_pointers_and_kind(device, name, layers, indexers, row):
    pool = device_pool(name, device)
    descs = pool.buffer_descriptors()
    assert [d.kind for d in descs].count("kv") == layers
    assert [d.kind for d in descs].count("index") == indexers
    for d in descs:
        view = pool.page_view(d.layer_id, d.kind)
        assert d.device == device and view.device == torch.device(device)
        assert (d.ptr, d.nbytes, d.item_len) == (view.data_ptr(), view.numel(), view.shape[1])
        assert d.item_len == (row * 64 if d.kind == "kv" else 8448)
    lookup = pointer_info(device != "cpu")  # CUDA's driver: device memory of that ordinal
    assert {kind_of(d.ptr, lookup(d.ptr)).device for d in descs} == {device}


@pytest.mark.parametrize("name", POOLS)
def test_each_engine_registers_a_device_pool(device, engine, name):
    """NIXL registers CUDA buffers as VRAM, Mooncake's CUDA build as location cuda:N."""
    pool = device_pool(name, device)
    backend = create_backend(engine, host="127.0.0.1")
    try:
        backend.register(pool.buffer_descriptors())
        backend.unregister(pool.buffer_descriptors())
    finally:
        backend.close()


def bad_regions(view: torch.Tensor, device: str) -> dict[str, BufferDescriptor]:
    ptr, n = view.data_ptr(), view.numel()
    return {"unknown kind": raw_region(ptr, n, "tpu:0"), "no ordinal": raw_region(ptr, n, "cuda"),
            "null": raw_region(0, n, device), "empty": raw_region(ptr, 0, device),
            "wraps": raw_region(2**64 - 8, 16, device)}


@pytest.mark.parametrize("bad", ["unknown kind", "no ordinal", "null", "empty", "wraps"])
def test_a_bad_region_is_refused_before_the_engine_sees_any(device, engine, bad, monkeypatch):
    pool = device_pool("deepseek-v3.2-fp8", device)
    backend = create_backend(engine, host="127.0.0.1")
    seen = []
    monkeypatch.setattr(backend, "_register_region", seen.append)
    try:
        good = pool.buffer_descriptors()
        region = bad_regions(pool.page_view(0, "kv"), device)[bad]
        with pytest.raises(BackendError, match="register"):
            backend.register([*good[:3], region])
        assert seen == []  # nothing of the batch reached the engine
    finally:
        backend.close()


def test_a_region_claimed_as_other_memory_is_refused_before_the_engine_sees_any(
        device, engine, monkeypatch):
    """A host buffer claimed as cuda:0 (here, where there is no CUDA driver, any cuda claim), and
    on CUDA a device buffer claimed as cpu: the CUDA driver's answer for the pointer decides,
    and the error names the buffer (layer id, cache)."""
    pool = device_pool("deepseek-v3.2-fp8", device)
    host = torch.zeros(1 << 16, dtype=torch.uint8)
    good = pool.buffer_descriptors()
    wrong = [raw_region(host.data_ptr(), host.numel(), "cuda:0"),
             msgspec.structs.replace(good[0], device="cpu" if device != "cpu" else "cuda:0")]
    backend = create_backend(engine, host="127.0.0.1")
    seen = []
    monkeypatch.setattr(backend, "_register_region", seen.append)
    try:
        for region in wrong:
            with pytest.raises(BackendError, match="claims") as refused:
                backend.register([*good[1:4], region])
            assert str(region) in str(refused.value) and "\n" not in str(refused.value)
        assert seen == []  # nothing of either batch reached the engine
    finally:
        backend.close()
