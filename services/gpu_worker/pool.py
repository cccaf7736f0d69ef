"""The unified page pool: one slot free list shared by KV tokens and adapter rows.

A slot id names the same row in every layer's K and V buffer. A token's K and V for all layers take
one slot; an adapter takes `n_slots` slots holding its A rows (in K buffers) and Bᵀ rows (in V
buffers). Because both kinds draw from one free list, KV and adapters trade memory freely.

The no-unify baseline (S-LoRA-no-unify-mem) splits the same buffers instead: slots 0 .. adapter_slots-1
form the adapter allocator, the rest the KV allocator, and neither may take the other's slots.
"""
from __future__ import annotations

from collections import deque

import torch


class SlotAllocator:
    """O(1) free list of slot ids. Slots come out in FIFO order of their release (oldest free first),
    so behaviour is deterministic and testable with exact ids."""

    def __init__(self, num_slots: int, first_slot: int = 0):
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self.first_slot = first_slot
        self._free: deque[int] = deque(range(first_slot, first_slot + num_slots))
        # One byte per slot id up to the range's end catches double frees and frees of foreign ids (those of
        # another allocator's range included) without scanning the list.
        self._in_use = bytearray(first_slot + num_slots)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take n slots. Callers check `can_allocate` first; running out here is a caller bug."""
        if not self.can_allocate(n):
            raise RuntimeError(f"cannot allocate {n} slots, {len(self._free)} free (call can_allocate first)")
        popleft, in_use = self._free.popleft, self._in_use
        out = [popleft() for _ in range(n)]
        for s in out:
            in_use[s] = 1
        return out

    def free(self, slots: list[int]) -> None:
        in_use = self._in_use
        for s in slots:
            if not (self.first_slot <= s < len(in_use) and in_use[s]):
                raise RuntimeError(f"slot {s} freed while not in use")
            in_use[s] = 0
        self._free.extend(slots)


class UnifiedPool:
    """Per layer a K buffer and a V buffer of `[num_slots, slot_width]`, slot_width = kv heads × head dim.

    `allocator` hands out KV slots, `adapter_allocator` adapter slots: the same free list in the unified
    pool, two disjoint ranges when `adapter_slots` > 0 (the no-unify baseline)."""

    def __init__(self, num_layers: int, num_slots: int, slot_width: int, dtype: torch.dtype, device: str | torch.device,
                 adapter_slots: int = 0):
        if not 0 <= adapter_slots < num_slots:
            raise ValueError(f"adapter_slots ({adapter_slots}) must be >= 0 and leave KV slots: less than "
                             f"num_slots ({num_slots})")
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.slot_width = slot_width
        self.dtype = dtype
        self.device = torch.device(device)
        # [layer, K|V, slot, width]: one allocation, so a slot's rows for all layers are one strided view.
        self.kv = torch.zeros(num_layers, 2, num_slots, slot_width, dtype=dtype, device=self.device)
        # Each layer's K and V views, made once: an eager step asks for them ~8 times a layer, and indexing
        # makes a new view every time (a few µs of host time each, in the launch the GPU may be waiting on).
        self._k = [self.kv[layer, 0] for layer in range(num_layers)]
        self._v = [self.kv[layer, 1] for layer in range(num_layers)]
        self.adapter_slots = adapter_slots
        if adapter_slots:
            self.adapter_allocator = SlotAllocator(adapter_slots)
            self.allocator = SlotAllocator(num_slots - adapter_slots, first_slot=adapter_slots)
        else:
            self.allocator = self.adapter_allocator = SlotAllocator(num_slots)

    @property
    def unified(self) -> bool:
        return self.allocator is self.adapter_allocator

    @property
    def num_free(self) -> int:
        """Free slots of both kinds (each counted once in the unified pool)."""
        if self.unified:
            return self.allocator.num_free
        return self.allocator.num_free + self.adapter_allocator.num_free

    @property
    def num_used(self) -> int:
        return self.num_slots - self.num_free

    def k(self, layer: int) -> torch.Tensor:
        return self._k[layer]

    def v(self, layer: int) -> torch.Tensor:
        return self._v[layer]

    def write_adapter_rows(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Scatter an adapter's packed rows `[num_layers, 2, n, width]` into `slots` (n ids) of every layer."""
        self.kv[:, :, slots] = rows.to(self.dtype)

    @staticmethod
    def bytes_for_pool(free: int, fraction: float, headroom_gb: float) -> int:
        """The pool's share of `free` bytes of GPU memory: all but `headroom_gb` GiB, and at most `fraction`
        of it. What the steps and graphs need beside the pool does not grow with the card, so an amount left
        suits an 80 GB and a 141 GB card alike, where a share left idle ~19 GB on the larger one."""
        budget = min(int(free * fraction), free - int(headroom_gb * 2**30))
        if budget <= 0:
            raise ValueError(f"the GPU has {free / 2**30:.1f} GiB free after the weights, not more than the "
                             f"{headroom_gb:g} GiB pool_headroom_gb leaves beside the pool: lower "
                             "pool_headroom_gb or set num_slots")
        return budget

    @staticmethod
    def slots_for_bytes(num_bytes: int, num_layers: int, slot_width: int, dtype: torch.dtype) -> int:
        per_slot = num_layers * 2 * slot_width * torch.empty((), dtype=dtype).element_size()
        return max(1, num_bytes // per_slot)
