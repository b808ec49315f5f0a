"""``move_kv_cache``, ``get_cpu_copy`` and ``load_cpu_copy`` on device pools (DeepSeek-V3.2
uniform fp8 and bf16, GLM-5.2 compact), byte-exact against a token-level oracle, with partial
first and last pages, in SGLang's retraction call form: the token locations as an int32 tensor on
the pool's device, ``get_cpu_copy`` of a request's tokens, then ``load_cpu_copy`` of that copy
into the tokens it gets back (here: others), and a move between them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from .conftest import POOLS
from .device_bytes import copy_rows, oracle_move, random_fill, snapshot, token_parts
from .test_device_pools import device_pool

PAGE = 64
SRC = [*range(PAGE + 3, 2 * PAGE + 10), *range(3 * PAGE, 3 * PAGE + 17)]  # partial pages
DST = [*range(4 * PAGE - 40, 4 * PAGE), *range(4 * PAGE + 5, 4 * PAGE + 5 + len(SRC) - 40)]


def locs(values: list[int], device: str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def assert_equal(pool, expected: dict) -> None:
    for key, value in snapshot(pool).items():
        np.testing.assert_array_equal(value, expected[key], err_msg=str(key))


@pytest.mark.parametrize("name", POOLS)
def test_retraction_round_trip_and_move_byte_exact(device, name):
    pool = device_pool(name, device)
    layout = pool.layout
    random_fill(pool, 5)
    before = snapshot(pool)

    copy = pool.get_cpu_copy(locs(SRC, device))
    assert copy.num_tokens == len(SRC) and copy.kv[0].device.type == "cpu"
    indexers = {layer: j for j, layer in enumerate(layout.index_layer_ids)}
    for i, layer in enumerate(layout.layer_ids):
        for row, loc in enumerate(SRC):
            got = copy_rows(layout, copy, i, indexers.get(layer), row)
            for part, want in zip(got, token_parts(layout, before, layer, loc), strict=True):
                np.testing.assert_array_equal(part, want, err_msg=f"layer {layer} token {loc}")

    pool.load_cpu_copy(copy, locs(DST, device))
    loaded = oracle_move(layout, before, DST, SRC)
    assert_equal(pool, loaded)

    pool.move_kv_cache(locs(SRC, device), locs(DST, device))  # back where they came from
    assert_equal(pool, oracle_move(layout, loaded, SRC, DST))
