"""The host-RAM adapter cache: one shared-memory segment holding adapters in the pool's row format.

Each adapter's PackedAdapter rows are one contiguous byte range, so a worker moves it to the GPU in one
copy (see ARCHITECTURE.md: many small copies are slow). The segment's size comes from configuration,
never from the machine. An acquired (pinned) adapter is never moved or evicted, because a worker may be
reading its bytes. Adapters are evicted least recently used first, as whole address windows: when no
hole is large enough, the store frees the window (free bytes and unpinned adapters next to each other)
whose most recently used adapter is the oldest. Nothing is ever moved: sliding adapters together to
join the holes would copy up to the whole arena on the store's loop, seconds during which it answers
nobody (adapters of four ranks fragment a full arena all the time).
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from multiprocessing import shared_memory

import numpy as np
import torch

from services.gpu_worker.adapter_layout import PackedAdapter

from .byte_ranges import ByteRanges, align_up

# Offsets aligned for DMA and for viewing any dtype in place.
ARENA_ALIGN = 256


# Stands for a reserved range in the address-order walk of eviction windows: never evicted.
RESERVED = object()


class ArenaFull(RuntimeError):
    """No room even after evicting every unpinned adapter (for now: pins are given back)."""


class ArenaTooSmall(ArenaFull):
    """The adapter is larger than the whole arena: it can never be laid in."""


@dataclass
class ArenaEntry:
    adapter: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    a_off: tuple[int, ...]
    b_off: tuple[int, ...]
    pins: Counter = field(default_factory=Counter)  # worker_id -> acquisitions not yet released

    @property
    def pinned(self) -> bool:
        return sum(self.pins.values()) > 0


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def unlink_stale_segment(name: str) -> bool:
    """Remove a shared-memory segment left by a process killed before anyone unlinked it; True if one was
    there. Only for names no live process can hold, such as one made of the caller's own pid: a store killed
    with its launcher leaves `loraplex-arena-<pid>` behind, and a later store given that pid could not start."""
    try:
        stale = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        return False
    stale.close()
    stale.unlink()
    return True


class Arena:
    def __init__(self, nbytes: int, name: str = ""):
        if nbytes < ARENA_ALIGN:
            raise ValueError(f"arena of {nbytes} bytes is too small (at least {ARENA_ALIGN})")
        self.shm = shared_memory.SharedMemory(name=name or None, create=True, size=nbytes)
        self.name = self.shm.name
        self.ranges = ByteRanges(nbytes, ARENA_ALIGN)
        self.capacity = self.ranges.capacity
        self._bytes = np.frombuffer(self.shm.buf, dtype=np.uint8)
        self._lru: OrderedDict[str, ArenaEntry] = OrderedDict()  # least recently used first
        # Ranges handed to a load thread that writes an adapter's rows straight into them: neither resident
        # (not handed out) nor evictable until committed or given back.
        self._reserved: dict[str, tuple[int, int]] = {}
        self.loads = 0
        self.bytes_loaded = 0
        self.evictions = 0

    # ---- lookups
    def __contains__(self, adapter: str) -> bool:
        return adapter in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def get(self, adapter: str) -> ArenaEntry | None:
        entry = self._lru.get(adapter)
        if entry is not None:
            self._lru.move_to_end(adapter)
        return entry

    @property
    def adapters(self) -> list[str]:
        """Resident adapters, least recently used first."""
        return list(self._lru)

    @property
    def used_bytes(self) -> int:
        return sum(align_up(e.nbytes, ARENA_ALIGN) for e in self._lru.values()) + self._reserved_bytes

    @property
    def pinned_bytes(self) -> int:
        """Bytes nothing may evict now: pinned adapters and ranges reserved for loads under way."""
        return sum(align_up(e.nbytes, ARENA_ALIGN) for e in self._lru.values() if e.pinned) + self._reserved_bytes

    @property
    def _reserved_bytes(self) -> int:
        return sum(align_up(n, ARENA_ALIGN) for _, n in self._reserved.values())

    @property
    def pin_count(self) -> int:
        """Acquisitions not yet released, over every adapter and worker (a leak shows as a count that
        stays above what the workers' pools hold)."""
        return sum(sum(e.pins.values()) for e in self._lru.values())

    # ---- loading and eviction
    def reserve(self, adapter: str, nbytes: int, keep: frozenset[str] = frozenset()) -> torch.Tensor:
        """Room for an adapter's rows, evicting as put does, as a byte tensor over the segment that a load
        thread may fill while the loop goes on (nothing else touches a reserved range); then `commit`, or
        `unreserve` if the load fails."""
        if adapter in self._reserved or adapter in self._lru:
            raise ValueError(f"adapter {adapter!r} is already reserved or resident")
        offset = self._make_room(nbytes, keep)
        self._reserved[adapter] = (offset, nbytes)
        return torch.from_numpy(self._bytes[offset:offset + nbytes])

    def commit(self, adapter: str, dtype: torch.dtype, shape: tuple[int, ...], ranks, a_off, b_off) -> ArenaEntry:
        """The reserved rows are written: the adapter is resident (most recently used)."""
        offset, nbytes = self._reserved.pop(adapter)
        entry = ArenaEntry(adapter, offset, nbytes, dtype_name(dtype), tuple(shape), tuple(ranks), tuple(a_off),
                           tuple(b_off))
        self._lru[adapter] = entry
        self.loads += 1
        self.bytes_loaded += nbytes
        return entry

    def unreserve(self, adapter: str) -> None:
        offset, nbytes = self._reserved.pop(adapter)
        self.ranges.free(offset, nbytes)

    def put(self, adapter: str, packed: PackedAdapter, keep: frozenset[str] = frozenset()) -> ArenaEntry:
        """Place an adapter's rows (no-op if already resident), evicting unpinned adapters as needed,
        except those in keep (more urgent prefetches)."""
        entry = self.get(adapter)
        if entry is not None:
            return entry
        rows = packed.rows.contiguous()
        nbytes = rows.numel() * rows.element_size()
        offset = self._make_room(nbytes, keep)
        self._bytes[offset:offset + nbytes] = rows.reshape(-1).view(torch.uint8).numpy()
        entry = ArenaEntry(adapter, offset, nbytes, dtype_name(rows.dtype), tuple(rows.shape),
                           tuple(packed.ranks), tuple(packed.a_off), tuple(packed.b_off))
        self._lru[adapter] = entry
        self.loads += 1
        self.bytes_loaded += nbytes
        return entry

    def _make_room(self, nbytes: int, keep: frozenset[str]) -> int:
        need = align_up(max(nbytes, 1), ARENA_ALIGN)
        if need > self.capacity:
            raise ArenaTooSmall(f"adapter needs {need} bytes; the arena holds {self.capacity}")
        offset = self.ranges.allocate(nbytes)
        if offset is not None:
            return offset
        victims = self._oldest_window(need, keep)
        if victims is None:
            raise ArenaFull(f"adapter needs {need} bytes; {self.ranges.free_bytes} free and "
                            f"{self.pinned_bytes} pinned by running requests")
        for victim in victims:
            self._remove(victim)
            self.evictions += 1
        offset = self.ranges.allocate(nbytes)
        assert offset is not None, "the freed window holds the adapter"
        return offset

    def _oldest_window(self, need: int, keep: frozenset[str]) -> list[ArenaEntry] | None:
        """The adapters to evict so that `need` contiguous bytes come free: of every run of neighbouring
        free ranges and evictable adapters that spans `need`, the one whose most recently used adapter is
        least recent (fewest bytes evicted among equals); None when pins and `keep` leave no such run.
        With adapters of one size this is plain LRU. Linear in the adapters per window tried: an arena
        holds a few thousand, and this runs once per load that finds no hole."""
        recency = {aid: i for i, aid in enumerate(self._lru)}
        # The address space in order: (start, end, entry or None for a free range).
        spans: list = [(e.offset, e.offset + align_up(e.nbytes, ARENA_ALIGN), e) for e in self._lru.values()]
        spans += [(start, start + size, None) for start, size in self.ranges.free_ranges()]
        spans += [(start, start + align_up(n, ARENA_ALIGN), RESERVED) for start, n in self._reserved.values()]
        spans.sort(key=lambda s: s[0])
        def blocked(entry) -> bool:
            return entry is RESERVED or entry.pinned or entry.adapter in keep

        best: tuple[tuple[int, int], int, int] | None = None  # ((newest rank, evicted bytes), first, last)
        for i, (start, _, first) in enumerate(spans):
            if first is not None and blocked(first):
                continue
            newest, evicted = -1, 0
            for j in range(i, len(spans)):
                _, end, entry = spans[j]
                if entry is not None:
                    if blocked(entry):
                        break
                    newest = max(newest, recency[entry.adapter])
                    evicted += end - spans[j][0]
                    if best is not None and (newest, evicted) >= best[0]:
                        break  # only grows from here
                if end - start >= need:
                    if best is None or (newest, evicted) < best[0]:
                        best = ((newest, evicted), i, j)
                    break
        if best is None:
            return None
        _, i, j = best
        return [entry for _, _, entry in spans[i:j + 1] if entry is not None]

    def _remove(self, entry: ArenaEntry) -> None:
        del self._lru[entry.adapter]
        self.ranges.free(entry.offset, entry.nbytes)

    def drop(self, adapter: str) -> bool:
        """Forget an adapter unless it is pinned; True if it is gone."""
        entry = self._lru.get(adapter)
        if entry is None:
            return True
        if entry.pinned:
            return False
        self._remove(entry)
        return True

    # ---- pins
    def acquire(self, adapter: str, worker_id: str) -> ArenaEntry:
        entry = self.get(adapter)
        if entry is None:
            raise KeyError(adapter)
        entry.pins[worker_id] += 1
        return entry

    def release(self, adapter: str, worker_id: str) -> ArenaEntry:
        entry = self._lru.get(adapter)
        if entry is None or entry.pins[worker_id] <= 0:
            raise KeyError(f"{adapter!r} is not acquired by worker {worker_id!r}")
        entry.pins[worker_id] -= 1
        if entry.pins[worker_id] == 0:
            del entry.pins[worker_id]
        return entry

    def release_worker(self, worker_id: str) -> list[str]:
        """Drop every pin of a worker that died; the adapters it held."""
        held = [e.adapter for e in self._lru.values() if e.pins.get(worker_id)]
        for adapter in held:
            del self._lru[adapter].pins[worker_id]
        return held

    # ---- access
    def rows(self, adapter: str) -> torch.Tensor:
        """The resident rows (a copy, so no view keeps the segment's buffer exported)."""
        e = self._lru[adapter]
        raw = torch.from_numpy(self._bytes[e.offset:e.offset + e.nbytes].copy())
        return raw.view(getattr(torch, e.dtype)).view(e.shape)

    def close(self) -> None:
        """Unmap and unlink the segment (the owner's job; readers only close)."""
        self._bytes = None
        try:
            self.shm.close()
        except BufferError:  # a range handed to a load cut short by the stop is still viewed: the mapping
            pass             # goes with the process; the name is unlinked below all the same
        try:
            self.shm.unlink()
        except FileNotFoundError:
            pass
