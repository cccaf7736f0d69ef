"""LoRA for a step of a few adapters as dense matrix products: the step's adapters' A rows gathered from the
pool into one matrix, side by side, so shrink is one GEMM of the tokens against all of them; each token keeps the
columns of its own adapter (the others masked to zero), and expand is one GEMM a module against the adapters' Bᵀ
rows stacked the same way, added into the output in place.

Why: over a few adapters a decode step's segments hold ~100 tokens each, and the segment kernels, built to
stream many adapters' rows, run far from both ceilings there (S-GQA over 5 adapters on an H100: shrink ~32 µs
and expand ~25 µs a launch, against a few µs of x, y and output traffic; docs/benchmarks.md). A GEMM over n
adapters' columns does n times the shrink FLOPs a token needs, which at a few adapters and ranks of 8-64 is
still far below a step's base GEMMs, on the tensor cores at cuBLAS's tiling.

Columns: `columns` (at least the adapters' widths summed) of A rows, packed adapter after adapter, each module
of the group in a block of its own; a column past an adapter's rows for a module reads the pool's zero slot, and
one past every adapter's belongs to none. The gather reads each adapter's rows once, as the segment kernels do,
and writes them once more as the products' dense operands. Results equal ops.reference's up to the sum's order
(fp32 accumulation, one rounding of the output).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..adapter_layout import chunks
from .meta import LoraTables


@dataclass
class StackedRows:
    """A few adapters' rows of one fused group, as pool row indices and the owner of each column.

    a_rows `[G * columns * chunks_in]`: module g's A row for column c spans entries
    `(g * columns + c) * chunks_in ...` (each an index into the K buffer's first axis). b_rows
    `[columns * sum(chunks_out)]`: module g's Bᵀ rows, `[columns * chunks_out_g]` indices into the V buffer, follow
    the modules before it. owner `[columns]`: the stack position (0 .. len(adapters) - 1) whose row a column
    holds, -1 for padding."""

    a_rows: torch.Tensor
    b_rows: torch.Tensor
    owner: torch.Tensor
    columns: int
    fan_in: int
    out_dims: tuple[int, ...]


def stack_rows(tables: LoraTables, adapters: list[int], modules: tuple[int, ...], fan_in: int,
               out_dims: tuple[int, ...], width: int, zero_slot: int, columns: int | None = None,
               device: torch.device | str = "cpu", widths: list[int] | None = None) -> StackedRows:
    """Index the rows of `adapters` (resident ids, in stack order) for `modules`. `tables` on the host.

    Adapter i takes widths[i] columns (default: its widest rank over the group's modules; a caller stacking
    every group the same way passes its widest rank over all modules, so one mask serves every group); a
    module it adapts at a lower rank, or not at all, reads `zero_slot` (a slot whose rows hold zeros) in the
    rest. `columns` (default: the widths summed) pads every module's block to the same width (a graph replays
    one width for any few adapters)."""
    if len(out_dims) != len(modules):
        raise ValueError(f"out_dims has {len(out_dims)} entries for {len(modules)} modules")
    ranks = tables.ranks.cpu()
    if widths is None:
        widths = [max(int(ranks[a, m]) for m in modules) for a in adapters]
    need = sum(widths)
    columns = need if columns is None else columns
    if columns < need:
        raise ValueError(f"columns={columns} cannot hold these adapters' rows side by side ({need} needed)")
    slots, a_off, b_off = tables.slots.cpu(), tables.a_off.cpu(), tables.b_off.cpu()
    cin = chunks(fan_in, width)
    a_rows = torch.full((len(modules), columns, cin), zero_slot, dtype=torch.int64)
    b_rows = [torch.full((columns, chunks(d, width)), zero_slot, dtype=torch.int64) for d in out_dims]
    owner = torch.full((columns,), -1, dtype=torch.int64)
    col = 0
    for pos, (a, width_a) in enumerate(zip(adapters, widths)):
        owner[col: col + width_a] = pos
        for g, m in enumerate(modules):
            r = int(ranks[a, m])
            if r > width_a:
                raise ValueError(f"adapter {a} has rank {r} for module {m}, wider than its {width_a} columns")
            if r == 0:
                continue
            a_rows[g, col: col + r] = slots[a, a_off[a, m]: a_off[a, m] + r * cin].long().view(r, cin)
            cout = b_rows[g].shape[1]
            b_rows[g][col: col + r] = slots[a, b_off[a, m]: b_off[a, m] + r * cout].long().view(r, cout)
        col += width_a
    return StackedRows(a_rows.reshape(-1).to(device), torch.cat([b.reshape(-1) for b in b_rows]).to(device),
                       owner.to(device), columns, fan_in, tuple(out_dims))


def stacked_positions(token_adapter: torch.Tensor, adapters: list[int]) -> torch.Tensor:
    """Each token's position in the stack (-1: base only, or an adapter not stacked)."""
    lookup = torch.full((int(max(adapters, default=-1)) + 2,), -1, dtype=torch.int32, device=token_adapter.device)
    if adapters:
        lookup[torch.tensor(adapters, device=token_adapter.device).long()] = torch.arange(
            len(adapters), dtype=torch.int32, device=token_adapter.device)
    # -1 (base only) indexes the last entry, which is -1; ids past the table are not stacked either.
    ids = token_adapter.long().clamp(max=lookup.shape[0] - 1)
    return lookup[ids]


