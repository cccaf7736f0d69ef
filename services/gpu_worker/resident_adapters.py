"""Adapters resident in the unified pool: slot ownership, refcounts, LRU eviction, the device tables.

An adapter is copied into the pool when a request first needs it and stays after its last request ends,
as long as nobody needs the slots; unused adapters are evicted least-recently-used first, before any
request is preempted for KV space. In the no-unify baseline adapters live in their own slot range: evicting
them makes room for other adapters only, never for KV.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from shared.model_config import MODULES, ModelConfig

from .adapter_layout import PackedAdapter, layout_offsets, lora_read_bytes
from .ops.meta import LoraTables
from .pool import UnifiedPool


@dataclass
class Resident:
    name: str
    resident_id: int
    slots: list[int]
    ranks: tuple[int, ...]
    read_bytes: int = 0  # rows a step's LoRA kernels read for it (adapter_layout.lora_read_bytes)
    refcount: int = 0
    # Where each module's A and Bᵀ rows begin in `slots` (the device tables' a_off and b_off rows), for the
    # host's own indexing of them (graph_stacks.py).
    a_off: tuple[int, ...] = ()
    b_off: tuple[int, ...] = ()


def adapter_ready(loader, name: str) -> bool:
    """A loader's answer to "would loading `name` return at once?"; loaders without `ready` always would."""
    ready = getattr(loader, "ready", None)
    return True if ready is None else bool(ready(name))


class AdapterTooLarge(ValueError):
    pass


