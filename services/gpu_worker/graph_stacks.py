"""The static stacks a decode graph's stacked LoRA reads (kernel_shapes graph_few_stacked, ops/stacked_lora.py):
for each module group, the pool row indices of a step's few adapters side by side and the owner of each column,
and each resident id's place among those adapters.

A graph replays with whatever its buffers hold, so the host refills them before a replay whose adapters differ
from the ones they hold; a steady few-adapter workload fills them once. The indices are the same for every
layer (an adapter's slots are one list for all layers' buffers), so one fill serves the whole step.
"""
from __future__ import annotations

import torch

from shared.model_config import MODULES, ModelConfig

from .ops.meta import LoraTables
from .ops.stacked_lora import StackedRows, stack_mask, stack_rows
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


class GraphStacks:
    def __init__(self, cfg: ModelConfig, groups: tuple[tuple[int, ...], ...], slot_width: int, zero_slot: int,
                 max_resident: int, device: torch.device):
        """`zero_slot`: a pool slot whose rows are zeros in every layer, read by the columns past the adapters'
        rows."""
        self.width, self.zero_slot, self.device = slot_width, zero_slot, device
        self.dims = {modules: cfg.group_dims(modules) for modules in groups}
        # Resident id -> place in the stack; the last entry answers -1 (base-model and padding rows).
        self.lookup = torch.full((max_resident + 1,), -1, dtype=torch.int32, device=device)
        self.buffers: dict[int, dict[tuple[int, ...], StackedRows]] = {}
        self.held: dict[int, tuple] = {}  # columns -> the adapters its buffers hold
        self.looked_up: tuple | None = None
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

    def fill(self, columns: int, residents: list[Resident]) -> None:
        """Point the `columns` buffers and the lookup at `residents` (the step's distinct adapters), unless they
        already are."""
        key = tuple((r.name, r.resident_id, r.slots[0] if r.slots else -1) for r in residents)
        if self.held.get(columns) != key:
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
            self.held[columns] = key
            self.fills += 1
        if self.looked_up != key:
            lookup = torch.full(self.lookup.shape, -1, dtype=torch.int32)
            for place, r in enumerate(residents):
                lookup[r.resident_id] = place
            _copy(self.lookup, lookup)
            self.looked_up = key
