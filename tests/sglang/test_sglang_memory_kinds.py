"""Each of sglang's buffers registered as the memory it is (``plugin/sglang/memory_kinds.py``), and
HiSparse with a draft model refused on decode at start-up over NIXL.

On the CPU: the decision from the CUDA driver's answers (host, pinned host, GPU N; managed and
unknown memory refused), every pointer host memory without CUDA, ``bridge_buffers`` registering
each KV, indexer and aux buffer as its pointer's device (a pool split over devices refused), the
aux buffers' devices reaching the engine's descriptors (HiSparse's: the target's KV on one, the
indexer and a draft model's KV on another), dsa-bridge's manager over sglang's own pool
registering "cpu" here, and HiSparse with a draft model over NIXL refused, naming the flag. On a
GPU (``gpu`` marker): the driver's answers for a device tensor, a pinned and a plain host tensor.
"""

from __future__ import annotations

import pytest
import torch

from .conftest import SGLANG_MISSING, published_context

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool as SGLangPool  # noqa: E402

from dsa_bridge.plugin.sglang.conn import DSABridgeKVManager  # noqa: E402
from dsa_bridge.plugin.sglang.kvargs import bridge_buffers  # noqa: E402
from dsa_bridge.plugin.sglang.memory_kinds import hisparse_problem  # noqa: E402
from dsa_bridge.transfer.memory_kinds import (  # noqa: E402
    CU_MEMORYTYPE_DEVICE,
    CU_MEMORYTYPE_HOST,
    CU_MEMORYTYPE_UNIFIED,
    HOST,
    PINNED_HOST,
    MemoryKind,
    PointerInfo,
    kind_of,
    pointer_info,
)
from dsa_bridge.transfer.plan import as_aux_buffers  # noqa: E402

from .test_sglang_conn import DSV32, kv_args_of  # noqa: E402


def test_the_kind_comes_from_the_drivers_answer_for_the_pointer():
    assert kind_of(0x1000, None) == HOST and HOST.device == "cpu"  # memory CUDA does not know
    assert kind_of(0x1000, PointerInfo(CU_MEMORYTYPE_HOST, -1)) == PINNED_HOST
    assert PINNED_HOST.device == "cpu"  # engines register pinned host memory as host memory
    gpu = kind_of(0x1000, PointerInfo(CU_MEMORYTYPE_DEVICE, 3))
    assert gpu == MemoryKind("gpu", 3) and gpu.device == "cuda:3"
    with pytest.raises(ValueError, match="0x1000 is unified .managed. memory: dsa-bridge registers host"):
        kind_of(0x1000, PointerInfo(CU_MEMORYTYPE_UNIFIED, 0))
    with pytest.raises(ValueError, match="CUDA memory of type 3"):
        kind_of(0x1000, PointerInfo(3, 0))


def test_without_cuda_every_pointer_is_host_memory():
    lookup = pointer_info(cuda=False)
    tensor = torch.zeros(64, dtype=torch.uint8)
    assert kind_of(tensor.data_ptr(), lookup(tensor.data_ptr())) == HOST


@pytest.mark.usefixtures("sglang_context")
def test_each_buffer_is_registered_as_the_device_of_its_pointer():
    args = kv_args_of(SGLangPool(**DSV32))
    args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens = [4096, 8192], [512, 512], [64, 64]
    gpu_aux = 8192  # e.g. SGLANG_MOONCAKE_CUSTOM_MEM_POOL=INTRA_NODE_NVLINK puts the aux on the GPU
    got = bridge_buffers(args, start_layer=0,
                         device_of=lambda ptr: "cuda:1" if ptr == gpu_aux else "cpu")
    assert {d.device for d in got.buffers.buffer_descriptors()} == {"cpu"}
    assert got.aux == [(4096, 512, 64), (8192, 512, 64)] and got.aux_devices == ["cpu", "cuda:1"]
    assert [d.device for d in as_aux_buffers(got.aux_buffers)] == ["cpu", "cuda:1"]
    assert [d.device for d in as_aux_buffers(got.aux)] == ["cpu", "cpu"]  # triples: host memory
    on_gpu = bridge_buffers(args, start_layer=0, device_of=lambda ptr: "cuda:0")
    assert {d.device for d in on_gpu.buffers.buffer_descriptors()} == {"cuda:0"}
    # HiSparse's split (KV in host memory, the indexer on the GPU), unless asked for
    kv = set(args.kv_data_ptrs)
    with pytest.raises(ValueError, match=r"KV and indexer buffers are on \['cpu', 'cuda:0'\]"):
        bridge_buffers(args, start_layer=0, device_of=lambda ptr: "cpu" if ptr in kv else "cuda:0")


