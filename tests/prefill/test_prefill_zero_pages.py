"""A request with no page to move, over the real engines: decode's radix cache holds the whole
page-aligned prompt (``prefix_tokens`` its length), so decode announces no page and only its aux
slot (sglang's first token), and prefill's ``init(0)`` and one empty last chunk write that slot
alone.

Served: both sides Success, the aux slot byte-exact, no page written anywhere (every page of
decode's pool still its sentinel), the bytes the aux slot's. Refused as before: an empty page
list with neither an aux slot nor a prefix (nothing to serve), a negative page count, a chunk
with pages after ``init(0)``, and a page-count mismatch between the two sides (either way
round), which fails both before any write.
"""

from __future__ import annotations

import numpy as np
import pytest

from dsa_bridge.transfer.launcher.drivers import sentinel_intact
from dsa_bridge.transfer.request import TERMINAL, KVPoll
from tests.transfer.helpers import aux_tensors, decode_node, prefill_node, wait_for

PAGE = 64
PROMPT = 5 * PAGE  # the whole page-aligned prompt, in decode's radix cache


def ended(sender, receiver):
    wait_for(lambda: sender.poll() in TERMINAL and receiver.poll() in TERMINAL, 20, "the end")


def test_an_aux_only_request_writes_the_slot_and_no_page(engine, made):
    src_aux, dst_aux = aux_tensors(4), aux_tensors(4, fill=0xA5)
    prefill = prefill_node(engine, made, aux=src_aux)
    decode = decode_node(engine, made, [prefill], aux=dst_aux)
    receiver = decode.receiver(1)
    receiver.init([], num_tokens=PROMPT, aux_index=2, prefix_tokens=PROMPT)
    sender = prefill.sender(1)
    wait_for(lambda: sender.poll() == KVPoll.WaitingForInput, 10, "decode's announcement")
    assert sender.decode_prefix_tokens == PROMPT
    sender.init(0, aux_index=3)
    sender.send([])  # the last chunk: the aux slot alone
    ended(sender, receiver)
    assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
    assert sender.poll() == KVPoll.Success, sender.failure_exception()
    for src, dst in zip(src_aux, dst_aux, strict=True):
        assert np.array_equal(dst[2], src[3])
        assert (np.delete(dst, 2, axis=0) == 0xA5).all()
    assert receiver.nbytes == 64 + 512  # the aux slot's bytes, no page's
    assert sentinel_intact(decode.pool, np.arange(1, decode.pool.num_kv_pages))
    wait_for(receiver.can_release, 10, "the fence to lift")
    sender.send([])  # a second empty chunk after the end: dropped, nothing written
    assert sentinel_intact(decode.pool, np.arange(1, decode.pool.num_kv_pages))


def test_bad_zero_page_requests_are_refused(engine, made):
    src_aux = aux_tensors(4)
    prefill = prefill_node(engine, made, aux=src_aux)
    decode = decode_node(engine, made, [prefill], aux=aux_tensors(4, fill=0xA5))
    with pytest.raises(ValueError, match="page_ids is empty"):  # nothing to serve
        decode.receiver(1).init([], num_tokens=PROMPT)
    with pytest.raises(ValueError, match="num_pages must not be negative, got -1"):
        prefill.sender(2).init(-1)
    sender = prefill.sender(3)
    sender.init(0, aux_index=0)
    sender.send([4])
    assert sender.poll() == KVPoll.Failed
    assert "chunk of 1 pages after 0 does not fit the request's 0 pages" in str(
        sender.failure_exception())


@pytest.mark.parametrize("decode_pages, prefill_pages", [([], 2), ([5, 6], 0)])
def test_a_zero_page_side_facing_pages_fails_both_before_any_write(engine, made, decode_pages,
                                                                   prefill_pages):
    prefill = prefill_node(engine, made, aux=aux_tensors(4))
    decode = decode_node(engine, made, [prefill], aux=aux_tensors(4, fill=0xA5))
    receiver = decode.receiver(1)
    receiver.init(decode_pages, num_tokens=PROMPT, aux_index=1, prefix_tokens=PROMPT - 2 * PAGE
                  if decode_pages else PROMPT)
    sender = prefill.sender(1)
    sender.init(prefill_pages, aux_index=1)
    ended(sender, receiver)
    assert receiver.poll() == sender.poll() == KVPoll.Failed
    assert "page count mismatch" in str(receiver.failure_exception())
    assert sentinel_intact(decode.pool, np.arange(1, decode.pool.num_kv_pages))
