"""What memory each of sglang's buffers is (host, pinned host, GPU), from its pointer, and the pools
dsa-bridge refuses for their memory (HiSparse on decode with a draft model, over NIXL).

sglang does not say reliably what its ``KVArgs`` pointers are: with ``--enable-hisparse`` the
decode KV pointers are host memory (decode.py ``_init_kv_manager``: the HiSparse coordinator's
host pool) while the DSA indexer stays on the GPU, and the metadata (aux) buffers are host memory
unless ``SGLANG_MOONCAKE_CUSTOM_MEM_POOL=INTRA_NODE_NVLINK`` puts them on the GPU. So the kind of
each buffer is read from its pointer:

- ``kind_of(ptr, info)``, pure: the kind from the CUDA driver's answer for the pointer (``None``:
  memory CUDA does not know, plain host memory); unified (managed) memory and unknown types are
  refused by name;
- ``pointer_info(cuda)``: the driver's lookup (``cuPointerGetAttribute``: memory type and device
  ordinal) where CUDA is present, else a lookup answering ``None`` for every pointer (on a
  machine without CUDA every pointer is host memory);
- ``hisparse_problem``: why a decode rank with HiSparse is refused at start-up (with a draft
  model over NIXL, which sglang's own decode refuses), naming the flag.

A kind's ``device`` is what dsa-bridge registers with the engine: "cpu" for host and pinned host
memory, "cuda:N" for GPU memory.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

# the CUDA driver's CUmemorytype and CUpointer_attribute values (cuda.h)
CU_MEMORYTYPE_HOST = 1
CU_MEMORYTYPE_DEVICE = 2
CU_MEMORYTYPE_UNIFIED = 4
CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
CUDA_ERROR_INVALID_VALUE = 1  # the driver's answer for a pointer it does not know


@dataclass(frozen=True)
class PointerInfo:
    """The CUDA driver's answer for a pointer it knows."""

    memory_type: int
    device_ordinal: int


@dataclass(frozen=True)
class MemoryKind:
    """A buffer's memory: ``name`` "host", "pinned host" or "gpu" (``gpu``: its device ordinal)."""

    name: str
    gpu: int | None = None

    @property
    def device(self) -> str:
        """The device dsa-bridge registers the buffer as: "cpu" or "cuda:N"."""
        return "cpu" if self.gpu is None else f"cuda:{self.gpu}"


HOST = MemoryKind("host")
PINNED_HOST = MemoryKind("pinned host")


def kind_of(ptr: int, info: PointerInfo | None) -> MemoryKind:
    """The memory at ``ptr``, from the driver's ``info`` (None: memory CUDA does not know)."""
    if info is None:
        return HOST
    if info.memory_type == CU_MEMORYTYPE_HOST:
        return PINNED_HOST
    if info.memory_type == CU_MEMORYTYPE_DEVICE and info.device_ordinal >= 0:
        return MemoryKind("gpu", info.device_ordinal)
    what = ("unified (managed) memory" if info.memory_type == CU_MEMORYTYPE_UNIFIED
            else f"CUDA memory of type {info.memory_type} on device {info.device_ordinal}")
    raise ValueError(f"the buffer at {ptr:#x} is {what}: dsa-bridge registers host, pinned host or "
                     "GPU memory only")


def pointer_info(cuda: bool) -> Callable[[int], PointerInfo | None]:
    """The lookup ``kind_of`` takes: the CUDA driver's where ``cuda``, else None for every
    pointer (without CUDA, all memory is host memory)."""
    if not cuda:
        return lambda ptr: None
    driver = ctypes.CDLL("libcuda.so.1")

    def attribute(ptr: int, attr: int, out) -> int:
        return driver.cuPointerGetAttribute(ctypes.byref(out), attr, ctypes.c_uint64(ptr))

    def lookup(ptr: int) -> PointerInfo | None:
        memory_type, ordinal = ctypes.c_uint(0), ctypes.c_int(-1)
        rc = attribute(ptr, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, memory_type)
        if rc == CUDA_ERROR_INVALID_VALUE:
            return None
        if rc == 0:
            rc = attribute(ptr, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ordinal)
        if rc != 0:
            raise OSError(f"cuPointerGetAttribute({ptr:#x}) failed with CUDA error {rc}")
        return PointerInfo(memory_type.value, ordinal.value)

    return lookup


def hisparse_problem(decode: bool, enable_hisparse: bool, draft_entries: int = 0,
                     backend: str = "mooncake") -> str | None:
    """Why this rank cannot run dsa-bridge's transfer with HiSparse; None when it can. Served:
    HiSparse on decode, the KV received into its host pool and the indexer into its device pool,
    each at its own pages; with a draft model (MTP), the draft's KV into the device pool's pages
    beside the indexer (``device_kv_indices``), on Mooncake. Refused: a draft model on NIXL,
    which sglang's own decode refuses on its first request (NotImplementedError, decode.py)."""
    if decode and enable_hisparse and draft_entries and backend != "mooncake":
        return (f"--enable-hisparse on decode with a draft model (MTP) over {backend}: sglang's "
                "decode sends the draft KV's device pages on the Mooncake backend only and "
                "raises NotImplementedError on the first request otherwise (use "
                "--disaggregation-transfer-backend mooncake on both servers)")
    return None
