"""The engine-free parts of the backends: region lookup, NIXL descriptor grouping, env defaults,
Mooncake's start-up log."""

from __future__ import annotations

import os

import numpy as np
import pytest

from dsa_bridge.plugin.descriptors import BufferDescriptor, raw_region
from dsa_bridge.transfer.backends.base import BackendError, RegionTable, check_write_args
from dsa_bridge.transfer.backends.environment import env_defaults
from dsa_bridge.transfer.backends.mooncake import startup_log
from dsa_bridge.transfer.backends.nixl import _xfer_lists

U64 = np.uint64


def table(*regions: BufferDescriptor) -> RegionTable:
    result = RegionTable("test")
    result.check_new(list(regions))
    result.add(list(regions))
    return result


def test_many_regions_are_checked_in_one_sweep_and_an_overlap_anywhere_is_named() -> None:
    """A peer's metadata may list tens of thousands of regions (NIXL): the check sorts once, and
    still finds the one overlap, or duplicate, wherever the peer put it."""
    regions = [raw_region(0x10000 * (i + 1), 0x1000) for i in range(20_000)][::-1]
    big = table(*regions)
    assert len(big.regions) == 20_000
    straddling = raw_region(0x10000 * 7777 + 0xF00, 0x200)  # reaches into the next region
    with pytest.raises(BackendError, match="overlaps given"):
        RegionTable("test").check_new([*regions[:9000], straddling, *regions[9000:]])
    with pytest.raises(BackendError, match=r"duplicates registered"):
        big.check_new([raw_region(0x10000 * 123, 0x1000)])
    with pytest.raises(BackendError, match=r"overlaps registered"):
        big.check_new([raw_region(0x10000 * 123 + 0x800, 0x10)])
    big.check_new([raw_region(0x10000 * 123 + 0x1000, 0x10)])  # just past a region: fine


def test_locate_finds_the_region_of_each_range_and_refuses_the_rest() -> None:
    regions = table(raw_region(0x2000, 0x1000, "cuda:3"), raw_region(0x1000, 0x1000))
    slots = regions.locate("src", np.array([0x1000, 0x2FF0], U64), np.array([0x1000, 0x10], U64))
    assert regions.on_cuda[slots].tolist() == [False, True]
    assert regions.device_ids[slots].tolist() == [0, 3]
    for addr, size in ((0xFFF, 1), (0x1FFF, 2), (0x3000, 1)):  # before, across the end, after
        with pytest.raises(BackendError, match=f"src\\[0\\] = {addr:#x}"):
            regions.locate("src", np.array([addr], U64), np.array([size], U64))


def test_nixl_lists_are_grouped_by_memory_type_with_device_ids() -> None:
    local = table(raw_region(0x1000, 0x1000))
    remote = table(raw_region(0x10000, 0x1000, "cuda:1"), raw_region(0x20000, 0x1000))
    src = np.array([0x1000, 0x1100, 0x1200], U64)
    dst = np.array([0x10000, 0x20000, 0x10100], U64)
    length = np.array([0x10, 0x20, 0x30], U64)
    lists = _xfer_lists(
        local,
        local.locate("src", src, length),
        src,
        length,
        remote,
        remote.locate("dst", dst, length),
        dst,
    )
    got = {(mine[0], theirs[0]): (mine[1].tolist(), theirs[1].tolist()) for mine, theirs in lists}
    assert got == {
        ("DRAM", "DRAM"): ([[0x1100, 0x20, 0]], [[0x20000, 0x20, 0]]),
        ("DRAM", "VRAM"): (
            [[0x1000, 0x10, 0], [0x1200, 0x30, 0]],
            [[0x10000, 0x10, 1], [0x10100, 0x30, 1]],
        ),
    }


def test_env_defaults_fill_only_unset_variables_and_restore(monkeypatch) -> None:
    monkeypatch.setenv("DSAB_TEST_SET", "user")
    monkeypatch.delenv("DSAB_TEST_UNSET", raising=False)
    with env_defaults({"DSAB_TEST_SET": "ours", "DSAB_TEST_UNSET": "ours"}) as effective:
        assert effective == {"DSAB_TEST_SET": "user", "DSAB_TEST_UNSET": "ours"}
        assert os.environ["DSAB_TEST_UNSET"] == "ours"
    assert os.environ["DSAB_TEST_SET"] == "user"
    assert "DSAB_TEST_UNSET" not in os.environ


def test_write_arrays_come_back_as_uint64() -> None:
    src, dst, length = check_write_args(
        "test", "peer", np.array([8], np.int64), np.array([16], U64), np.array([4], np.int64)
    )
    assert {a.dtype for a in (src, dst, length)} == {np.dtype(U64)}


def test_touching_destination_ranges_are_not_an_overlap() -> None:
    check_write_args("test", "peer", np.array([8, 100], U64), np.array([16, 20], U64), np.array([4, 4], U64))


def test_mooncake_start_up_log_loses_only_the_benign_line() -> None:
    preamble = "WARNING: Logging before InitGoogleLogging() is written to STDERR\n"
    benign = "E1203 12:36:17.702786  5564 transfer_metadata.cpp:1098] Local segment descriptor not found\n"
    real = "E1203 12:36:17.702999  5564 transfer_engine_impl.cpp:150] P2P: No valid port found\n"
    assert startup_log(preamble + benign) == ""
    assert startup_log(preamble + benign + real) == preamble + real
    assert startup_log("other output\n" + benign) == "other output\n"
    assert startup_log(benign.replace("Local", "Remote")) == benign.replace("Local", "Remote")
