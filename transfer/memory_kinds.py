"""What memory a pointer is (host, pinned host, GPU), read from the CUDA driver, and whether a
region's claimed device is what its pointer is.

A descriptor says which device its memory is on ("cpu" or "cuda:N"); the engines trust it (NIXL
registers "cuda:N" as VRAM, Mooncake as location cuda:N), so a host buffer claimed as a GPU's, or
a GPU buffer claimed as host memory, is refused here before any engine sees it:

- ``kind_of(ptr, info)``, pure: the kind from the CUDA driver's answer for the pointer (``None``:
  memory CUDA does not know, plain host memory); unified (managed) memory and unknown types are
  refused by name;
- ``pointer_info(cuda)``: the driver's lookup (``cuPointerGetAttribute``: memory type and device
  ordinal) where ``cuda``, else a lookup answering ``None`` for every pointer;
- ``process_lookup()``: this process's lookup, or ``None`` where there is no CUDA driver
  (``libcuda.so.1`` does not load): then every memory is host memory;
- ``device_problem(region, lookup)``, pure given the lookup: why the region's ``device`` is not
  what its pointer is (None: it is), naming the region.

A kind's ``device`` is what dsa-bridge registers with the engine: "cpu" for host and pinned host
memory, "cuda:N" for GPU memory.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass

from ..plugin.descriptors import BufferDescriptor

# the CUDA driver's CUmemorytype and CUpointer_attribute values (cuda.h)
CU_MEMORYTYPE_HOST = 1
CU_MEMORYTYPE_DEVICE = 2
CU_MEMORYTYPE_UNIFIED = 4
CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
CUDA_ERROR_INVALID_VALUE = 1  # the driver's answer for a pointer it does not know
CUDA_ERROR_NOT_INITIALIZED = 3  # no CUDA in this process yet: it holds no device memory


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
Lookup = Callable[[int], "PointerInfo | None"]


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


def pointer_info(cuda: bool) -> Lookup:
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
        if rc in (CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_INITIALIZED):
            return None
        if rc == 0:
            rc = attribute(ptr, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ordinal)
        if rc != 0:
            raise OSError(f"cuPointerGetAttribute({ptr:#x}) failed with CUDA error {rc}")
        return PointerInfo(memory_type.value, ordinal.value)

    return lookup


@functools.cache
def process_lookup() -> Lookup | None:
    """This process's driver lookup; None where the CUDA driver (libcuda.so.1) does not load."""
    try:
        return pointer_info(cuda=True)
    except OSError:
        return None


def device_problem(region: BufferDescriptor, lookup: Lookup | None) -> str | None:
    """Why ``region.device`` is not the memory its pointer is, naming the region; None when it
    is. ``lookup`` None: no CUDA driver here, so a region claiming a GPU is refused."""
    if lookup is None:
        if region.device == "cpu":
            return None
        return (f"{region}: claims {region.device} but this process has no CUDA driver "
                "(libcuda.so.1 does not load): every buffer here is host memory ('cpu')")
    try:
        kind = kind_of(region.ptr, lookup(region.ptr))
    except (ValueError, OSError) as exc:
        return f"{region}: {exc}"
    if kind.device != region.device:
        return (f"{region}: claims {region.device} but its pointer is {kind.name} memory "
                f"({kind.device}, the CUDA driver's answer)")
    return None
