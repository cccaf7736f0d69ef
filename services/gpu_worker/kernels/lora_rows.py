"""Adapter rows in the pool, as the LoRA kernels see them, and the argument checks they share.

Row i of a module's A (in K buffers) or scaled Bᵀ (in V buffers) spans entries
`first + i * n_chunks ... + n_chunks - 1` of the adapter's slot list, `n_chunks = ceil(len / W)`; element c of
the row lives in slot `list[first + i * n_chunks + c // W]`, column `c % W` (see adapter_layout.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..ops.meta import LoraTables
from .checks import FLOAT_DTYPES, cdiv, check_tensor, next_pow2, require
from .launch_shapes import launch_shapes


@triton.jit
def load_adapter_tile(buf_ptr, stride_buf, list_ptr, first, rows, row_mask, c0, c_end, W, n_chunks,
                      BLOCK_C: tl.constexpr, ALIGNED: tl.constexpr, EVEN: tl.constexpr):
    """Tile `[rows, c0 : c0 + BLOCK_C]` of adapter rows; masked rows and columns >= c_end read as 0.

    ALIGNED (W % BLOCK_C == 0, c0 % BLOCK_C == 0): the tile never straddles a slot, so one slot id per row
    and contiguous, vectorisable columns. EVEN: every column of the tile is < c_end, so the mask is
    per row only and loads stay 16 bytes wide."""
    cols = tl.arange(0, BLOCK_C)
    entry = list_ptr + first + rows * n_chunks
    if EVEN:
        mask = row_mask[:, None]
    else:
        mask = row_mask[:, None] & ((c0 + cols) < c_end)[None, :]
    if ALIGNED:
        chunk = c0 // W
        col0 = tl.multiple_of(c0 - chunk * W, BLOCK_C)
        slot = tl.load(entry + chunk, mask=row_mask, other=0)
        offs = slot.to(tl.int64)[:, None] * stride_buf + col0 + cols[None, :]
    else:
        chunk = (c0 + cols) // W
        slot = tl.load(entry[:, None] + chunk[None, :], mask=mask, other=0)
        offs = slot.to(tl.int64) * stride_buf + (c0 + cols - chunk * W)[None, :]
    return tl.load(buf_ptr + offs, mask=mask, other=0.0)


@triton.jit
def segment_chunk(items_ptr, stride_items, pid_item, pid_chunk, HAS_ITEMS: tl.constexpr):
    """The (segment, chunk) a one-program-a-segment launch gives this program: from the chunk list when
    there is one (pid_item indexes it), else pid_item is the segment and pid_chunk the chunk. The caller
    passes its program ids: a launch may put the segments on any axis of its grid."""
    if HAS_ITEMS:
        s = tl.load(items_ptr + pid_item)
        chunk = tl.load(items_ptr + stride_items + pid_item)
    else:
        s = pid_item
        chunk = pid_chunk
    return s, chunk


@triton.jit
def segment_work(seg_start_ptr, seg_adapter_ptr, ranks_ptr, s, chunk, m, max_rank, chunk_tokens):
    """Segment s's adapter (0 for base-only, whose rank is 0), its rank for module m, and the positions of
    its token chunk `chunk`."""
    a = tl.load(seg_adapter_ptr + s)
    a_safe = tl.maximum(a, 0)
    rank = tl.where(a >= 0, tl.minimum(tl.load(ranks_ptr + a_safe * 7 + m), max_rank), 0)
    seg_end = tl.load(seg_start_ptr + s + 1)
    p_lo = tl.load(seg_start_ptr + s) + chunk * chunk_tokens
    p_hi = tl.minimum(seg_end, p_lo + chunk_tokens)
    return a_safe, rank, p_lo, p_hi


@triton.jit
def busy_segments(seg_start_ptr, seg_adapter_ptr, ranks_ptr, n_seg, m, max_rank, SEG_BLOCK: tl.constexpr):
    """segment_work for the first n_seg (<= SEG_BLOCK) segments at once, as vectors: what a program that is
    dealt tiles (shrink's and expand's DEAL) reads once. Returns the index vector, the bounds, the adapters
    and the ranks."""
    idx = tl.arange(0, SEG_BLOCK)
    busy = idx < n_seg
    lo = tl.load(seg_start_ptr + idx, mask=busy, other=0)
    hi = tl.load(seg_start_ptr + idx + 1, mask=busy, other=0)
    adapter = tl.load(seg_adapter_ptr + idx, mask=busy, other=-1)
    rank = tl.load(ranks_ptr + tl.maximum(adapter, 0) * 7 + m, mask=busy & (adapter >= 0), other=0)
    return idx, lo, hi, tl.maximum(adapter, 0), tl.minimum(rank, max_rank)


@triton.jit
def dealt_tile(idx, lo, hi, height, tiles, ends, t):
    """Tile t of the busy segments' tiles numbered in segment order (segment i has tiles[i] of height[i] rows,
    ends[i] = tiles[0] + ... + tiles[i]): a mask over idx picking its segment, its positions and its height.
    Program i of P is dealt tiles i, i + P, ... : a long segment spreads over the programs instead of keeping
    one busy through all its tiles."""
    pick = idx == tl.sum((ends <= t).to(tl.int32), axis=0)
    h = tl.sum(tl.where(pick, height, 0), axis=0)
    p_lo = tl.sum(tl.where(pick, lo, 0), axis=0) + (t - tl.sum(tl.where(pick, ends - tiles, 0), axis=0)) * h
    return pick, p_lo, tl.minimum(tl.sum(tl.where(pick, hi, 0), axis=0), p_lo + h), h


@triton.jit
def module_slot(g, V0, V1, V2):
    """Per-module scalar of a fused group of up to three modules (q,k,v or gate,up)."""
    return tl.where(g == 0, V0, tl.where(g == 1, V1, V2))


def check_tables(tables: LoraTables, device: torch.device) -> None:
    check_tensor("tables.slots", tables.slots, ndim=2, dtypes=(torch.int32,), device=device)
    for name in ("ranks", "a_off", "b_off"):
        t = getattr(tables, name)
        check_tensor(f"tables.{name}", t, ndim=2, dtypes=(torch.int32,), device=device, contiguous=True)
        if t.shape != (tables.slots.shape[0], 7):
            raise ValueError(f"tables.{name} must be [max_resident={tables.slots.shape[0]}, 7], got {tuple(t.shape)}")


def check_pool_buffer(name: str, buf: torch.Tensor, device: torch.device) -> None:
    check_tensor(name, buf, ndim=2, dtypes=FLOAT_DTYPES, device=device)


def planned_segments(segments: int, live_segments: int | None, segment_programs: int) -> int:
    """Segments a launch plan counts as work: at most `live_segments` of them carry tokens (a CUDA graph's
    one segment per token is only a bound), and at most `segment_programs` programs take them on."""
    if live_segments is not None:
        segments = max(1, min(segments, live_segments))
    return min(segments, segment_programs) if segment_programs > 0 else segments


def few_adapter_graph(max_seg_len: int | None, live_segments: int | None, segment_programs: int) -> bool:
    """Whether a segment-form launch is a decode graph's under the few-adapter plan (cuda_graphs.py): its
    segment lengths unknown to the host, at most `live_segments` of them busy, shared out among
    `segment_programs` programs."""
    return max_seg_len is None and live_segments is not None and segment_programs > 0


def segment_programs_of(num_segments: int, segment_programs: int, num_live,
                        device: torch.device) -> tuple[int, bool]:
    """Programs along the segment axis of a segment-form launch, and whether they share the segments out
    (fewer programs than segments; otherwise one program a segment and the count on the device unused)."""
    programs = max(1, min(num_segments, segment_programs) if segment_programs > 0 else num_segments)
    shared = programs < num_segments
    if shared and num_live is not None:
        check_tensor("num_live", num_live, ndim=1, dtypes=(torch.int32,), device=device)
    return programs, shared


def segment_launch(seg_programs: int, longest: int, chunk: int, shared: bool, chunk_items,
                   device: torch.device) -> tuple[int, int, torch.Tensor | None]:
    """The segment and chunk axes of a segment-form launch (programs along each; seg_programs from
    segment_programs_of), and the chunk list it reads (None: every segment gets the longest one's chunk
    count). A chunk list of this launch's chunk size replaces the two axes with one program per chunk that
    holds tokens; launches that share segments out among fewer programs (a CUDA graph's) ignore it."""
    if chunk_items is not None and not shared and chunk_items.chunk_tokens == chunk and chunk_items.count > 0:
        check_tensor("chunk_items.table", chunk_items.table, ndim=2, dtypes=(torch.int32,), device=device,
                     contiguous=True)
        require(chunk_items.table.shape[0] == 2, "chunk_items.table must be [2, N]")
        return chunk_items.count, 1, chunk_items.table
    n_seq_chunks = max(1, cdiv(longest, chunk))
    if n_seq_chunks > 65535:
        raise ValueError(f"max_seg_len {longest} needs {n_seq_chunks} token chunks; at most 65535")
    return seg_programs, n_seq_chunks, None


@dataclass(frozen=True)
class SegmentForm:
    """What a segment-form launch of shrink or expand takes beyond its own arguments: the segment and chunk
    axes of its grid, tokens per program, programs sharing the segments, the segment tensors in the kernels'
    order (a stand-in where one is absent), and their constexprs."""

    axis: int
    chunks: int
    chunk: int
    programs: int
    args: tuple
    constexprs: dict


def segment_form(cfg, num_tokens: int, max_seg_len: int | None, seg_start: torch.Tensor, seg_adapter: torch.Tensor,
                 token_order: torch.Tensor | None, num_live: torch.Tensor | None, chunk_items, dtype: torch.dtype,
                 device: torch.device) -> SegmentForm:
    """`cfg`: a ShrinkConfig or ExpandConfig (chunk_tokens, segment_programs, block_m)."""
    longest = max_seg_len if max_seg_len is not None else num_tokens
    chunk = cfg.chunk_tokens if cfg.chunk_tokens > 0 else max(longest, 1)
    programs, shared = segment_programs_of(seg_adapter.shape[0], cfg.segment_programs, num_live, device)
    axis, chunks, items = segment_launch(programs, longest, chunk, shared, chunk_items, device)
    args = (seg_start, seg_adapter, token_order if token_order is not None else seg_start,
            num_live if num_live is not None else seg_start, items if items is not None else seg_start,
            items.stride(0) if items is not None else 0)
    constexprs = dict(BLOCK_M=cfg.block_m, HAS_ORDER=token_order is not None, HAS_LIVE=shared and num_live is not None,
                      SHARED=shared, HAS_ITEMS=items is not None,
                      PRECISION="ieee" if dtype == torch.float32 else "tf32")
    return SegmentForm(axis, chunks, chunk, programs, args, constexprs)


def deal_constexprs(cfg, form: SegmentForm, live_segments: int | None, num_segments: int) -> dict:
    """DEAL and SEG_BLOCK of a segment-form launch (`cfg.deal_tiles`, a ShrinkConfig or ExpandConfig): programs
    that share the segments out are dealt their tiles, reading the busy segments' bounds as vectors of
    SEG_BLOCK (a graph's bound on its busy segments; more busy segments on the device fall back to the walk).
    One program a segment has nothing to deal."""
    deal = cfg.deal_tiles and form.constexprs["SHARED"]
    if deal:
        require(form.chunks == 1, f"deal_tiles deals whole segments' tiles; chunk_tokens {cfg.chunk_tokens} cuts "
                                  f"them into {form.chunks} chunks")
    # Dealing pays where few segments are long (an H100: 14% off the four groups' LoRA at batch 512 over 5
    # adapters) and costs where many are short (5-10% at 12 and 32, where the walk keeps the programs busy;
    # docs/benchmarks.md, 2026-12-05 22:44): the vectors hold at most kernel_shapes' graph_few_deal_max segments,
    # and a step with more busy walks.
    cap = launch_shapes().graph_few_deal_max or 1024
    return dict(DEAL=deal, SEG_BLOCK=next_pow2(min(live_segments or num_segments, cap, 1024)) if deal else 1)


def check_segments(num_tokens: int, device: torch.device, seg_start, seg_adapter, token_order) -> None:
    """Segment form: runs of (sorted) token positions sharing one adapter; optional token_order maps a
    sorted position to its token. Segments must cover positions 0..T-1 (empty ones are allowed)."""
    require(seg_adapter is not None, "seg_start was given without seg_adapter")
    check_tensor("seg_start", seg_start, ndim=1, dtypes=(torch.int32,), device=device, contiguous=True)
    check_tensor("seg_adapter", seg_adapter, ndim=1, dtypes=(torch.int32,), device=device, contiguous=True)
    if seg_start.shape[0] != seg_adapter.shape[0] + 1:
        raise ValueError(f"seg_start must have one entry more than seg_adapter, got {seg_start.shape[0]} and "
                         f"{seg_adapter.shape[0]}")
    if token_order is not None:
        check_tensor("token_order", token_order, ndim=1, dtypes=(torch.int32,), device=device, contiguous=True)
        if token_order.shape[0] != num_tokens:
            raise ValueError(f"token_order must have one entry per token ({num_tokens}), got {token_order.shape[0]}")
