"""Adapter clustering (S-LoRA): keep the number of distinct adapters in a batch small.

Once a batch holds `d` distinct adapters, requests whose adapter is already in the batch, or already
resident in the worker's pool, are preferred: they cost no adapter load and no extra pool slots. Others
fill what is left only when those run out, and never beyond `max_adapters` distinct adapters (the rows
the worker's adapter table has). Base-model requests (adapter "") cost nothing and always fit.
"""
from __future__ import annotations

from typing import Iterable

BASE = ""


class BatchAdapters:
    """The distinct adapters of one worker's batch while the scheduler fills it."""

    def __init__(self, running: Iterable[str], resident: Iterable[str], d: int, max_adapters: int = 0):
        if d < 0 or max_adapters < 0:
            raise ValueError("clustering bounds must be >= 0 (0 = no bound)")
        self.in_batch = {a for a in running if a != BASE}
        self.resident = set(resident)
        self.d = d
        self.max_adapters = max_adapters

    def preferred(self, adapter: str) -> bool:
        """Take this request in the first pass, before any that need a new adapter past `d`."""
        if adapter == BASE or adapter in self.in_batch:
            return True
        if self.d and len(self.in_batch) >= self.d:
            return adapter in self.resident and self.allowed(adapter)
        return self.allowed(adapter)

    def allowed(self, adapter: str) -> bool:
        """Take this request at all (the second pass): only the hard bound on distinct adapters applies."""
        if adapter == BASE or adapter in self.in_batch:
            return True
        return not self.max_adapters or len(self.in_batch) < self.max_adapters

    def add(self, adapter: str) -> None:
        if adapter != BASE:
            self.in_batch.add(adapter)