def stack_mask(token_pos: torch.Tensor, owner: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[T, columns]`: 1 where a column holds the row of token t's adapter, else 0 (and 0 throughout for a
    token at position -1). Groups stacked with one layout share it: one mask a step."""
    return (token_pos.long()[:, None] == owner[None, :]).to(dtype)


def stack_views(a_flat: torch.Tensor, b_flat: torch.Tensor, rows: StackedRows
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A `[G * columns, fan_in]` and each module's Bᵀ `[columns, out_dim]` as views of the gathered rows: a_flat
    `[len(rows.a_rows), width]`, b_flat `[len(rows.b_rows), width]`."""
    width = a_flat.shape[1]
    a = a_flat.view(len(rows.out_dims) * rows.columns, -1)[:, :rows.fan_in]
    bts, row = [], 0
    for d in rows.out_dims:
        n = rows.columns * chunks(d, width)
        bts.append(b_flat[row: row + n].view(rows.columns, -1)[:, :d])
        row += n
    return a, bts


def gather_stack(k_buf: torch.Tensor, v_buf: torch.Tensor, rows: StackedRows, a_out: torch.Tensor | None = None,
                 b_out: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One layer's dense operands (stack_views), gathered from the pool's K and V buffers in one gather each,
    into `a_out` and `b_out` when given (rows as long as the index lists, the pool's width)."""
    if a_out is None or b_out is None:
        return stack_views(k_buf.index_select(0, rows.a_rows), v_buf.index_select(0, rows.b_rows), rows)
    torch.index_select(k_buf, 0, rows.a_rows, out=a_out)
    torch.index_select(v_buf, 0, rows.b_rows, out=b_out)
    return stack_views(a_out, b_out, rows)


def stacked_products(x: torch.Tensor, a: torch.Tensor, bts: list[torch.Tensor], keep: torch.Tensor,
                     out: torch.Tensor) -> None:
    """out[:, cols of module g] += ((x @ aᵀ) masked by `keep`)[:, block g] @ bts[g], in place."""
    groups, columns = len(bts), keep.shape[1]
    y = torch.mm(x, a.t())  # [T, G * columns]: every token against every stacked adapter
    y = y.view(x.shape[0], groups, columns).mul_(keep[:, None, :])
    col = 0
    for g, bt in enumerate(bts):
        out[:, col: col + bt.shape[1]].addmm_(y[:, g], bt)
        col += bt.shape[1]


def stacked_lora(x: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, keep: torch.Tensor, rows: StackedRows,
                 out: torch.Tensor) -> None:
    """out[t, cols of module g] += (x[t] @ A_gᵀ) @ (scaled B_g)ᵀ for the adapter whose columns `keep[t]` (from
    stack_mask) selects, in place. `out` is `[T, sum(out_dims)]`."""
    a, bts = gather_stack(k_buf, v_buf, rows)
    stacked_products(x, a, bts, keep, out)
