"""One engine shared by several nodes of a process (``backends/shared.py``), over the real
engines: a region several users register is registered with the engine once, stays registered
until its last user closes, and the engine closes with its last user; ``unregister`` refuses a
region not registered, deregistering nothing."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dsa_bridge.plugin.descriptors import raw_region
from dsa_bridge.transfer.backends import create_backend
from dsa_bridge.transfer.backends.base import BackendError
from dsa_bridge.transfer.backends.shared import SharedEngine


def region_of(array: np.ndarray):
    return raw_region(array.ctypes.data, array.nbytes, "cpu")


def registered(engine) -> set:
    return set(engine._regions.regions.values())  # what the engine holds registered


def test_a_region_is_registered_once_and_kept_until_its_last_user_closes(backend_name):
    engine = create_backend(backend_name)
    writer = create_backend(backend_name)
    pool, aux, src = np.zeros(1 << 20, np.uint8), np.zeros(1 << 16, np.uint8), np.full(4096, 0x5A, np.uint8)
    try:
        shared = SharedEngine(engine)
        first, second = shared.user(), shared.user()
        first.register([region_of(pool)])
        second.register([region_of(pool), region_of(aux)])  # the pool again: counted, not registered
        assert registered(engine) == {region_of(pool), region_of(aux)} and shared.registered == 2
        writer.register([region_of(src)])
        peer = writer.connect(second.metadata())
        write = threading.Thread(target=writer.write, args=(
            peer, np.array([src.ctypes.data], np.uint64), np.array([pool.ctypes.data], np.uint64),
            np.array([src.nbytes], np.uint64)), kwargs={"timeout_s": 10})
        write.start()
        while write.is_alive():  # the target's progress, as a node's tick drives it
            second.progress()
            write.join(0.001)
        assert bool((pool[:4096] == 0x5A).all())  # a write into the shared engine's region lands
        second.close()
        second.close()  # idempotent
        assert registered(engine) == {region_of(pool)}  # the aux region had only the second user
        shared.close()  # the first user is still open: the engine stays
        assert not engine._closed and registered(engine) == {region_of(pool)}
        with pytest.raises(BackendError, match="the shared engine is closed"):
            shared.user()
        first.close()
        assert engine._closed
    finally:
        writer.close()
        engine.close()


def test_unregister_refuses_a_region_not_registered_and_deregisters_nothing(backend_name):
    engine = create_backend(backend_name)
    known, unknown = np.zeros(8192, np.uint8), np.zeros(8192, np.uint8)
    try:
        engine.register([region_of(known)])
        with pytest.raises(BackendError, match="not registered"):
            engine.unregister([region_of(known), region_of(unknown)])
        assert registered(engine) == {region_of(known)}
        engine.unregister([region_of(known)])
        assert registered(engine) == set()
        engine.register([region_of(known)])  # registered again after its release
        assert registered(engine) == {region_of(known)}
    finally:
        engine.close()
