"""A stacked graph's dense operands in buffers of their own (kernel_shapes graph_stacked_held): every layer's A
and Bᵀ rows of a step's few adapters, gathered from the pool when the step's adapters change, so the graph's
products read them in place instead of gathering them again every step.

Why: gathered inside the graph, the rows are read from the pool and written once more every step, about a
third of the stacked products' time at S-GQA's shapes over 5 adapters on an H100 (docs/benchmarks.md), while a
steady few-adapter workload steps over the same adapters for thousands of steps. The price is memory taken
from the pool: `columns` of every layer's rows of every group, the widest stack any graph may hold.
"""
from __future__ import annotations

import torch

from shared.model_config import ModelConfig

from .adapter_layout import chunks
from .ops.stacked_lora import StackedRows, gather_stack, stack_views


def group_rows(cfg: ModelConfig, modules: tuple[int, ...], slot_width: int, columns: int) -> tuple[int, int]:
    """Pool rows of one layer's stacked A and Bᵀ for a group over `columns` columns (ops.stacked_lora's layout)."""
    fan_in, out_dims = cfg.group_dims(modules)
    return (len(modules) * columns * chunks(fan_in, slot_width),
            columns * sum(chunks(d, slot_width) for d in out_dims))


def held_bytes(cfg: ModelConfig, groups: tuple[tuple[int, ...], ...], slot_width: int, columns: int,
               dtype: torch.dtype) -> int:
    """What HeldStacks over these groups and `columns` takes from the device."""
    rows = sum(sum(group_rows(cfg, modules, slot_width, columns)) for modules in groups)
    return cfg.num_layers * rows * slot_width * torch.empty((), dtype=dtype).element_size()


class HeldStacks:
    def __init__(self, cfg: ModelConfig, groups: tuple[tuple[int, ...], ...], slot_width: int, columns: int,
                 dtype: torch.dtype, device: torch.device | str):
        """Buffers for stacks of up to `columns` columns; a narrower stack uses their leading rows."""
        self.columns, self.num_layers = columns, cfg.num_layers
        self.a: dict[tuple[int, ...], torch.Tensor] = {}
        self.b: dict[tuple[int, ...], torch.Tensor] = {}
        # Zeros, not whatever the memory held: a graph is only replayed over them after a gather, but a NaN
        # read into a masked-out column would not stay masked (NaN × 0), so none may be there.
        for modules in groups:
            a_rows, b_rows = group_rows(cfg, modules, slot_width, columns)
            self.a[modules] = torch.zeros(cfg.num_layers, a_rows, slot_width, dtype=dtype, device=device)
            self.b[modules] = torch.zeros(cfg.num_layers, b_rows, slot_width, dtype=dtype, device=device)
        self.gathers = 0

    def _buffers(self, layer: int, modules: tuple[int, ...], rows: StackedRows) -> tuple[torch.Tensor, torch.Tensor]:
        if rows.columns > self.columns:
            raise ValueError(f"a stack of {rows.columns} columns does not fit buffers of {self.columns}")
        return self.a[modules][layer, :rows.a_rows.shape[0]], self.b[modules][layer, :rows.b_rows.shape[0]]

    def gather(self, pool, stacks: dict[tuple[int, ...], StackedRows]) -> None:
        """Every layer's rows of every group from the pool, on the current stream (so after any replay queued
        before it that reads the buffers, and before any queued after it)."""
        for layer in range(self.num_layers):
            k_buf, v_buf = pool.k(layer), pool.v(layer)
            for modules, rows in stacks.items():
                gather_stack(k_buf, v_buf, rows, *self._buffers(layer, modules, rows))
        self.gathers += 1

    def views(self, layer: int, modules: tuple[int, ...], rows: StackedRows
              ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One layer's operands of a group, as gather_stack returns them, from what `gather` put there."""
        return stack_views(*self._buffers(layer, modules, rows), rows)
