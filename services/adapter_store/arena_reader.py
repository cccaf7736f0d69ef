"""How another process (a gpu_worker) reads the arena the store owns.

Python < 3.13 registers every attached SharedMemory with the process's resource tracker, which unlinks
the segment when that process exits, taking the store's arena with it (ARCHITECTURE.md, measured facts).
attach_arena undoes that registration: only the store, the creator, unlinks the segment.
"""
from __future__ import annotations

import sys
from multiprocessing import resource_tracker, shared_memory

import torch

from services.gpu_worker.adapter_layout import PackedAdapter
from shared.wire import AdapterLocation


def attach_arena(name: str) -> shared_memory.SharedMemory:
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, track=False)
    shm = shared_memory.SharedMemory(name=name)
    resource_tracker.unregister(shm._name, "shared_memory")
    return shm


def location_rows(shm: shared_memory.SharedMemory, loc: AdapterLocation) -> torch.Tensor:
    """The adapter's rows as a tensor over the shared bytes (no copy). Valid until ReleaseAdapter; the
    tensor holds the segment's buffer exported, so drop it before shm.close()."""
    dtype = getattr(torch, loc.dtype)
    count = loc.nbytes // torch.empty((), dtype=dtype).element_size()
    flat = torch.frombuffer(shm.buf, dtype=dtype, count=count, offset=loc.offset)
    return flat.view(*loc.shape)


def location_packed(shm: shared_memory.SharedMemory, loc: AdapterLocation) -> PackedAdapter:
    """A PackedAdapter whose rows are the arena bytes themselves, ready for one host-to-device copy."""
    return PackedAdapter(loc.adapter, location_rows(shm, loc), tuple(loc.ranks), tuple(loc.a_off), tuple(loc.b_off))
