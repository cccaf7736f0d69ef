"""The shared-memory arena: LRU eviction of address windows, pins, and readers in other processes."""
from __future__ import annotations

import hashlib
import subprocess
import sys
import uuid
from multiprocessing import shared_memory

import pytest
import torch

from services.adapter_store.arena import Arena, ArenaFull
from services.adapter_store.arena_reader import location_rows
from services.gpu_worker.adapter_layout import PackedAdapter
from shared.wire import AdapterLocation

from .conftest import REPO

# One "unit" adapter: 1 layer x 2 x 4 slots x 16 float32 = 512 bytes = two alignment units.
UNIT = 512


def packed(name: str, units: int = 1, fill: float | None = None, dtype=torch.float32) -> PackedAdapter:
    n_slots = 4 * units
    g = torch.Generator().manual_seed(hash(name) % 2**31)
    rows = torch.randn(1, 2, n_slots, 16, generator=g).to(dtype) if fill is None else torch.full((1, 2, n_slots, 16), fill, dtype=dtype)
    return PackedAdapter(name, rows, (4,) + (0,) * 6, (0,) * 7, (0,) * 7)


@pytest.fixture
def arena():
    a = Arena(4 * UNIT, name=f"lpx-test-{uuid.uuid4().hex[:10]}")
    yield a
    a.close()