def test_hisparse_with_a_draft_model_is_refused_over_nixl_only_naming_the_flag():
    assert hisparse_problem(decode=False, enable_hisparse=True, draft_entries=1) is None
    assert hisparse_problem(decode=True, enable_hisparse=False, draft_entries=1) is None
    assert hisparse_problem(decode=True, enable_hisparse=True) is None  # served
    assert hisparse_problem(decode=True, enable_hisparse=True, draft_entries=1) is None  # served
    refusal = hisparse_problem(decode=True, enable_hisparse=True, draft_entries=1, backend="nixl")
    assert "--enable-hisparse on decode with a draft model (MTP) over nixl" in refusal
    assert "--disaggregation-transfer-backend mooncake" in refusal


@pytest.mark.usefixtures("sglang_context")
def test_hisparses_split_devices_are_taken_each_kind_on_one_device():
    args = kv_args_of(SGLangPool(**DSV32))
    kv = set(args.kv_data_ptrs)
    split = bridge_buffers(args, start_layer=0, split_devices=True,
                           device_of=lambda ptr: "cpu" if ptr in kv else "cuda:0")
    assert {(d.kind, d.device) for d in split.buffers.buffer_descriptors()} == {
        ("kv", "cpu"), ("index", "cuda:0")}
    first = min(kv)
    with pytest.raises(ValueError, match=r"target KV buffers are on \['cpu', 'cuda:1'\]"):
        bridge_buffers(args, start_layer=0, split_devices=True,
                       device_of=lambda ptr: "cuda:1" if ptr == first else "cpu")


def manager(mode: str, draft_entries: int = 0, **fields):
    with published_context(disaggregation_mode=mode, disaggregation_transfer_backend="nixl",
                           **fields) as server_args:
        args = kv_args_of(SGLangPool(**DSV32))
        args.kv_cache_dtype_str, args.num_draft_entries = "fp8_e4m3", draft_entries
        return DSABridgeKVManager(args, DisaggregationMode(mode), server_args, True)


def test_the_manager_refuses_hisparse_with_a_draft_model_over_nixl_at_start_up():
    with pytest.raises(ValueError, match="use --disaggregation-transfer-backend mooncake"):
        manager("decode", draft_entries=1, enable_hisparse=True, disable_radix_cache=True)


def test_the_manager_registers_sglangs_cpu_pool_as_host_memory():
    decode = manager("decode")
    try:
        assert decode.pool.device == "cpu"
        assert {d.device for d in decode.pool.buffer_descriptors()} == {"cpu"}
        assert decode.bridge.aux_devices == ["cpu"]
    finally:
        decode.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_the_drivers_answers_for_device_pinned_and_plain_host_memory():
    lookup = pointer_info(cuda=True)
    device = torch.zeros(64, dtype=torch.uint8, device="cuda:0")
    pinned = torch.zeros(64, dtype=torch.uint8).pin_memory()
    plain = torch.zeros(64, dtype=torch.uint8)
    assert kind_of(device.data_ptr(), lookup(device.data_ptr())) == MemoryKind("gpu", 0)
    assert kind_of(pinned.data_ptr(), lookup(pinned.data_ptr())) == PINNED_HOST
    assert kind_of(plain.data_ptr(), lookup(plain.data_ptr())) == HOST


@pytest.mark.usefixtures("sglang_context")
def test_hisparses_draft_kv_is_taken_on_the_indexers_device():
    """HiSparse with a draft model: the target's KV in host memory, the draft's KV (the last KV
    entry) on the GPU with every indexer."""
    args = kv_args_of(SGLangPool(**DSV32))
    args.num_draft_entries = 1
    host, draft = set(args.kv_data_ptrs[:-1]), args.kv_data_ptrs[-1]
    split = bridge_buffers(args, start_layer=0, split_devices=True,
                           device_of=lambda ptr: "cpu" if ptr in host else "cuda:0")
    assert split.draft_layer_ids == [split.kv_layer_ids[-1]]
    on_gpu = {(d.layer_id, d.kind) for d in split.buffers.buffer_descriptors() if d.device == "cuda:0"}
    assert (split.draft_layer_ids[0], "kv") in on_gpu and all(
        kind == "index" for lid, kind in on_gpu if lid not in split.draft_layer_ids)
    with pytest.raises(ValueError, match=r"indexer and draft KV buffers are on \['cpu', 'cuda:0'\]"):
        bridge_buffers(args, start_layer=0, split_devices=True,
                       device_of=lambda ptr: "cpu" if ptr in {*host, draft} else "cuda:0")
