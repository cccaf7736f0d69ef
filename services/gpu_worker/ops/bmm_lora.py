"""The bmm baseline's LoRA ops (S-LoRA-bmm): same signatures and results as `reference.lora_shrink` /
`lora_expand`, computed the way a padded-batch server does it.

Every call copies each token's adapter rows out of the pool into a contiguous buffer `[T, R, len]` padded
with zeros to R = the step's max rank (the shrink width), then runs one `torch.bmm`. The copies and the
padding are the cost this baseline exists to measure; the unified kernels read rows in place at each
adapter's own rank. Shapes depend only on T, R and the module sizes, and no value is read back to the
host, so the ops also run inside captured CUDA decode graphs (R is then the graph's rank bucket).

Tokens are processed in chunks so the gathered buffer stays under GATHER_ELEMENTS elements: a long
prefill at a high rank would otherwise need gigabytes for one module.
"""
from __future__ import annotations

from types import ModuleType

import torch

from .meta import LoraTables

GATHER_ELEMENTS = 1 << 26


def _chunks(num_tokens: int, row_elements: int):
    step = max(1, GATHER_ELEMENTS // max(1, row_elements))
    for start in range(0, num_tokens, step):
        yield start, min(num_tokens, start + step)


def _padded_rows(buf: torch.Tensor, tables: LoraTables, adapter: torch.Tensor, offsets: torch.Tensor, module: int,
                 rank: int, length: int) -> torch.Tensor:
    """`[T, rank, ceil(length / W) * W]`: for each token, rows 0 .. rank-1 of its adapter's A (or Bᵀ) for
    `module`, gathered from the pool; rows past the adapter's rank, and every row of base-only tokens
    (adapter -1), are zero."""
    width = buf.shape[1]
    n_chunks = -(-length // width)
    safe = adapter.clamp(min=0).long()
    lists = tables.slots.index_select(0, safe)  # [T, max_slots]: each token's slot list
    first = offsets.index_select(0, safe)[:, module].long()  # [T]
    entry = (torch.arange(rank, device=buf.device) * n_chunks)[:, None] + torch.arange(n_chunks, device=buf.device)
    index = (first[:, None] + entry.reshape(1, -1)).clamp(max=lists.shape[1] - 1)
    slots = torch.gather(lists, 1, index).long()  # [T, rank * n_chunks]
    rows = buf[slots].reshape(adapter.shape[0], rank, n_chunks * width)
    ranks = tables.ranks.index_select(0, safe)[:, module]
    valid = (torch.arange(rank, device=buf.device)[None, :] < ranks[:, None]) & (adapter[:, None] >= 0)
    # Entries past an adapter's rank point at other requests' slots (or stale ids): zero them, the padding.
    return rows.masked_fill_(~valid[:, :, None], 0)


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    # Half-precision bmm on GPUs accumulates in fp32 already; CPUs get fp32 for speed and the same sums.
    return t.dtype if t.device.type == "cuda" else torch.float32


def lora_shrink(x: torch.Tensor, k_buf: torch.Tensor, token_adapter: torch.Tensor, tables: LoraTables,
                modules: tuple[int, ...], max_rank: int, **launch_hints) -> torch.Tensor:
    """y[g, t, :r] = x[t] @ A_gᵀ for token t's adapter, zero past its rank and for base-only tokens;
    `[len(modules), T, max_rank]` in x's dtype. Hints for the paged kernels are ignored."""
    num_tokens, fan_in = x.shape
    width = k_buf.shape[1]
    padded_in = -(-fan_in // width) * width
    dtype = _compute_dtype(x)
    # Zero columns past fan_in meet the zero padding of the A rows' last slot.
    xp = torch.nn.functional.pad(x, (0, padded_in - fan_in)).to(dtype)
    y = torch.empty(len(modules), num_tokens, max_rank, dtype=x.dtype, device=x.device)
    for g, m in enumerate(modules):
        for s, e in _chunks(num_tokens, max_rank * padded_in):
            a = _padded_rows(k_buf, tables, token_adapter[s:e], tables.a_off, m, max_rank, fan_in).to(dtype)
            y[g, s:e] = torch.bmm(xp[s:e, None, :], a.transpose(1, 2))[:, 0].to(x.dtype)
    return y


def lora_expand(y: torch.Tensor, v_buf: torch.Tensor, token_adapter: torch.Tensor, tables: LoraTables,
                modules: tuple[int, ...], out: torch.Tensor, out_dims: tuple[int, ...], **launch_hints) -> None:
    """out[t, cols of module g] += y[g, t, :r] @ (scaled B_g)ᵀ in place, as `reference.lora_expand`."""
    num_tokens = y.shape[1]
    rank = y.shape[2]
    width = v_buf.shape[1]
    dtype = _compute_dtype(out)
    col = 0
    for g, (m, fan_out) in enumerate(zip(modules, out_dims)):
        padded_out = -(-fan_out // width) * width
        for s, e in _chunks(num_tokens, rank * padded_out):
            bt = _padded_rows(v_buf, tables, token_adapter[s:e], tables.b_off, m, rank, fan_out).to(dtype)
            delta = torch.bmm(y[g, s:e, None, :].to(dtype), bt)[:, 0, :fan_out]
            out[s:e, col: col + fan_out] += delta.to(out.dtype)
        col += fan_out


def with_bmm_lora(base: ModuleType) -> ModuleType:
    """`base`'s ops (attention, norms, ...) with the LoRA ops swapped for these; no per-step LoRA
    preparation (the paged kernels' token grouping) is left to run."""
    ops = ModuleType(f"{base.__name__}+bmm_lora", base.__doc__)
    for name, value in vars(base).items():
        if not name.startswith("__") and name != "prepare_lora":
            setattr(ops, name, value)
    ops.lora_shrink = lora_shrink
    ops.lora_expand = lora_expand
    return ops
