"""The static stacks a decode graph's stacked LoRA reads (kernel_shapes graph_few_stacked, ops/stacked_lora.py):
for each module group, the pool row indices of a step's few adapters side by side and the owner of each column,
and each resident id's place among those adapters.

A graph replays with whatever its buffers hold, so the host refills them before a replay whose adapters differ
from the ones they hold; a steady few-adapter workload fills them once. The indices are the same for every
layer (an adapter's slots are one list for all layers' buffers), so one fill serves the whole step. A held
stack (held_stacks.py) also gathers the rows themselves at a fill, and its graphs read them in place.

Adapters are told apart by their Resident, not their name: one unloaded and loaded again (new slots, or new
weights under the same name) is a new Resident, and the buffers are filled anew.
"""
from __future__ import annotations

import torch

from shared.model_config import MODULES, ModelConfig

from .ops.meta import LoraTables
from .held_stacks import HeldStacks
from .ops.stacked_lora import StackedRows, gather_stack, stack_mask, stack_rows
from .resident_adapters import Resident

STACK_MIN_COLUMNS = 64


def stacked_columns(widest_ranks: list[int]) -> int:
    """The columns a stacked graph holds for adapters of these widest ranks (each adapter's largest over its
    modules): their sum, bucketed to a power of two from STACK_MIN_COLUMNS, so a few graphs serve every mix
    while most of a graph's columns hold rows (the products' work grows with the columns)."""
    columns = STACK_MIN_COLUMNS
    while columns < sum(widest_ranks):
        columns *= 2
    return columns