class ResidentAdapters:
    def __init__(self, pool: UnifiedPool, cfg: ModelConfig, max_resident: int, max_rank: int,
                 loader: Callable[[str], PackedAdapter],
                 copy_rows: Callable[[torch.Tensor, PackedAdapter], object] | None = None):
        self.pool = pool
        self.cfg = cfg
        self.loader = loader
        # Default copy is a synchronous scatter; the CUDA path passes one that stages on a side stream.
        # Copies the rows into pool slots; returns None when done at once, else a handle whose query() says
        # when the host rows have been read (a CUDA event of an asynchronous copy).
        self.copy_rows = copy_rows or (lambda slots, packed: pool.write_adapter_rows(slots, packed.rows))
        _, _, self.max_slots = layout_offsets((max_rank,) * len(MODULES), cfg, pool.slot_width)
        dev = pool.device
        n = len(MODULES)
        self.tables = LoraTables(
            slots=torch.zeros(max_resident, self.max_slots, dtype=torch.int32, device=dev),
            ranks=torch.zeros(max_resident, n, dtype=torch.int32, device=dev),
            a_off=torch.zeros(max_resident, n, dtype=torch.int32, device=dev),
            b_off=torch.zeros(max_resident, n, dtype=torch.int32, device=dev),
        )
        self._by_name: dict[str, Resident] = {}
        self._unused: OrderedDict[str, None] = OrderedDict()
        # Slots of the unused adapters, kept as they change: admission asks for it per waiting request, and
        # thousands of adapters may stay resident.
        self._unused_slots = 0
        self._slots_in_use = 0  # reported every step
        self._free_ids = list(range(max_resident - 1, -1, -1))
        # Adapters fetched to learn their size but not yet admitted; acquire() takes them from here so the
        # loader runs once per load.
        self._staged: dict[str, PackedAdapter] = {}
        self._copying: dict[str, object] = {}  # adapter -> handle of its copy into the pool, while running
        self.loads = 0
        self.bytes_loaded = 0

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    @property
    def held_names(self) -> set[str]:
        """Adapters whose host rows may still be read: staged for admission, or copied into the pool by a
        copy not finished yet. A resident adapter whose copy is done needs them no more (every later read
        is from the pool), so its host bytes (an arena pin) can go: the host cache is then never filled
        by adapters that merely stay resident on the GPU."""
        for name, done in list(self._copying.items()):
            if done.query():
                del self._copying[name]
        return set(self._staged) | set(self._copying)

    @property
    def has_staged(self) -> bool:
        """Whether some adapter is loaded for admission but not yet in the pool."""
        return bool(self._staged)

    def keep_staged(self, wanted: set[str]) -> None:
        """Forget staged adapters no waiting request wants any more (e.g. the one waiting was aborted)."""
        for name in [n for n in self._staged if n not in wanted]:
            del self._staged[name]

    @property
    def slots_in_use(self) -> int:
        return self._slots_in_use

    @property
    def unused_slots(self) -> int:
        return self._unused_slots

    def rows_read(self, names: set[str]) -> tuple[int, int]:
        """How many of these adapters a step's LoRA kernels read rows of, and how many bytes: the resident
        ones (a merged adapter, or the base model's "", has no rows in the pool)."""
        found = [self._by_name[n] for n in names if n in self._by_name]
        return len(found), sum(r.read_bytes for r in found)

    def ready(self, name: str) -> bool:
        """Whether admitting a request of `name` now would not wait on the loader (resident, staged, or the
        loader says its bytes are at hand; loaders that cannot tell are always ready)."""
        return name in self._by_name or name in self._staged or adapter_ready(self.loader, name)

    def slots_to_load(self, name: str) -> int:
        """Slots that pinning `name` would take from the free list (0 if already resident)."""
        if name in self._by_name:
            return 0
        if name not in self._staged:
            self._staged[name] = self.loader(name)
        need = self._staged[name].n_slots
        self._check_fits(name, need)
        return need

    def _check_fits(self, name: str, need: int) -> None:
        if need > self.max_slots:
            raise AdapterTooLarge(f"adapter {name!r} needs {need} slots, more than max_lora_rank allows ({self.max_slots})")
        if not self.pool.unified and need > self.pool.adapter_allocator.num_slots:
            raise AdapterTooLarge(f"adapter {name!r} needs {need} slots; the adapter pool has "
                                  f"{self.pool.adapter_allocator.num_slots} (adapter_pool_slots)")

    def can_make_room(self, slots: int, keep: str | None = None) -> bool:
        """Whether `slots` slots (KV, plus `keep`'s rows when it is not resident yet, as `slots_to_load`
        counts them) can be freed up by evicting unused adapters other than `keep`, and `keep` can get a
        table row."""
        spare = self.unused_slots - (len(self._by_name[keep].slots) if keep in self._unused else 0)
        if keep is not None and keep not in self._by_name and not self._free_ids and not self._unused:
            return False  # every table row is held by a running request's adapter
        if self.pool.unified:
            return self.pool.allocator.num_free + spare >= slots
        adapter_need = self.slots_to_load(keep) if keep is not None else 0
        return (self.pool.allocator.can_allocate(slots - adapter_need)
                and self.pool.adapter_allocator.num_free + spare >= adapter_need)

    def _write_tables(self, rid: int, slots: list[int], packed: PackedAdapter) -> None:
        """The adapter's row of the device tables, in one asynchronous copy from pinned memory: a plain
        assignment from a host list is a blocking copy that waits for the compute stream, i.e. for the step
        in flight when an admission is scheduled ahead of it (EngineConfig.overlap_steps)."""
        n = len(MODULES)
        row = torch.tensor(list(slots) + list(packed.ranks) + list(packed.a_off) + list(packed.b_off),
                           dtype=torch.int32)
        if self.pool.device.type == "cuda":
            # The caching host allocator keeps the pinned block until the copy has read it.
            row = row.pin_memory().to(self.pool.device, non_blocking=True)
        need, t = len(slots), self.tables
        t.slots[rid, :need] = row[:need]
        t.ranks[rid] = row[need:need + n]
        t.a_off[rid] = row[need + n:need + 2 * n]
        t.b_off[rid] = row[need + 2 * n:]

    def acquire(self, name: str) -> Resident | None:
        """Pin an adapter in the pool, loading it if needed. None when slots are short even after
        evicting every unused adapter (the caller waits or preempts). Unknown adapters raise KeyError."""
        res = self._by_name.get(name)
        if res is None:
            packed = self._staged.pop(name, None) or self.loader(name)
            need = packed.n_slots
            self._check_fits(name, need)
            if not self._evict_for_adapter(need):
                return None
            slots = self.pool.adapter_allocator.allocate(need)
            rid = self._free_ids.pop()
            # Host ids: each copy moves them to the device on the stream that reads them (adapter_copy.py).
            done = self.copy_rows(torch.tensor(slots, dtype=torch.long), packed)
            if done is not None:
                self._copying[name] = done
            self._write_tables(rid, slots, packed)
            res = Resident(name, rid, slots, packed.ranks,
                           lora_read_bytes(packed.ranks, self.cfg, packed.rows.element_size()),
                           a_off=tuple(packed.a_off), b_off=tuple(packed.b_off))
            self._by_name[name] = res
            self._slots_in_use += need
            self.loads += 1
            self.bytes_loaded += packed.nbytes
        if name in self._unused:
            del self._unused[name]
            self._unused_slots -= len(res.slots)
        res.refcount += 1
        return res

    def release(self, name: str) -> None:
        res = self._by_name[name]
        res.refcount -= 1
        if res.refcount == 0:
            self._unused[name] = None
            self._unused_slots += len(res.slots)

    def evict_until(self, free_slots: int) -> bool:
        """Evict unused adapters (LRU first) until `free_slots` KV slots are free. With a separate adapter
        pool evicting frees no KV slot, so nothing is evicted."""
        if not self.pool.unified:
            return self.pool.allocator.can_allocate(free_slots)
        return self._evict_while(lambda: not self.pool.allocator.can_allocate(free_slots))

    def _evict_for_adapter(self, need: int) -> bool:
        """Evict unused adapters (LRU first) until `need` adapter slots and a table row are free."""
        alloc = self.pool.adapter_allocator
        return self._evict_while(lambda: not alloc.can_allocate(need) or not self._free_ids)

    def _evict_while(self, short: Callable[[], bool]) -> bool:
        while short():
            if not self._unused:
                return False
            self._evict(next(iter(self._unused)))
        return True

    def evict(self, name: str) -> bool:
        """Drop an unused adapter now (e.g. it was deleted); False if requests still hold it."""
        if name not in self._unused:
            return False
        self._evict(name)
        return True

    def _evict(self, name: str) -> None:
        del self._unused[name]
        res = self._by_name.pop(name)
        self._unused_slots -= len(res.slots)
        self._slots_in_use -= len(res.slots)
        self.pool.adapter_allocator.free(res.slots)
        self.tables.ranks[res.resident_id] = 0
        self._free_ids.append(res.resident_id)
