"""What memory each of sglang's buffers is (host, pinned host, GPU), from its pointer, and the pools
dsa-bridge refuses for their memory (HiSparse on decode with a draft model, over NIXL).

sglang does not say reliably what its ``KVArgs`` pointers are: with ``--enable-hisparse`` the
decode KV pointers are host memory (decode.py ``_init_kv_manager``: the HiSparse coordinator's
host pool) while the DSA indexer stays on the GPU, and the metadata (aux) buffers are host memory
unless ``SGLANG_MOONCAKE_CUSTOM_MEM_POOL=INTRA_NODE_NVLINK`` puts them on the GPU. So the kind of
each buffer is read from its pointer, by the core's ``transfer/memory_kinds.py`` (``kind_of``,
``pointer_info``; the engines' ``register`` checks each region's claimed device against it too).
This module keeps what is sglang's:

- ``hisparse_problem``: why a decode rank with HiSparse is refused at start-up (with a draft
  model over NIXL, which sglang's own decode refuses), naming the flag.
"""

from __future__ import annotations


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