def test_adapters_are_contiguous_and_read_back_exactly(arena):
    a, b = packed("a"), packed("b", dtype=torch.bfloat16)
    ea, eb = arena.put("a", a), arena.put("b", b)
    assert (ea.offset, ea.nbytes, eb.offset, eb.nbytes) == (0, UNIT, UNIT, UNIT // 2)
    assert eb.dtype == "bfloat16" and eb.shape == (1, 2, 4, 16)
    assert torch.equal(arena.rows("a"), a.rows) and torch.equal(arena.rows("b"), b.rows)
    assert arena.put("a", packed("a", fill=9.0)) is ea  # already resident: not reloaded
    assert arena.loads == 2


def test_least_recently_used_adapters_are_evicted_first_by_bytes(arena):
    for name in ("a", "b", "c", "d"):
        arena.put(name, packed(name))
    assert arena.used_bytes == arena.capacity
    arena.get("a")  # a is now the most recently used
    arena.put("e", packed("e", units=2))  # needs two units: evicts b and c, the two oldest
    assert arena.adapters == ["d", "a", "e"]
    assert arena.evictions == 2
    assert torch.equal(arena.rows("a"), packed("a").rows)


def test_pinned_adapters_are_never_evicted(arena):
    for name in ("a", "b", "c", "d"):
        arena.put(name, packed(name))
    for name in ("a", "b", "c"):
        arena.acquire(name, "w0")
    arena.put("e", packed("e"))  # only d is unpinned
    assert arena.adapters == ["a", "b", "c", "e"]
    arena.acquire("e", "w1")
    with pytest.raises(ArenaFull, match="pinned"):
        arena.put("f", packed("f"))
    arena.release("b", "w0")
    arena.put("f", packed("f"))
    assert "b" not in arena and "a" in arena and "e" in arena and torch.equal(arena.rows("a"), packed("a").rows)
    with pytest.raises(ArenaFull, match="arena holds"):
        arena.put("huge", packed("huge", units=5))


def test_pins_are_counted_per_worker_and_a_dead_workers_pins_can_be_dropped(arena):
    arena.put("a", packed("a"))
    arena.acquire("a", "w0")
    arena.acquire("a", "w0")
    arena.acquire("a", "w1")
    arena.release("a", "w0")
    assert arena.drop("a") is False
    assert arena.release_worker("w0") == ["a"]
    with pytest.raises(KeyError):
        arena.release("a", "w0")
    arena.release("a", "w1")
    assert arena.drop("a") is True and "a" not in arena


def test_fragmented_free_space_is_joined_by_evicting_between_the_holes_never_by_moving(arena):
    for name in ("a", "b", "c", "d"):
        arena.put(name, packed(name))
    arena.acquire("a", "w0")
    arena.drop("b")
    arena.drop("d")
    # Two free units, not adjacent: [a][hole][c][hole]. c goes; nothing that stays is moved.
    e = arena.put("e", packed("e", units=2))
    assert arena.evictions == 1 and arena.adapters == ["a", "e"]
    assert arena.get("a").offset == 0 and e.offset == UNIT
    assert torch.equal(arena.rows("a"), packed("a").rows) and torch.equal(arena.rows("e"), packed("e", units=2).rows)


def test_the_window_evicted_is_the_one_whose_newest_adapter_is_oldest(arena):
    for name in ("a", "b", "c", "d"):
        arena.put(name, packed(name))
    arena.get("b")  # b is now the most recently used; a is still the least
    # Two adjacent units: [a b] and [b c] would evict b; [c d] evicts only older adapters.
    e = arena.put("e", packed("e", units=2))
    assert arena.adapters == ["a", "b", "e"] and arena.evictions == 2 and e.offset == 2 * UNIT
    for name in ("a", "b"):
        assert torch.equal(arena.rows(name), packed(name).rows)


def test_free_space_split_by_a_pinned_adapter_is_made_by_evicting_beside_it(arena):
    for name in ("a", "b", "c", "d"):
        arena.put(name, packed(name))
    arena.acquire("b", "w0")  # pinned at unit 1: the free units on either side can never join
    arena.drop("a")
    arena.drop("c")
    e = arena.put("e", packed("e", units=2))  # the hole after b and d's unit: d goes
    assert arena.adapters == ["b", "e"] and arena.evictions == 1
    assert arena.get("b").offset == UNIT and e.offset == 2 * UNIT
    assert torch.equal(arena.rows("b"), packed("b").rows) and torch.equal(arena.rows("e"), packed("e", units=2).rows)
    arena.acquire("e", "w0")
    with pytest.raises(ArenaFull, match="pinned"):  # nothing left to evict: refused, not a busy loop
        arena.put("f", packed("f", units=2))


def test_a_reserved_range_is_filled_in_place_never_evicted_and_given_back_on_failure(arena):
    for name in ("a", "b"):
        arena.put(name, packed(name))
    rows = packed("r").rows
    dest = arena.reserve("r", rows.numel() * rows.element_size())
    assert "r" not in arena and arena.pinned_bytes == UNIT  # not handed out, not evictable
    arena.put("c", packed("c"))
    arena.put("d", packed("d", units=1))  # full now: a, b, r, c... d evicted a
    assert "a" not in arena and arena.pinned_bytes == UNIT  # the oldest resident went, the range stayed
    dest.view(torch.float32).view(rows.shape).copy_(rows)  # a load thread writes the rows in place
    entry = arena.commit("r", rows.dtype, tuple(rows.shape), (4,) + (0,) * 6, (0,) * 7, (0,) * 7)
    assert "r" in arena and arena.pinned_bytes == 0 and arena.adapters[-1] == "r"
    assert torch.equal(arena.rows("r"), rows) and arena.loads == 5 and entry.nbytes == UNIT
    with pytest.raises(ValueError, match="already"):
        arena.reserve("r", UNIT)

    arena.acquire("r", "w0")
    arena.reserve("s", 2 * UNIT)  # evicts the two oldest unpinned
    with pytest.raises(ArenaFull):  # r pinned and s reserved leave one unit
        arena.put("e", packed("e", units=2))
    arena.unreserve("s")  # the load failed: its room is free again
    assert arena.put("e", packed("e", units=2)).nbytes == 2 * UNIT


def test_churn_of_mixed_sizes_keeps_every_resident_adapter_intact_and_pinned_ones_in_place():
    """Many loads of four sizes into a small arena with pins coming and going: whatever is resident reads
    back exactly, pinned adapters never move, and a load is refused only when pins leave no window."""
    import random

    arena = Arena(24 * UNIT, name=f"lpx-test-{uuid.uuid4().hex[:10]}")
    rng = random.Random(7)
    try:
        sizes = {f"x{i}": rng.choice((1, 2, 4, 8)) for i in range(40)}
        pinned: dict[str, int] = {}
        refused = 0
        for _ in range(400):
            name = rng.choice(list(sizes))
            try:
                arena.put(name, packed(name, units=sizes[name]))
            except ArenaFull:
                refused += 1
                assert arena.pinned_bytes > 0  # only pins can leave no window
                continue
            if rng.random() < 0.3 and len(pinned) < 3 and name not in pinned:
                arena.acquire(name, "w0")
                pinned[name] = arena.get(name).offset
            if pinned and rng.random() < 0.3:
                gone = rng.choice(list(pinned))
                arena.release(gone, "w0")
                del pinned[gone]
            for aid, offset in pinned.items():
                assert aid in arena and arena.get(aid).offset == offset
        assert arena.evictions > 100 and refused < 40
        spans = sorted((arena.get(a).offset, arena.get(a).nbytes) for a in arena.adapters)
        assert all(o1 + n1 <= o2 for (o1, n1), (o2, _) in zip(spans, spans[1:]))
        for aid in arena.adapters:
            assert torch.equal(arena.rows(aid), packed(aid, units=sizes[aid]).rows)
    finally:
        arena.close()


def test_prefetch_never_evicts_a_more_urgent_hinted_adapter(arena):
    for name in ("a", "b", "c", "d"):
        arena.put(name, packed(name))
    with pytest.raises(ArenaFull):
        arena.put("e", packed("e", units=2), keep=frozenset({"a", "b", "c", "d"}))
    arena.put("e", packed("e"), keep=frozenset({"a", "c", "d"}))
    assert arena.adapters == ["a", "c", "d", "e"]


READER = """
import hashlib, sys
from services.adapter_store.arena_reader import attach_arena, location_rows
from shared.wire import AdapterLocation
shm = attach_arena(sys.argv[1])
loc = AdapterLocation("a", sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), "float32", [1, 2, 4, 16], [4]+[0]*6, [0]*7, [0]*7)
rows = location_rows(shm, loc)
print(hashlib.sha256(rows.numpy().tobytes()).hexdigest())
del rows
shm.close()
"""


def test_a_reader_process_sees_identical_bytes_and_its_exit_leaves_the_segment(arena):
    a = packed("a")
    entry = arena.put("a", a)
    out = subprocess.run([sys.executable, "-c", READER, arena.name, str(entry.offset), str(entry.nbytes)],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == hashlib.sha256(a.rows.numpy().tobytes()).hexdigest()
    assert "leaked shared_memory" not in out.stderr
    # The reader has exited; without the unregistration its resource tracker would have unlinked the segment.
    shm = shared_memory.SharedMemory(name=arena.name)
    shm.close()


def test_reader_view_in_this_process_is_zero_copy(arena):
    arena.put("a", packed("a"))
    e = arena.get("a")
    # Same process as the owner: attach plainly (attach_arena's tracker unregistration is for other processes).
    shm = shared_memory.SharedMemory(name=arena.name)
    loc = AdapterLocation("a", arena.name, e.offset, e.nbytes, e.dtype, list(e.shape), list(e.ranks), list(e.a_off), list(e.b_off))
    rows = location_rows(shm, loc)
    assert torch.equal(rows, packed("a").rows)
    arena._bytes[e.offset:e.offset + 4] = 0  # a write by the owner is visible through the reader's view
    assert rows.reshape(-1)[0].item() == 0.0
    del rows
    shm.close()


def test_a_segment_a_killed_store_left_behind_is_removed_so_its_name_serves_again():
    from services.adapter_store.arena import unlink_stale_segment

    name = f"loraplex-test-{uuid.uuid4().hex[:12]}"
    left = shared_memory.SharedMemory(name=name, create=True, size=1 << 16)
    left.close()  # its process gone without unlinking it
    with pytest.raises(FileExistsError):
        Arena(1 << 20, name)
    assert unlink_stale_segment(name) is True
    arena = Arena(1 << 20, name)
    try:
        assert arena.name.lstrip("/") == name and arena.capacity >= 1 << 16
        assert unlink_stale_segment(f"{name}-none") is False
    finally:
        arena.close()
