"""Page checksums, pure: both algorithms, what prefill sends, and decode's verification of it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from dsa_bridge.transfer import checksum, protocol
from dsa_bridge.transfer.checksum import WSUM, XXH3, ChecksumError
from dsa_bridge.transfer.launcher.drivers import fill_request

from .helpers import make_pool

KEYS = [(layer, kind) for layer in range(4) for kind in ("kv", "index")]


def random_pages(count: int, item_len: int, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, (count, item_len), dtype=np.uint8))


def test_algorithm_follows_the_pool_device():
    assert checksum.algorithm_for("cpu") == XXH3
    assert checksum.algorithm_for(torch.device("cuda:1")) == WSUM


def test_xxh3_hashes_each_selected_page_in_order():
    view = random_pages(10, 8448)
    pages = np.array([7, 2, 9], dtype=np.int64)
    got = checksum.page_checksums(view, pages, XXH3)
    assert got.dtype == np.uint64
    assert got.tolist() == [xxhash.xxh3_64_intdigest(view[p].numpy().tobytes()) for p in pages]


@pytest.mark.parametrize("item_len", [8, 20, 24, 133])
def test_weighted_sum_detects_every_single_flipped_byte(item_len):
    page = random_pages(1, item_len, seed=item_len)
    base = checksum.weighted_sums(page)
    rng = np.random.default_rng(1)
    for offset in range(item_len):
        flipped = page.clone()
        flipped[0, offset] ^= int(rng.integers(1, 256))
        assert checksum.weighted_sums(flipped) != base, offset


def test_weighted_sum_detects_flipped_bytes_across_a_real_page():
    page = random_pages(1, 41984, seed=3)
    base = checksum.weighted_sums(page)
    for offset in [0, 7, 8, 4095, 20000, 41983]:
        for bit in range(8):
            flipped = page.clone()
            flipped[0, offset] ^= 1 << bit
            assert checksum.weighted_sums(flipped) != base, (offset, bit)


def test_weighted_sum_depends_on_word_order_and_only_on_the_bytes():
    pages = random_pages(3, 64)
    sums = checksum.weighted_sums(pages)
    assert torch.equal(checksum.weighted_sums(pages[[2, 0, 1]]), sums[[2, 0, 1]])
    swapped = pages.view(torch.int64)[:, [1, 0, 2, 3, 4, 5, 6, 7]].contiguous().view(torch.uint8)
    assert checksum.weighted_sums(swapped)[0] != sums[0]
    picked = checksum.page_checksums(pages, np.array([1, 2], dtype=np.int64), WSUM)
    assert picked.tolist() == sums[[1, 2]].numpy().view(np.uint64).tolist()


def test_weighted_sum_refuses_other_tensors():
    with pytest.raises(ValueError, match="2-D uint8"):
        checksum.weighted_sums(torch.zeros(4, 8, dtype=torch.int64))
    with pytest.raises(ChecksumError, match="unknown checksum algorithm 'crc'"):
        checksum.page_checksums(random_pages(2, 8), np.array([1]), "crc")


def sent_and_received(algorithm=XXH3, pages=(3, 4, 9, 5)):
    """Prefill's pool with a request's pages filled, decode's with the same bytes landed."""
    prefill, decode = make_pool(), make_pool()
    src = np.asarray(pages, dtype=np.int64)
    dst = np.arange(10, 10 + src.size, dtype=np.int64)
    fill_request(prefill, 1, src)
    for key, view in checksum.pool_views(decode).items():
        view[torch.from_numpy(dst)] = checksum.pool_views(prefill)[key][torch.from_numpy(src)]
    return prefill, decode, src, dst


@pytest.mark.parametrize("algorithm", [XXH3, WSUM])
def test_verified_chunks_count_every_buffer_and_page(algorithm):
    prefill, decode, src, dst = sent_and_received()
    views = checksum.pool_views(decode)
    total = 0
    for offset, part in ((0, src[:3]), (3, src[3:])):  # two chunks
        sums = checksum.chunk_checksums(checksum.pool_views(prefill), KEYS, part, offset, algorithm)
        done = protocol.ChunkDone(1, 0, True, False, checksums=sums)
        sums = protocol.decode(protocol.encode(done)).checksums  # as it travels
        assert len(sums.values) == 8 * len(KEYS) * part.size
        total += checksum.verify_chunk(views, dst, sums)
    assert total == 8 * src.size  # 4 layers x 2 caches x 4 pages
    checksum.check_coverage(total, dst.size, len(views))
    with pytest.raises(ChecksumError, match=r"covered 24 of the request's 4 pages x 8 buffers = 32"):
        checksum.check_coverage(24, dst.size, len(views))


