import random

import pytest
import torch

from services.gpu_worker.pool import SlotAllocator, UnifiedPool


def test_slots_come_out_in_order_and_freed_slots_go_to_the_back():
    alloc = SlotAllocator(6)
    assert alloc.allocate(2) == [0, 1]
    assert alloc.allocate(3) == [2, 3, 4]
    alloc.free([1, 0])
    assert alloc.num_free == 3
    assert alloc.allocate(2) == [5, 1]
    assert alloc.allocate(1) == [0]
    assert alloc.num_free == 0


def test_can_allocate_is_the_answer_and_allocate_beyond_it_is_a_bug():
    alloc = SlotAllocator(3)
    assert alloc.can_allocate(3) and not alloc.can_allocate(4)
    alloc.allocate(2)
    assert not alloc.can_allocate(2)
    with pytest.raises(RuntimeError, match="call can_allocate first"):
        alloc.allocate(2)


def test_double_free_and_foreign_free_are_caught():
    alloc = SlotAllocator(4)
    slots = alloc.allocate(2)
    alloc.free(slots)
    with pytest.raises(RuntimeError, match="slot 0 freed while not in use"):
        alloc.free([0])
    with pytest.raises(RuntimeError, match="slot 3 freed while not in use"):
        alloc.free([3])


def test_ten_thousand_random_operations_leak_nothing():
    rng = random.Random(1234)
    alloc = SlotAllocator(500)
    held: list[list[int]] = []
    for _ in range(10_000):
        if held and (rng.random() < 0.5 or not alloc.can_allocate(1)):
            alloc.free(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(1, 40)
            if alloc.can_allocate(n):
                held.append(alloc.allocate(n))
        owned = sum(len(h) for h in held)
        assert alloc.num_used == owned
    all_held = [s for h in held for s in h]
    assert len(set(all_held)) == len(all_held), "a slot was handed out twice"
    for h in held:
        alloc.free(h)
    assert alloc.num_free == 500
    assert sorted(alloc.allocate(500)) == list(range(500))


def test_adapter_rows_land_in_the_same_slot_of_every_layer():
    pool = UnifiedPool(num_layers=3, num_slots=10, slot_width=4, dtype=torch.float32, device="cpu")
    rows = torch.arange(3 * 2 * 2 * 4, dtype=torch.float32).view(3, 2, 2, 4)
    pool.write_adapter_rows(torch.tensor([7, 2]), rows)
    for layer in range(3):
        assert torch.equal(pool.k(layer)[7], rows[layer, 0, 0])
        assert torch.equal(pool.v(layer)[2], rows[layer, 1, 1])
