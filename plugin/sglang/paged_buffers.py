"""sglang's buffers as the pool a dsa-bridge node takes (``PagedBuffers``): the validated
descriptors and, for the checksums, each buffer's pages as a uint8 view of sglang's memory."""

from __future__ import annotations

import ctypes

from ...plugin.descriptors import BufferDescriptor, BufferSet


class _DeviceBytes:
    """``nbytes`` of GPU memory at ``ptr``, as torch reads a foreign CUDA array."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3}


class PagedBuffers:
    """sglang's buffers as the pool a dsa-bridge node takes: the validated descriptors (a
    ``BufferSet``) and, for the checksums, each buffer's pages as a uint8 view of sglang's memory
    (``page_view``), made from its pointer on its device; ``device``: the first buffer's."""

    def __init__(self, buffers: BufferSet, device: str):
        self.layout = buffers.layout
        self.device = device
        self._buffers = buffers
        self._by_key = {(d.layer_id, d.kind): d for d in buffers.buffer_descriptors()}

    def buffer_descriptors(self) -> list[BufferDescriptor]:
        return self._buffers.buffer_descriptors()

    def page_view(self, layer_id: int, kind: str):
        """uint8 (pages, page bytes) view of the buffer of ``(layer_id, kind)``, sharing its memory."""
        import torch

        d = self._by_key[(layer_id, kind)]
        if d.device == "cpu":
            raw = torch.frombuffer((ctypes.c_uint8 * d.nbytes).from_address(d.ptr), dtype=torch.uint8)
        else:
            raw = torch.as_tensor(_DeviceBytes(d.ptr, d.nbytes), device=d.device)
        return raw.view(d.nbytes // d.item_len, d.item_len)