@pytest.mark.parametrize("algorithm", [XXH3, WSUM])
@pytest.mark.parametrize(("layer", "kind", "index"), [(0, "kv", 0), (2, "index", 3), (3, "kv", 1)])
def test_one_flipped_byte_names_layer_cache_and_page(algorithm, layer, kind, index):
    prefill, decode, src, dst = sent_and_received()
    sums = checksum.chunk_checksums(checksum.pool_views(prefill), KEYS, src, 0, algorithm)
    decode.page_view(layer, kind)[int(dst[index]), 100] ^= 0x10
    with pytest.raises(ChecksumError) as failure:
        checksum.verify_chunk(checksum.pool_views(decode), dst, sums)
    assert str(failure.value) == (f"checksum mismatch: layer {layer} {kind} cache, page {dst[index]} "
                                  f"(page {index} of the request); 1 of 32 checksums of the chunk differ")


def test_a_chunk_is_checked_at_its_own_offset():
    prefill, decode, src, dst = sent_and_received()
    sums = checksum.chunk_checksums(checksum.pool_views(prefill), KEYS, src[2:], 2, XXH3)
    assert checksum.verify_chunk(checksum.pool_views(decode), dst, sums) == 16
    shifted = protocol.PageChecksums(XXH3, 1, sums.buffers, sums.values)  # the wrong pages
    with pytest.raises(ChecksumError, match=r"page 11 \(page 1 of the request\)"):
        checksum.verify_chunk(checksum.pool_views(decode), dst, shifted)


def bad(sums, **changes):
    fields = {"algorithm": sums.algorithm, "offset": sums.offset, "buffers": sums.buffers,
              "values": sums.values, **changes}
    return protocol.PageChecksums(**fields)


def test_malformed_checksums_are_refused_with_the_reason():
    prefill, decode, src, dst = sent_and_received()
    views = checksum.pool_views(decode)
    sums = checksum.chunk_checksums(checksum.pool_views(prefill), KEYS, src, 0, XXH3)
    cases = [
        (None, "prefill sent no checksums"),
        (bad(sums, algorithm="md5"), "unknown checksum algorithm 'md5'"),
        (bad(sums, buffers=[(9, "kv"), *sums.buffers[1:]]), r"buffer \(layer 9, kv\) that this pool"),
        (bad(sums, buffers=[sums.buffers[0]] * len(KEYS)), "list a buffer twice"),
        (bad(sums, buffers=[]), "do not divide into 0 buffers"),
        (bad(sums, values=sums.values[:-8]), "do not divide into 8 buffers"),
        (bad(sums, values=b""), r"pages \[0, 0\) do not fit"),
        (bad(sums, offset=1), r"pages \[1, 5\) do not fit the request's 4 pages"),
        (bad(sums, offset=-1), r"pages \[-1, 3\) do not fit"),
    ]
    for sums_given, message in cases:
        with pytest.raises(ChecksumError, match=message):
            checksum.verify_chunk(views, dst, sums_given)


def test_a_chunk_too_large_for_one_message_is_refused(monkeypatch):
    prefill, _, src, _ = sent_and_received()
    monkeypatch.setattr(checksum, "MAX_CHECKSUM_BYTES", 8 * len(KEYS) * 3)
    assert checksum.max_chunk_pages(len(KEYS)) == 3
    with pytest.raises(ChecksumError, match="send chunks of at most 3 pages"):
        checksum.chunk_checksums(checksum.pool_views(prefill), KEYS, src, 0, XXH3)


def test_the_largest_chunk_fits_one_message():
    buffers = 2 * 78  # GLM-5.2: the most buffers of the presets
    pages = checksum.max_chunk_pages(buffers)
    sums = protocol.PageChecksums(XXH3, 0, [(i // 2, "kv") for i in range(buffers)],
                                  bytes(8 * buffers * pages))
    data = protocol.encode(protocol.ChunkDone(1, 0, True, True, checksums=sums))
    assert len(data) <= protocol.MAX_MESSAGE_BYTES
    assert protocol.decode(data).checksums == sums


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_pages_give_the_cpu_checksums():
    pages = random_pages(6, 41984)
    index = np.array([5, 0, 3], dtype=np.int64)
    on_gpu = pages.cuda()
    for algorithm in (XXH3, WSUM):
        assert (checksum.page_checksums(on_gpu, index, algorithm).tolist()
                == checksum.page_checksums(pages, index, algorithm).tolist())
