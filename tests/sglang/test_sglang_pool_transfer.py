"""dsa-bridge's transfer nodes over pools sglang allocated: ``BridgeDSATokenToKVPool`` on both
sides (sglang's buffers, dsa-bridge's descriptors), a real engine, prefill to decode, byte-exact
on the KV and the indexer of every layer that should move — uniform, and sglang's compact form
(``skip_topk_layers``: 0-row placeholders never registered nor written) — and a compact prefill
against a uniform decode refused before any write. In one process: what is under test is the
pool seam, not the process boundary (tests/integration covers that for dsa-bridge's pool)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import require_engine

from .conftest import SGLANG_MISSING

if SGLANG_MISSING:
    pytest.skip(SGLANG_MISSING, allow_module_level=True)

from dsa_bridge.plugin.sglang.pool import BridgeDSATokenToKVPool  # noqa: E402
from dsa_bridge.transfer.backends import create_backend  # noqa: E402
from dsa_bridge.transfer.decode import DecodeNode  # noqa: E402
from dsa_bridge.transfer.handshake import HandshakeError  # noqa: E402
from dsa_bridge.transfer.prefill import PrefillNode  # noqa: E402
from dsa_bridge.transfer.request import KVPoll  # noqa: E402

from ..transfer.helpers import wait_for  # noqa: E402

pytestmark = pytest.mark.usefixtures("sglang_context")

LAYERS = 4
SKIP = [False, True, True, False]  # layers 1 and 2 reuse layer 0's top-k
KW = dict(size=64 * 8, page_size=64, kv_lora_rank=512, dtype=torch.float8_e4m3fn, qk_rope_head_dim=64,
          layer_num=LAYERS, device="cpu", index_head_dim=128, enable_memory_saver=False, kv_cache_dim=656)
SRC, DST = [3, 1, 4], [2, 7, 5]
SENTINEL = 0xAA


def pages(pool) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, kind) -> (pages, item_len) uint8 view of every non-empty sglang buffer."""
    out = {}
    for lid in range(LAYERS):
        out[(lid, "kv")] = pool.kv_buffer[lid].view(torch.uint8).view(-1, 64 * 656)
        ix = pool.index_k_with_scale_buffer[lid]
        if ix.numel():
            out[(lid, "index")] = ix.view(torch.uint8)
    return out


@pytest.fixture
def closing():
    """Nodes made by the test, closed after it (a node closes its engine backend, also when its
    construction fails)."""
    made = []
    yield made.append
    for node in reversed(made):
        node.close()


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
@pytest.mark.parametrize("skip", [None, SKIP], ids=["uniform", "sglang-compact"])
def test_sglang_allocated_pools_transfer_byte_exact(closing, engine, skip):
    require_engine(engine)
    src = BridgeDSATokenToKVPool(**KW, skip_topk_layers=skip)
    dst = BridgeDSATokenToKVPool(**KW, skip_topk_layers=skip)
    g = torch.Generator().manual_seed(11)
    for view in pages(src).values():
        view.copy_(torch.randint(0, 256, view.shape, generator=g, dtype=torch.uint8))
    for view in pages(dst).values():
        view.fill_(SENTINEL)
    prefill = PrefillNode(src, create_backend(engine), heartbeat_s=0.1)
    closing(prefill)
    decode = DecodeNode(dst, create_backend(engine), prefill.endpoint, heartbeat_s=0.1)
    closing(decode)
    receiver = decode.receiver(5)
    receiver.init(DST)
    sender = prefill.sender(5)
    sender.init(len(SRC))
    sender.send(SRC)
    wait_for(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), timeout_s=30, what="request end")
    assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
    held = sorted(pages(src))
    assert sorted(receiver.components) == held
    if skip:
        assert [lid for lid, kind in held if kind == "index"] == [0, 3]
    others = [p for p in range(9) if p not in DST]
    for key, view in pages(dst).items():
        assert torch.equal(view[DST], pages(src)[key][SRC]), key
        assert bool((view[others] == SENTINEL).all()), key


@pytest.mark.parametrize("engine", ["mooncake", "nixl"])
def test_sglang_compact_prefill_to_uniform_decode_is_refused_before_any_write(closing, engine):
    require_engine(engine)
    prefill = PrefillNode(BridgeDSATokenToKVPool(**KW, skip_topk_layers=SKIP), create_backend(engine),
                          heartbeat_s=0.1)
    closing(prefill)
    dst = BridgeDSATokenToKVPool(**KW)
    for view in pages(dst).values():
        view.fill_(SENTINEL)
    with pytest.raises(HandshakeError, match="layer 1: decode holds and reads its indexer"):
        DecodeNode(dst, create_backend(engine), prefill.endpoint, heartbeat_s=0.1)
    assert prefill.counters.snapshot()["handshakes_refused"] == 1
    assert all(bool((view == SENTINEL).all()) for view in pages(dst).values())
