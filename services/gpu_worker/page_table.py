"""The device page table: one row per running request holding the slot id of each of its tokens.

Rows persist across steps and only newly allocated slots are written each step (one small copy and one
scatter), so building a step's attention metadata costs O(new tokens) on the host, not O(context).
A page here is one token: the pool's slots are token-sized, so no block rounding wastes memory.
"""
from __future__ import annotations

import torch


class PageTable:
    def __init__(self, max_rows: int, max_len: int, device: torch.device):
        self.max_len = max_len
        self.device = device
        self.table = torch.zeros(max_rows, max_len, dtype=torch.int32, device=device)
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self._rows: list[int] = []
        self._cols: list[int] = []
        self._slots: list[int] = []

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    def assign_row(self) -> int:
        return self._free_rows.pop()

    def release_row(self, row: int) -> None:
        self._free_rows.append(row)

    def append(self, row: int, start: int, slots: list[int]) -> None:
        """Queue slots for positions start ... start + len(slots) - 1 of a row; written at the next flush."""
        n = len(slots)
        self._rows += [row] * n
        self._cols += range(start, start + n)
        self._slots += slots

    def flush(self) -> None:
        if not self._rows:
            return
        packed = torch.tensor([self._rows, self._cols, self._slots], dtype=torch.int64)
        if self.device.type == "cuda":
            packed = packed.pin_memory().to(self.device, non_blocking=True)
        rows, cols, slots = packed
        self.table[rows, cols] = slots.to(torch.int32)
        self._rows, self._cols, self._slots = [], [], []

    def gather(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """Slot table `[len(rows), width]` for a step's requests, in batch order."""
        return self.table[:, :width].index_select(0, rows)
