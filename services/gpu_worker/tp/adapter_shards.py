"""Pack one rank's share of an adapter in the pool row format of its pool shard.

Input is the adapter in the single-GPU row format (`PackedAdapter` at slot width = the full model's kv_dim,
what the host arena holds and `pack_adapter` makes), so the store and the arena know nothing about TP; each
rank's share is cut from it:

- column-parallel q, k, v, gate, up: A rows are dealt round-robin, row k to rank k % N (local row k // N);
  every rank reserves ceil(r/N) rows so that the layout is the same on all ranks (an r not divisible by N
  leaves one zero row on some ranks). All-gathering the ranks' (T, ceil(r/N)) shrink outputs then rebuilds
  the (T, r) shrink output by a plain interleave, whatever mix of ranks the batch holds. Bᵀ keeps all r rows
  over this rank's output features.
- row-parallel o, down: A keeps all r rows over this rank's input features (its shrink output is a partial
  sum); Bᵀ keeps all r rows over this rank's slice of the hidden features.

Every weight element lands on exactly one rank: nothing is replicated. Offsets and slot counts depend only on
the adapter's ranks and the layout, never on the rank, so one slot list and one table row serve every rank.
"""
from __future__ import annotations

import torch

from shared.lora_weights import LoraWeights
from shared.model_config import MODULES, ModelConfig

from ..adapter_layout import PackedAdapter, chunks, pack_adapter
from .layout import COLUMN_MODULES, TPLayout


def shard_offsets(ranks: tuple[int, ...], layout: TPLayout) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """Offsets of each module's A and Bᵀ rows in a rank's slot list, and the slots an adapter needs (the same
    on every rank). The TP counterpart of `adapter_layout.layout_offsets`."""
    width = layout.slot_width
    a_off, b_off = [], []
    a_next = b_next = 0
    for m, r in zip(MODULES, ranks):
        a_len, b_len = layout.shard_row_lengths(m)
        a_off.append(a_next)
        b_off.append(b_next)
        a_next += layout.shrink_rank(m, r) * chunks(a_len, width)
        b_next += r * chunks(b_len, width)
    return tuple(a_off), tuple(b_off), max(a_next, b_next, 1)


def module_factors(packed: PackedAdapter, cfg: ModelConfig, module: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A `[L, r, in]` and scaled Bᵀ `[L, r, out]` of one module, read back from single-GPU row format."""
    mi = MODULES.index(module)
    r = packed.ranks[mi]
    fan_in, fan_out = cfg.module_dims(module)
    num_layers, _, _, width = packed.rows.shape
    ci, co = chunks(fan_in, width), chunks(fan_out, width)
    a = packed.rows[:, 0, packed.a_off[mi]: packed.a_off[mi] + r * ci].reshape(num_layers, r, ci * width)
    bt = packed.rows[:, 1, packed.b_off[mi]: packed.b_off[mi] + r * co].reshape(num_layers, r, co * width)
    return a[..., :fan_in], bt[..., :fan_out]


def _place(dst: torch.Tensor, off: int, rows: int, mat: torch.Tensor) -> None:
    """Write `mat` `[L, n <= rows, length]` as `rows` chunked rows starting at entry `off` of `dst` `[L, S, W]`."""
    num_layers, _, width = dst.shape
    per_row = chunks(mat.shape[2], width)
    block = torch.zeros(num_layers, rows, per_row * width, dtype=dst.dtype)
    block[:, :mat.shape[1], :mat.shape[2]] = mat
    dst[:, off: off + rows * per_row] = block.view(num_layers, rows * per_row, width)


def shard_packed(packed: PackedAdapter, layout: TPLayout, dtype: torch.dtype | None = None) -> list[PackedAdapter]:
    """The adapter's share for every rank, rank order. `packed` is in single-GPU row format for
    `layout.cfg` (any slot width); shards are in `dtype` (default: packed's) at the layout's slot width."""
    cfg, n = layout.cfg, layout.size
    dtype = dtype or packed.rows.dtype
    a_off, b_off, n_slots = shard_offsets(packed.ranks, layout)
    num_layers = packed.rows.shape[0]
    rows = [torch.zeros(num_layers, 2, n_slots, layout.slot_width, dtype=dtype) for _ in range(n)]
    for mi, m in enumerate(MODULES):
        r = packed.ranks[mi]
        if r == 0:
            continue
        a, bt = module_factors(packed, cfg, m)
        for rank in range(n):
            if m in COLUMN_MODULES:
                a_part, bt_part = a[:, rank::n], bt[..., layout.output_cols(m, rank)]
            else:
                a_part, bt_part = a[..., layout.input_cols(m, rank)], bt[..., layout.hidden_cols(rank)]
            _place(rows[rank][:, 0], a_off[mi], layout.shrink_rank(m, r), a_part)
            _place(rows[rank][:, 1], b_off[mi], r, bt_part)
    return [PackedAdapter(packed.name, rows[rank], packed.ranks, a_off, b_off) for rank in range(n)]


def shard_adapter(weights: LoraWeights, layout: TPLayout, dtype: torch.dtype = torch.float32) -> list[PackedAdapter]:
    """Every rank's share of an in-memory adapter (packed once in fp32, then cut)."""
    full = pack_adapter(weights, layout.cfg, layout.cfg.kv_dim, torch.float32)
    return shard_packed(full, layout, dtype)
