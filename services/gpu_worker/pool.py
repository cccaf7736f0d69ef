"""The unified page pool: one slot free list shared by KV tokens and adapter rows.

A slot id names the same row in every layer's K and V buffer. A token's K and V for all layers take
one slot; an adapter takes `n_slots` slots holding its A rows (in K buffers) and Bᵀ rows (in V
buffers). Because both kinds draw from one free list, KV and adapters trade memory freely.
"""
from __future__ import annotations

from collections import deque

import torch


class SlotAllocator:
    """O(1) free list of slot ids. Slots come out in FIFO order of their release (oldest free first),
    so behaviour is deterministic and testable with exact ids."""

    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        # One byte per slot catches double frees and frees of foreign ids without scanning the list.
        self._in_use = bytearray(num_slots)

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
            if not in_use[s]:
                raise RuntimeError(f"slot {s} freed while not in use")
            in_use[s] = 0
        self._free.extend(slots)


class UnifiedPool:
    """Per layer a K buffer and a V buffer of `[num_slots, slot_width]`, slot_width = kv heads × head dim."""

    def __init__(self, num_layers: int, num_slots: int, slot_width: int, dtype: torch.dtype, device: str | torch.device):
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.slot_width = slot_width
        self.dtype = dtype
        self.device = torch.device(device)
        # [layer, K|V, slot, width]: one allocation, so a slot's rows for all layers are one strided view.
        self.kv = torch.zeros(num_layers, 2, num_slots, slot_width, dtype=dtype, device=self.device)
        self.allocator = SlotAllocator(num_slots)

    def k(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 0]

    def v(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 1]

    def write_adapter_rows(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Scatter an adapter's packed rows `[num_layers, 2, n, width]` into `slots` (n ids) of every layer."""
        self.kv[:, :, slots] = rows.to(self.dtype)

    @staticmethod
    def slots_for_bytes(num_bytes: int, num_layers: int, slot_width: int, dtype: torch.dtype) -> int:
        per_slot = num_layers * 2 * slot_width * torch.empty((), dtype=dtype).element_size()
        return max(1, num_bytes // per_slot)
