"""Lay an adapter out in the pool's row format.

Each adapted module m with rank r contributes r rows of A (length in_m) and r rows of Bᵀ (length out_m).
A row of length L spans ceil(L / slot_width) consecutive entries of the adapter's slot list. A rows are
packed one after another into K buffers and Bᵀ rows into V buffers, independently, so the adapter
needs max(total A chunks, total B chunks) slots: the least waste for modules whose in and out differ
(k/v under GQA, gate/up/down).

The LoRA scale is folded into Bᵀ when packing: per-layer `rank_pattern`/`alpha_pattern` then need no
per-layer table, and expand does one multiply less. Layers where a module has a lower rank than its
maximum (rank_pattern by layer) get zero rows, which contribute exactly nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.lora_weights import LoraWeights
from shared.model_config import MODULES, ModelConfig


def chunks(length: int, slot_width: int) -> int:
    return -(-length // slot_width)


@dataclass
class PackedAdapter:
    """An adapter in pool row format; this is what the host arena holds and what one copy moves."""

    name: str
    rows: torch.Tensor  # [num_layers, 2, n_slots, slot_width]: [:, 0] A chunks, [:, 1] scaled Bᵀ chunks
    ranks: tuple[int, ...]  # per MODULES entry; 0 = module not adapted
    a_off: tuple[int, ...]  # first entry of the module's A rows in the adapter's slot list
    b_off: tuple[int, ...]  # first entry of the module's Bᵀ rows in the adapter's slot list

    @property
    def n_slots(self) -> int:
        return int(self.rows.shape[2])

    @property
    def max_rank(self) -> int:
        return max(self.ranks)

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()


def layout_offsets(ranks: tuple[int, ...], cfg: ModelConfig, slot_width: int) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """Offsets of each module's A and Bᵀ rows in the slot list, and the number of slots needed."""
    a_off, b_off = [], []
    a_next = b_next = 0
    for m, r in zip(MODULES, ranks):
        fan_in, fan_out = cfg.module_dims(m)
        a_off.append(a_next)
        b_off.append(b_next)
        a_next += r * chunks(fan_in, slot_width)
        b_next += r * chunks(fan_out, slot_width)
    return tuple(a_off), tuple(b_off), max(a_next, b_next, 1)


def lora_read_bytes(ranks: tuple[int, ...], cfg: ModelConfig, itemsize: int) -> int:
    """Bytes of A and Bᵀ a step's shrink and expand read for one adapter over all layers: its rank's rows at
    their true lengths, not the slot chunks they are packed in (the pool's padding is never read)."""
    return cfg.num_layers * itemsize * sum(r * sum(cfg.module_dims(m)) for m, r in zip(MODULES, ranks))


def _exact_source(t: torch.Tensor) -> torch.Tensor:
    """float64 goes through fp32 first, as it always has; narrower dtypes convert exactly either way."""
    return t.float() if t.dtype == torch.float64 else t


def packed_nbytes(ranks: tuple[int, ...], cfg: ModelConfig, slot_width: int, dtype: torch.dtype) -> int:
    """Bytes of the rows of an adapter with these module ranks."""
    return cfg.num_layers * 2 * layout_offsets(ranks, cfg, slot_width)[2] * slot_width * dtype.itemsize


def pack_adapter(weights: LoraWeights, cfg: ModelConfig, slot_width: int, dtype: torch.dtype = torch.float32,
                 out: torch.Tensor | None = None) -> PackedAdapter:
    """`out`: bytes to lay the rows into (e.g. a range of the host arena), exactly `packed_nbytes` long."""
    ranks = tuple(weights.module_rank(m) for m in MODULES)
    a_off, b_off, n_slots = layout_offsets(ranks, cfg, slot_width)
    shape = (cfg.num_layers, 2, n_slots, slot_width)
    if out is None:
        rows = torch.zeros(shape, dtype=dtype)
    else:
        need = packed_nbytes(ranks, cfg, slot_width, dtype)
        if out.dtype != torch.uint8 or out.numel() != need:
            raise ValueError(f"out holds {out.numel()} {out.dtype} values; the rows need {need} bytes")
        rows = out.view(dtype).view(shape)
        rows.zero_()
    for mi, m in enumerate(MODULES):
        r = ranks[mi]
        if r == 0:
            continue
        fan_in, fan_out = cfg.module_dims(m)
        ci, co = chunks(fan_in, slot_width), chunks(fan_out, slot_width)
        for layer, w in enumerate(weights.modules[m]):
            if w is None:
                continue
            lr = w.rank
            # Written straight into the rows (a store packs every adapter it loads from disk, up to 134 MB
            # at S2): each value is rounded to `dtype` once, from its own dtype or from the fp32 product
            # with the scale, exactly as through fp32 copies of the whole padded block.
            a_rows = rows[layer, 0, a_off[mi]: a_off[mi] + r * ci].view(r, ci * slot_width)
            a_rows[:lr, :fan_in].copy_(_exact_source(w.lora_a))
            b_rows = rows[layer, 1, b_off[mi]: b_off[mi] + r * co].view(r, co * slot_width)[:lr, :fan_out]
            if w.lora_b.dtype == dtype:
                # Transposed in its own dtype (a converting transposed copy is ~50x slower), then scaled in
                # place: the multiply runs in fp32 and rounds once, as from an fp32 copy.
                b_rows.copy_(w.lora_b.t())
                if w.scale != 1.0:
                    b_rows.mul_(w.scale)
            else:
                b_rows.copy_((w.lora_b.float() * w.scale).t())
    return PackedAdapter(weights.name, rows, ranks, a_off, b_off)