def host_tables(residents: list[Resident]) -> LoraTables:
    """The device tables' rows of these residents, on the host, indexed by their place in the list."""
    n = len(MODULES)
    longest = max((len(r.slots) for r in residents), default=0)
    slots = torch.zeros(len(residents), max(longest, 1), dtype=torch.int32)
    ranks, a_off, b_off = (torch.zeros(len(residents), n, dtype=torch.int32) for _ in range(3))
    for i, r in enumerate(residents):
        slots[i, :len(r.slots)] = torch.tensor(r.slots, dtype=torch.int32)
        ranks[i] = torch.tensor(r.ranks, dtype=torch.int32)
        a_off[i] = torch.tensor(r.a_off, dtype=torch.int32)
        b_off[i] = torch.tensor(r.b_off, dtype=torch.int32)
    return LoraTables(slots, ranks, a_off, b_off)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Into a graph's buffer on the stream that replays it, without waiting for the step in flight: from pinned
    memory, kept by the caching host allocator until the copy has read it."""
    if dst.device.type == "cuda":
        src = src.pin_memory()
    dst.copy_(src.to(dst.dtype), non_blocking=True)


def _same(a: tuple, b: tuple | None) -> bool:
    return b is not None and len(a) == len(b) and all(x is y for x, y in zip(a, b))


class GraphStacks:
    def __init__(self, cfg: ModelConfig, groups: tuple[tuple[int, ...], ...], slot_width: int, zero_slot: int,
                 max_resident: int, device: torch.device, held: HeldStacks | None = None):
        """`zero_slot`: a pool slot whose rows are zeros in every layer, read by the columns past the adapters'
        rows. `held`: buffers for held stacks (kernel_shapes graph_stacked_held), None without them."""
        self.width, self.zero_slot, self.device, self.held_stacks = slot_width, zero_slot, device, held
        self.dims = {modules: cfg.group_dims(modules) for modules in groups}
        # Resident id -> place in the stack; the last entry answers -1 (base-model and padding rows).
        self.lookup = torch.full((max_resident + 1,), -1, dtype=torch.int32, device=device)
        self.buffers: dict[int, dict[tuple[int, ...], StackedRows]] = {}
        self.filled: dict[int, tuple] = {}  # columns -> the adapters its index buffers point at
        self.looked_up: tuple | None = None
        self.gathered: tuple[int, tuple] | None = None  # (columns, the adapters) the held buffers hold
        self.fills = 0

    def rows(self, columns: int) -> dict[tuple[int, ...], StackedRows]:
        """The buffers of the graphs over `columns` columns (allocated at first use, holding no adapter)."""
        if columns not in self.buffers:
            self.buffers[columns] = {
                modules: stack_rows(host_tables([]), [], modules, fan_in, out_dims, self.width, self.zero_slot,
                                    columns, self.device)
                for modules, (fan_in, out_dims) in self.dims.items()}
        return self.buffers[columns]

    def positions(self, token_adapter: torch.Tensor) -> torch.Tensor:
        """Each token's place in the stack (-1: base model, padding or an adapter not stacked)."""
        return self.lookup[token_adapter.long().remainder(self.lookup.shape[0])]

    def mask(self, token_adapter: torch.Tensor, columns: int, dtype: torch.dtype) -> torch.Tensor:
        """The step's stack_mask over the `columns` buffers, shared by every group (laid out alike by fill)."""
        owner = next(iter(self.rows(columns).values())).owner
        return stack_mask(self.positions(token_adapter), owner, dtype)

    def held_columns(self) -> int:
        """The widest held stack the buffers take (0: no buffers)."""
        return self.held_stacks.columns if self.held_stacks is not None else 0

    def fill(self, columns: int, residents: list[Resident], pool=None, held: bool = False) -> None:
        """Point the `columns` buffers and the lookup at `residents` (the step's distinct adapters), unless they
        already are; `held`: gather their rows from `pool` into the held buffers too, unless those hold them."""
        key = tuple(residents)  # compared by identity (_same), and kept alive, so no id is reused meanwhile
        if held and columns > self.held_columns():
            raise ValueError(f"a held stack of {columns} columns needs graph_stacked_held={columns} or more in "
                             f"the engine's kernel_shapes, whose buffers are taken at start "
                             f"(these hold {self.held_columns()})")
        if not _same(key, self.filled.get(columns)):
            tables = host_tables(residents)
            # Every group laid out alike (each adapter its widest rank over all modules): one mask a step.
            widths = [max(r.ranks) for r in residents]
            for modules, dst in self.rows(columns).items():
                fan_in, out_dims = self.dims[modules]
                built = stack_rows(tables, list(range(len(residents))), modules, fan_in, out_dims, self.width,
                                   self.zero_slot, columns, widths=widths)
                _copy(dst.a_rows, built.a_rows)
                _copy(dst.b_rows, built.b_rows)
                _copy(dst.owner, built.owner)
            self.filled[columns] = key
            self.fills += 1
        if held and not (self.gathered is not None and self.gathered[0] == columns
                         and _same(key, self.gathered[1])):
            # Only the groups these adapters adapt: a graph runs no other (its key's LoRA groups follow the
            # step's ranks), and S1/S2's q,k,v,o adapters would otherwise copy the MLP's zero rows, most of it.
            used = {modules: rows for modules, rows in self.rows(columns).items()
                    if any(r.ranks[m] for r in residents for m in modules)}
            self.held_stacks.gather(pool, used)
            self.gathered = (columns, key)
        if not _same(key, self.looked_up):
            lookup = torch.full(self.lookup.shape, -1, dtype=torch.int32)
            for place, r in enumerate(residents):
                lookup[r.resident_id] = place
            _copy(self.lookup, lookup)
            self.looked_up = key

    def operands(self, pool, layer: int, modules: tuple[int, ...], columns: int, held: bool
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One layer's stacked A and Bᵀ of a group (ops.stacked_lora.gather_stack's): read in place from the held
        buffers, or gathered from the pool now."""
        rows = self.rows(columns)[modules]
        if held:
            return self.held_stacks.views(layer, modules, rows)
        return gather_stack(pool.k(layer), pool.v(layer), rows)
