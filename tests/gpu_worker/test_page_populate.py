"""A worker faults in the arena's pages on other threads while it warms up, so that pinning them later only
locks them. Populating must map every page and change no byte, even while the store writes adapters into
the segment at the same time."""
from __future__ import annotations

import ctypes
import platform
import random
import threading
from multiprocessing import resource_tracker, shared_memory

import pytest

from services.gpu_worker.arena_client import ArenaSegments
from services.gpu_worker.page_populate import populate

MIB = 1 << 20
SUPPORTED = platform.system() == "Linux" and tuple(int(x) for x in platform.release().split(".")[:2]) >= (5, 14)


def resident_kib(address: int) -> int:
    """Rss of the mapping that starts at `address`, from /proc/self/smaps."""
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{address:x}" or line.split("-", 1)[0] == f"{address:012x}":
            for entry in lines[i + 1:]:
                if entry.startswith("Rss:"):
                    return int(entry.split()[1])
    raise AssertionError(f"no mapping at {address:#x}")


@pytest.fixture
def segment():
    shm = shared_memory.SharedMemory(create=True, size=64 * MIB)
    yield shm
    shm.close()
    shm.unlink()


def address_of(shm) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(shm.buf))


def test_populate_maps_every_page_and_keeps_the_bytes(segment):
    segment.buf[0:5] = b"adapt"
    segment.buf[40 * MIB:40 * MIB + 4] = b"rows"
    address = address_of(segment)
    before = resident_kib(address)
    assert before < 1024  # a fresh segment: only the two pages written are there

    assert populate(address, segment.size) is SUPPORTED
    if SUPPORTED:
        assert resident_kib(address) == segment.size // 1024
    assert bytes(segment.buf[0:5]) == b"adapt" and bytes(segment.buf[40 * MIB:40 * MIB + 4]) == b"rows"
    assert bytes(segment.buf[5:4096]) == bytes(4091)  # the rest still reads as zeros


def test_an_empty_range_needs_nothing(segment):
    assert populate(address_of(segment), 0) is True


def test_writes_made_while_populating_all_stay(segment):
    rng = random.Random(3)
    spots = sorted(rng.sample(range(0, segment.size - 8, 8), 4000))
    stop = threading.Event()

    def writer():  # as the store laying adapters into the arena
        for n, at in enumerate(spots):
            segment.buf[at:at + 8] = n.to_bytes(8, "little")
        stop.set()

    t = threading.Thread(target=writer)
    t.start()
    populate(address_of(segment), segment.size)
    t.join()
    assert stop.is_set()
    assert all(int.from_bytes(segment.buf[at:at + 8], "little") == n for n, at in enumerate(spots))


def test_a_worker_populates_its_arena_then_pins_it_once(segment):
    segments = ArenaSegments(register_with_cuda=False)
    segments.populate_at_start(segment.name)
    segments.populate_at_start(segment.name)  # asked twice: one populate
    assert list(segments._populating) == [segment.name]
    segments.pin_at_start(segment.name)  # waits for the pages first
    assert not segments._populating and segments._pinned == {segment.name}
    if SUPPORTED:
        assert resident_kib(address_of(segments.get(segment.name))) == segment.size // 1024
    segments.populate_at_start(segment.name)  # pinned already: nothing more to do
    assert not segments._populating
    segments.pin_at_start("")  # no arena (the store has none): nothing happens
    segments.close()
    # Attaching dropped the segment from this process's resource tracker (a worker never unlinks the
    # store's arena); this test created it, so it is tracked again for the fixture's unlink.
    resource_tracker.register(segment._name, "shared_memory")
