"""LoRA shrink on the unified pool: y[g, t, :r] = x[t] @ A_gᵀ for token t's adapter, every module g of a
fused group (q,k,v or gate,up) in one launch, ranks 1..256 mixed in one batch, no padded weights.

Two forms over the same row addressing (lora_rows.py):
- per token (decode, MBGMV): one program per (token, module, rank tile, K split); a GEMV on CUDA cores.
- segment (prefill, or decode after grouping tokens by adapter, MBGMM): one program per (segment, token
  chunk, module, rank tile, K split); tiles of tokens sharing an adapter go through tl.dot, so each
  adapter row is read from memory once per step however many of its tokens are in the batch.
At decode the work is reading adapter rows and x is tiny, so the input dimension is split (split-K) to give
every multiprocessor rows to stream; the fp32 partial sums go to a small workspace that a second launch
reduces in a fixed order (deterministic, no atomics). Base-only tokens (adapter -1) and rank-0 modules
read no adapter rows; they only get their zeros written.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..ops.meta import LoraTables
from .checks import FLOAT_DTYPES, cdiv, check_modules, check_tensor, next_pow2, num_sms, pad3, pow2_divisor
from .compiled_launch import CompiledLaunch
from .launch_shapes import launch_shapes
from .lora_groups import PREFILL_CHUNK_TOKENS, full_on_average, long_on_average
from .lora_rows import (
    busy_segments, check_pool_buffer, check_segments, check_tables, deal_constexprs, dealt_tile, few_adapter_graph,
    load_adapter_tile, module_slot, planned_segments, segment_chunk, segment_form, segment_work,
)


# Triton compiles a kernel again for each new combination of its int arguments' "is 1" and "divisible by
# 16" properties. Token counts, batch ranks, input splits, chunk lengths and segment counts change from
# step to step, so each new combination cost a compile (~1 s, in a step every running request waits for)
# the first time traffic met it. They are left unspecialised, and so is y's stride between modules
# (tokens x rank): it only places a row of at most a few hundred bytes, whose stores gain little from a
# known alignment.
@triton.jit
def _store_shrink(acc, out_ptr, g, t, rows, rank, max_rank, n_split, split, num_groups, num_tokens, rows_p,
                  stride_og, stride_ot, SPLIT: tl.constexpr):
    """SPLIT: fp32 partial into workspace [n_split, G, T, rows_p] (rows < rank only; the finalize pass
    masks the rest). Otherwise the finished row into y, zeros included, so y needs no memset."""
    if SPLIT:
        base = ((split * num_groups + g) * num_tokens + t).to(tl.int64) * rows_p
        tl.store(out_ptr + base + rows, acc, mask=rows < rank)
    else:
        base = g.to(tl.int64) * stride_og + t.to(tl.int64) * stride_ot
        tl.store(out_ptr + base + rows, acc.to(out_ptr.dtype.element_ty), mask=rows < max_rank)


@triton.jit(do_not_specialize=["stride_og", "num_tokens", "max_rank", "n_split"])
def _shrink_token_kernel(
    x_ptr, stride_xt, buf_ptr, stride_buf, token_adapter_ptr,
    slots_ptr, stride_slots, ranks_ptr, a_off_ptr,
    out_ptr, stride_og, stride_ot,
    num_tokens, fan_in, W, n_chunks, max_rank, k_per_split, n_split, rows_p,
    M0, M1, M2,
    NUM_GROUPS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ALIGNED: tl.constexpr, EVEN: tl.constexpr, SPLIT: tl.constexpr,
):
    t = tl.program_id(0)
    g = tl.program_id(1)
    r_tile = tl.program_id(2) // n_split
    split = tl.program_id(2) % n_split
    m = module_slot(g, M0, M1, M2)
    a = tl.load(token_adapter_ptr + t)
    a_safe = tl.maximum(a, 0)
    rank = tl.load(ranks_ptr + a_safe * 7 + m)
    rank = tl.where(a >= 0, tl.minimum(rank, max_rank), 0)
    rows = r_tile * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < rank
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    if r_tile * BLOCK_R < rank:
        first = tl.load(a_off_ptr + a_safe * 7 + m)
        list_ptr = slots_ptr + a_safe.to(tl.int64) * stride_slots
        x_row = x_ptr + t.to(tl.int64) * stride_xt
        k_lo = split * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, fan_in)
        if ALIGNED:
            # Slot of each row once per slot-wide chunk, not per tile: the inner loop's loads then depend
            # on no other load.
            cols = tl.arange(0, BLOCK_K)
            entry = list_ptr + first + rows * n_chunks
            for c in range(k_lo // W, (k_hi - 1) // W + 1):
                slot = tl.load(entry + c, mask=row_mask, other=0)
                row_ptr = buf_ptr + slot.to(tl.int64)[:, None] * stride_buf + cols[None, :]
                for k0 in range(tl.maximum(k_lo, c * W), tl.minimum(k_hi, c * W + W), BLOCK_K):
                    ks = k0 + cols
                    off = tl.multiple_of(k0 - c * W, BLOCK_K)
                    if EVEN:
                        xv = tl.load(x_row + ks)
                        w = tl.load(row_ptr + off, mask=row_mask[:, None], other=0.0)
                    else:
                        xv = tl.load(x_row + ks, mask=ks < k_hi, other=0.0)
                        w = tl.load(row_ptr + off, mask=row_mask[:, None] & (ks < k_hi)[None, :], other=0.0)
                    acc += tl.sum(w.to(tl.float32) * xv.to(tl.float32)[None, :], axis=1)
        else:
            for k0 in range(k_lo, k_hi, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                if EVEN:
                    xv = tl.load(x_row + ks)
                else:
                    xv = tl.load(x_row + ks, mask=ks < k_hi, other=0.0)
                w = load_adapter_tile(buf_ptr, stride_buf, list_ptr, first, rows, row_mask, k0, k_hi, W, n_chunks,
                                      BLOCK_K, ALIGNED, EVEN)
                acc += tl.sum(w.to(tl.float32) * xv.to(tl.float32)[None, :], axis=1)
    _store_shrink(acc, out_ptr, g, t, rows, rank, max_rank, n_split, split, NUM_GROUPS, num_tokens, rows_p,
                  stride_og, stride_ot, SPLIT)


# stride_items: the step's chunk-item count, not specialized (as in lora_expand's segment kernel).
@triton.jit(do_not_specialize=["stride_og", "num_tokens", "max_rank", "n_split", "chunk_tokens", "n_r_tiles",
                               "num_segments", "seg_programs", "stride_items"])
def _shrink_segment_kernel(
    x_ptr, stride_xt, buf_ptr, stride_buf, seg_start_ptr, seg_adapter_ptr, order_ptr, live_ptr,
    items_ptr, stride_items, slots_ptr, stride_slots, ranks_ptr, a_off_ptr,
    out_ptr, stride_og, stride_ot,
    num_tokens, fan_in, W, n_chunks, max_rank, k_per_split, n_split, rows_p, chunk_tokens, n_r_tiles,
    num_segments, seg_programs, long_from,
    M0, M1, M2,
    NUM_GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ALIGNED: tl.constexpr, EVEN: tl.constexpr, SPLIT: tl.constexpr, HAS_ORDER: tl.constexpr,
    HAS_LIVE: tl.constexpr, SHARED: tl.constexpr, HAS_ITEMS: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M_LONG: tl.constexpr, DEAL: tl.constexpr, SEG_BLOCK: tl.constexpr,
):
    pid = tl.program_id(2)
    split = pid % n_split
    r_tile = (pid // n_split) % n_r_tiles
    g = pid // (n_split * n_r_tiles)
    m = module_slot(g, M0, M1, M2)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, fan_in)
    if SHARED:
        # Up to the segments in use (all of them without a count on the device). A constexpr branch, so the
        # one-segment-a-program launch keeps its registers; dealt tiles as far as the vectors hold the busy
        # segments, else the walk (as in the expand kernel).
        n_seg = num_segments
        if HAS_LIVE:
            n_seg = tl.load(live_ptr)
        walk = True
        if DEAL:
            walk = n_seg > SEG_BLOCK
            if not walk:
                _shrink_dealt(x_ptr, stride_xt, buf_ptr, stride_buf, seg_start_ptr, seg_adapter_ptr, order_ptr,
                              slots_ptr, stride_slots, ranks_ptr, a_off_ptr, out_ptr, stride_og, stride_ot,
                              num_tokens, W, n_chunks, max_rank, rows_p, n_seg, seg_programs, split, g, m, r_tile,
                              k_lo, k_hi, long_from, NUM_GROUPS, BLOCK_M, BLOCK_R, BLOCK_K, ALIGNED, EVEN, SPLIT,
                              HAS_ORDER, PRECISION, BLOCK_M_LONG, SEG_BLOCK)
        if walk:
            _shrink_walked(x_ptr, stride_xt, buf_ptr, stride_buf, seg_start_ptr, seg_adapter_ptr, order_ptr,
                           slots_ptr, stride_slots, ranks_ptr, a_off_ptr, out_ptr, stride_og, stride_ot,
                           num_tokens, W, n_chunks, max_rank, rows_p, chunk_tokens, n_seg, seg_programs, split,
                           g, m, r_tile, k_lo, k_hi, long_from, NUM_GROUPS, BLOCK_M, BLOCK_R, BLOCK_K, ALIGNED,
                           EVEN, SPLIT, HAS_ORDER, PRECISION, BLOCK_M_LONG)
    else:
        s, chunk = segment_chunk(items_ptr, stride_items, tl.program_id(0), tl.program_id(1), HAS_ITEMS)
        a, rank, p_lo, p_hi = segment_work(seg_start_ptr, seg_adapter_ptr, ranks_ptr, s, chunk, m, max_rank,
                                           chunk_tokens)
        _shrink_segment(x_ptr, stride_xt, buf_ptr, stride_buf, order_ptr, slots_ptr, stride_slots, a_off_ptr,
                        out_ptr, stride_og, stride_ot, num_tokens, W, n_chunks, max_rank, rows_p, a, rank, p_lo, p_hi,
                        p_hi - p_lo > long_from, split, g, m, r_tile, k_lo, k_hi, NUM_GROUPS, BLOCK_M, BLOCK_R,
                        BLOCK_K, ALIGNED, EVEN, SPLIT, HAS_ORDER, PRECISION, BLOCK_M_LONG)


@triton.jit
def _shrink_walked(
    x_ptr, stride_xt, buf_ptr, stride_buf, seg_start_ptr, seg_adapter_ptr, order_ptr,
    slots_ptr, stride_slots, ranks_ptr, a_off_ptr, out_ptr, stride_og, stride_ot,
    num_tokens, W, n_chunks, max_rank, rows_p, chunk_tokens, n_seg, seg_programs, split, g, m, r_tile, k_lo, k_hi,
    long_from,
    NUM_GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ALIGNED: tl.constexpr, EVEN: tl.constexpr, SPLIT: tl.constexpr, HAS_ORDER: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M_LONG: tl.constexpr,
):
    """Program i of seg_programs walks segments i, i + seg_programs, ... whole (their chunk on the grid's
    second axis): fewer programs than segments leave no empty ones for a graph's unused segments."""
    for s in range(tl.program_id(0), n_seg, seg_programs):
        a, rank, p_lo, p_hi = segment_work(seg_start_ptr, seg_adapter_ptr, ranks_ptr, s, tl.program_id(1), m,
                                           max_rank, chunk_tokens)
        _shrink_segment(x_ptr, stride_xt, buf_ptr, stride_buf, order_ptr, slots_ptr, stride_slots, a_off_ptr,
                        out_ptr, stride_og, stride_ot, num_tokens, W, n_chunks, max_rank, rows_p, a, rank, p_lo, p_hi,
                        p_hi - p_lo > long_from, split, g, m, r_tile, k_lo, k_hi, NUM_GROUPS, BLOCK_M, BLOCK_R,
                        BLOCK_K, ALIGNED, EVEN, SPLIT, HAS_ORDER, PRECISION, BLOCK_M_LONG)


@triton.jit
def _shrink_dealt(
    x_ptr, stride_xt, buf_ptr, stride_buf, seg_start_ptr, seg_adapter_ptr, order_ptr,
    slots_ptr, stride_slots, ranks_ptr, a_off_ptr, out_ptr, stride_og, stride_ot,
    num_tokens, W, n_chunks, max_rank, rows_p, n_seg, seg_programs, split, g, m, r_tile, k_lo, k_hi, long_from,
    NUM_GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ALIGNED: tl.constexpr, EVEN: tl.constexpr, SPLIT: tl.constexpr, HAS_ORDER: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M_LONG: tl.constexpr, SEG_BLOCK: tl.constexpr,
):
    """The busy segments' token tiles (BLOCK_M_LONG rows for a segment of more than long_from tokens when set,
    BLOCK_M otherwise) dealt out in turn (dealt_tile), as in the expand kernel's _expand_dealt. Every segment's
    tiles are dealt, base-only ones too: each token's partial sums are stored for the split's finalize."""
    idx, lo, hi, adapter, rank = busy_segments(seg_start_ptr, seg_adapter_ptr, ranks_ptr, n_seg, m, max_rank,
                                               SEG_BLOCK)
    if BLOCK_M_LONG > 0:
        height = tl.where(hi - lo > long_from, BLOCK_M_LONG, BLOCK_M)
    else:
        height = tl.full([SEG_BLOCK], BLOCK_M, tl.int32)
    tiles = (hi - lo + height - 1) // height
    ends = tl.cumsum(tiles, axis=0)
    for t in range(tl.program_id(0), tl.sum(tiles, axis=0), seg_programs):
        pick, p_lo, p_hi, h = dealt_tile(idx, lo, hi, height, tiles, ends, t)
        _shrink_segment(x_ptr, stride_xt, buf_ptr, stride_buf, order_ptr, slots_ptr, stride_slots, a_off_ptr,
                        out_ptr, stride_og, stride_ot, num_tokens, W, n_chunks, max_rank, rows_p,
                        tl.sum(tl.where(pick, adapter, 0), axis=0), tl.sum(tl.where(pick, rank, 0), axis=0), p_lo,
                        p_hi, h > BLOCK_M, split, g, m, r_tile, k_lo, k_hi, NUM_GROUPS, BLOCK_M, BLOCK_R, BLOCK_K,
                        ALIGNED, EVEN, SPLIT, HAS_ORDER, PRECISION, BLOCK_M_LONG)


@triton.jit
def _shrink_segment(
    x_ptr, stride_xt, buf_ptr, stride_buf, order_ptr, slots_ptr, stride_slots, a_off_ptr, out_ptr, stride_og,
    stride_ot, num_tokens, W, n_chunks, max_rank, rows_p, a, rank, p_lo, p_hi, long, split, g, m, r_tile, k_lo, k_hi,
    NUM_GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ALIGNED: tl.constexpr, EVEN: tl.constexpr, SPLIT: tl.constexpr, HAS_ORDER: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M_LONG: tl.constexpr,
):
    """Positions p_lo..p_hi of adapter a's segment (rank 0: base-only), for one program's (module, rank tile,
    input split), in BLOCK_M_LONG-row tiles where `long` (with BLOCK_M_LONG set) and BLOCK_M-row ones otherwise:
    a graph's segment lengths change from replay to replay, and a long one read in BLOCK_M-row tiles reads the
    adapter's rows once a tile."""
    first = tl.load(a_off_ptr + a * 7 + m)
    list_ptr = slots_ptr + a.to(tl.int64) * stride_slots
    # Constexpr branches (a Python bool would become a tensor): a launch of one tile height compiles that
    # height alone.
    if BLOCK_M_LONG > 0:
        if long:
            _shrink_rows(x_ptr, stride_xt, buf_ptr, stride_buf, order_ptr, list_ptr, first, rank, out_ptr,
                         stride_og, stride_ot, num_tokens, W, n_chunks, max_rank, rows_p, p_lo, p_hi, split, g,
                         r_tile, k_lo, k_hi, NUM_GROUPS, BLOCK_M_LONG, BLOCK_R, BLOCK_K, ALIGNED, EVEN, SPLIT,
                         HAS_ORDER, PRECISION)
        else:
            _shrink_rows(x_ptr, stride_xt, buf_ptr, stride_buf, order_ptr, list_ptr, first, rank, out_ptr,
                         stride_og, stride_ot, num_tokens, W, n_chunks, max_rank, rows_p, p_lo, p_hi, split, g,
                         r_tile, k_lo, k_hi, NUM_GROUPS, BLOCK_M, BLOCK_R, BLOCK_K, ALIGNED, EVEN, SPLIT,
                         HAS_ORDER, PRECISION)
    else:
        _shrink_rows(x_ptr, stride_xt, buf_ptr, stride_buf, order_ptr, list_ptr, first, rank, out_ptr,
                     stride_og, stride_ot, num_tokens, W, n_chunks, max_rank, rows_p, p_lo, p_hi, split, g,
                     r_tile, k_lo, k_hi, NUM_GROUPS, BLOCK_M, BLOCK_R, BLOCK_K, ALIGNED, EVEN, SPLIT,
                     HAS_ORDER, PRECISION)


@triton.jit
def _shrink_rows(
    x_ptr, stride_xt, buf_ptr, stride_buf, order_ptr, list_ptr, first, rank, out_ptr, stride_og, stride_ot,
    num_tokens, W, n_chunks, max_rank, rows_p, p_lo, p_hi, split, g, r_tile, k_lo, k_hi,
    NUM_GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    ALIGNED: tl.constexpr, EVEN: tl.constexpr, SPLIT: tl.constexpr, HAS_ORDER: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Positions p_lo..p_hi of the (ordered) batch, one adapter's, in BLOCK_M-row tiles."""
    rows = r_tile * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < rank
    for p0 in range(p_lo, p_hi, BLOCK_M):
        pos = p0 + tl.arange(0, BLOCK_M)
        p_mask = pos < p_hi
        if HAS_ORDER:
            tok = tl.load(order_ptr + pos, mask=p_mask, other=0)
        else:
            tok = pos
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        if r_tile * BLOCK_R < rank:
            x_rows = x_ptr + tok.to(tl.int64)[:, None] * stride_xt
            if ALIGNED:
                # As in the per-token kernel: row slots once per chunk, independent loads inside.
                cols = tl.arange(0, BLOCK_K)
                entry = list_ptr + first + rows * n_chunks
                for c in range(k_lo // W, (k_hi - 1) // W + 1):
                    slot = tl.load(entry + c, mask=row_mask, other=0)
                    row_ptr = buf_ptr + slot.to(tl.int64)[:, None] * stride_buf + cols[None, :]
                    for k0 in range(tl.maximum(k_lo, c * W), tl.minimum(k_hi, c * W + W), BLOCK_K):
                        ks = k0 + cols
                        off = tl.multiple_of(k0 - c * W, BLOCK_K)
                        if EVEN:
                            xt = tl.load(x_rows + ks[None, :], mask=p_mask[:, None], other=0.0)
                            w = tl.load(row_ptr + off, mask=row_mask[:, None], other=0.0)
                        else:
                            k_mask = (ks < k_hi)[None, :]
                            xt = tl.load(x_rows + ks[None, :], mask=p_mask[:, None] & k_mask, other=0.0)
                            w = tl.load(row_ptr + off, mask=row_mask[:, None] & k_mask, other=0.0)
                        acc = tl.dot(xt, tl.trans(w.to(xt.dtype)), acc, input_precision=PRECISION)
            else:
                for k0 in range(k_lo, k_hi, BLOCK_K):
                    ks = k0 + tl.arange(0, BLOCK_K)
                    if EVEN:
                        xt = tl.load(x_rows + ks[None, :], mask=p_mask[:, None], other=0.0)
                    else:
                        xt = tl.load(x_rows + ks[None, :], mask=p_mask[:, None] & (ks < k_hi)[None, :], other=0.0)
                    w = load_adapter_tile(buf_ptr, stride_buf, list_ptr, first, rows, row_mask, k0, k_hi, W,
                                          n_chunks, BLOCK_K, ALIGNED, EVEN)
                    acc = tl.dot(xt, tl.trans(w.to(xt.dtype)), acc, input_precision=PRECISION)
        if SPLIT:
            base = ((split * NUM_GROUPS + g) * num_tokens + tok).to(tl.int64) * rows_p
            tl.store(out_ptr + base[:, None] + rows[None, :], acc, mask=p_mask[:, None] & row_mask[None, :])
        else:
            base = g.to(tl.int64) * stride_og + tok.to(tl.int64) * stride_ot
            tl.store(out_ptr + base[:, None] + rows[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=p_mask[:, None] & (rows < max_rank)[None, :])


@triton.jit(do_not_specialize=["stride_og", "num_tokens", "max_rank", "n_split"])
def _shrink_finalize_kernel(
    part_ptr, out_ptr, stride_og, stride_ot, token_adapter_ptr, ranks_ptr,
    num_tokens, max_rank, n_split, rows_p, M0, M1, M2,
    NUM_GROUPS: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Sum the K-split partials in split order, cast, and write the whole row (zeros past the rank)."""
    t = tl.program_id(0)
    g = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    m = module_slot(g, M0, M1, M2)
    a = tl.load(token_adapter_ptr + t)
    rank = tl.load(ranks_ptr + tl.maximum(a, 0) * 7 + m)
    rank = tl.where(a >= 0, tl.minimum(rank, max_rank), 0)
    mask = rows < rank
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for split in range(0, n_split):
        base = ((split * NUM_GROUPS + g) * num_tokens + t).to(tl.int64) * rows_p
        acc += tl.load(part_ptr + base + rows, mask=mask, other=0.0)
    base = g.to(tl.int64) * stride_og + t.to(tl.int64) * stride_ot
    tl.store(out_ptr + base + rows, acc.to(out_ptr.dtype.element_ty), mask=rows < max_rank)


# A decode graph replayed by steps of many adapters launches a segment per token, not knowing which of them
# hold tokens: planned as if all did, its input went unsplit, and each of its busy programs read a rank tile's
# whole input alone. On the H200 (docs/benchmarks.md, 2026-12-04 16:24) splitting the input 4 ways took Llama-3-8B's
# shrink at batch 512 over 100 adapters from 37.0 to 32.2 µs a layer for q,k,v, 19.3 to 15.9 for o, 30.2 to
# 23.9 for gate,up and 51.9 to 39.9 for down; over 250 adapters it was within 2.5% either way.
GRAPH_SHRINK_MIN_SPLIT = 4

# Token rows a shrink tile holds in a decode graph of the few-adapter plan (segments shared out among a few
# programs; kernel_shapes' graph_few_shrink_m). Such a step's segments are long (S-GQA at batch 512 over 5
# adapters: ~100 tokens each), and each tile is a pass over the program's slice of adapter rows; at 64 rows
# the four groups took 170 against 243 µs a layer on the H200 (docs/benchmarks.md, 2026-12-04 19:22). 16
# until steps of up to 32 adapters with short segments are measured too.
GRAPH_FEW_SHRINK_BLOCK_M = 16
# A program of those graphs takes a segment of more than kernel_shapes' graph_few_shrink_long (default 16)
# tokens in tiles of this many rows and a shorter one in GRAPH_FEW_SHRINK_BLOCK_M's: one graph serves steps of
# 5 adapters (~100 tokens a segment at batch 512) and of 32 (~16). One height for all was 64 rows' loss at 32
# adapters (12-14%) or 16 rows' at 5 (up to 30%). On an H100 (docs/benchmarks.md, 2026-12-05 16:43) the four
# groups took 1.03x the best plan's time on average against 1.18x with 16 rows alone, and the engine's decode
# step 0.94x at 5 adapters, 0.96x at 12, 1.01x at 32.
GRAPH_FEW_SHRINK_LONG_M = 64


@dataclass(frozen=True)
class ShrinkConfig:
    """Launch shape; `choose_shrink_config` picks one, benchmarks may pass their own."""

    block_r: int
    block_k: int
    n_split: int
    block_m: int = 16  # segment form only
    block_m_long: int = 0  # segment form, shared out: token rows of a tile for parts of more than long_from tokens
    long_from: int = 0
    chunk_tokens: int = 0  # segment form: tokens per program (0 = whole segment)
    segment_programs: int = 0  # segment form: programs that share the segments out (0 = one per segment)
    # Segment form, shared out: the busy segments' token tiles dealt to the programs in turn rather than whole
    # segments (_shrink_dealt); whole segments only (chunk_tokens 0).
    deal_tiles: bool = False
    num_warps: int = 4
    num_stages: int = 2
    max_registers: int = 0  # a thread's at most (ptxas's maxnreg), as in ExpandConfig; 0: the compiler's choice


def choose_shrink_config(num_tokens: int, num_groups: int, fan_in: int, width: int, max_rank: int,
                         device: torch.device, segmented: bool, max_seg_len: int | None = None,
                         num_segments: int | None = None, live_segments: int | None = None,
                         segment_programs: int = 0, chunk_programs: int | None = None) -> ShrinkConfig:
    """Enough programs to keep every multiprocessor streaming adapter rows, from few tokens (split the
    input dimension) or from many (split tokens into chunks for long prefill segments). The GEMV loop's
    loads are not software-pipelined, so memory parallelism comes from many resident programs: aim for
    several per multiprocessor. `live_segments` bounds how many of the segments are counted as carrying
    tokens: a CUDA graph launches one segment per token because it cannot know the step's adapters, and
    counting all of them as work would leave a step of a few adapters to a handful of programs.
    `segment_programs` (0: one program per segment) shares the segments out among that many programs, so a
    graph's unused segments launch none. A graph launch planned for every segment (no live_segments, no
    max_seg_len) splits its input at least GRAPH_SHRINK_MIN_SPLIT ways (kernel_shapes' graph_shrink_split).
    `chunk_programs`: the (segment, chunk) pairs a chunked launch runs, when the step lists them
    (lora_groups.ChunkItems.count)."""
    block_k = pow2_divisor(width, 128)
    if block_k < 16:
        block_k = 32  # rows straddle slots inside a tile: the unaligned path
    # 32-row rank tiles: a rank-64 adapter is two programs' work and a rank-8 one a quarter of one, which
    # balances mixed ranks better than one program per adapter (measured on the H200, docs/benchmarks.md).
    block_r = min(max(16, next_pow2(max_rank)), 32)
    r_tiles = cdiv(max(max_rank, 1), block_r)
    target = 8 * num_sms(device)
    shapes = launch_shapes()
    block_m, chunk, block_m_long, long_from, deal = 16, 0, 0, 0, False
    if segmented:
        n_units = planned_segments(num_segments if num_segments is not None else num_tokens, live_segments,
                                   segment_programs)
        if max_seg_len is not None and max_seg_len > PREFILL_CHUNK_TOKENS:
            # Long runs (prefill) are cut into 64-token chunks, one program each. 64-token tiles only when
            # segments are long on average; a decode step grouped by adapter has a few tokens a segment.
            chunk = PREFILL_CHUNK_TOKENS
            block_m = 64 if long_on_average(num_tokens, num_segments) else 16
            if full_on_average(num_tokens, num_segments):
                # Few long prompts: 64-column input tiles. On the H200 an S2 admission step over 5 adapters
                # (1737 tokens a segment) took 39 against 50 µs a layer for q,k,v, 43 against 53 for gate,up
                # and 61 against 74 for down; over 100 (87 a segment) o, gate,up and down lost 10-30%.
                block_k = min(block_k, 64)
            n_units = num_segments * cdiv(max_seg_len, chunk) if num_segments else cdiv(num_tokens, chunk)
            if chunk_programs and block_m == 16:
                # Segments of a few tokens (a round of prompts beside decode rows over many adapters): most
                # programs stream one adapter's rows for a token or two, as at decode, so the split is planned
                # for the programs the launch runs, not every segment times the longest one's chunks (7x more
                # here). On the H200, S2 n = 2000's admission step (2926 tokens over 278 adapters, 313 chunks,
                # docs/results/admission_shapes_p10_r374_n278_2026-12-05.json) took 116 against 184 µs a
                # layer for down and 49 against 72 for o at two splits, the count's choice. Long segments
                # (64-row tiles doing tl.dot work on full chunks) keep the old count: over 100 adapters
                # (8687 tokens) the same splits were 27-39% slower.
                n_units = chunk_programs
        elif few_adapter_graph(max_seg_len, live_segments, segment_programs):
            block_m = shapes.graph_few_shrink_m or GRAPH_FEW_SHRINK_BLOCK_M
            deal = shapes.graph_few_shrink_deal  # the segments' tiles dealt to the programs in turn
            chunk = 0 if deal else shapes.graph_few_chunk  # 0: a program walks each of its segments whole
            if shapes.graph_few_shrink_long and GRAPH_FEW_SHRINK_LONG_M > block_m:
                block_m_long, long_from = GRAPH_FEW_SHRINK_LONG_M, shapes.graph_few_shrink_long
    else:
        n_units = num_tokens
    base = max(1, n_units * num_groups * r_tiles)
    least = 1
    segments = num_segments if num_segments is not None else num_tokens
    # A graph's launch planned as if every segment held tokens (see GRAPH_SHRINK_MIN_SPLIT).
    if (segmented and max_seg_len is None and not segment_programs
            and planned_segments(segments, live_segments, 0) == segments):
        least = shapes.graph_shrink_split or GRAPH_SHRINK_MIN_SPLIT
    n_split = max(1, min(max(cdiv(target, base), least), cdiv(fan_in, block_k), 64))
    # The segment form's loads feed tl.dot and are software-pipelined; three stages measured faster.
    return ShrinkConfig(block_r=block_r, block_k=block_k, n_split=n_split, block_m=block_m, chunk_tokens=chunk,
                        segment_programs=segment_programs if segmented else 0, num_stages=3 if segmented else 2,
                        block_m_long=block_m_long, long_from=long_from, deal_tiles=deal)


def lora_shrink(x: torch.Tensor, k_buf: torch.Tensor, token_adapter: torch.Tensor, tables: LoraTables,
                modules: tuple[int, ...], max_rank: int, *, seg_start: torch.Tensor | None = None,
                seg_adapter: torch.Tensor | None = None, token_order: torch.Tensor | None = None,
                max_seg_len: int | None = None, live_segments: int | None = None, num_live: torch.Tensor | None = None,
                segment_programs: int = 0, chunk_items=None, out: torch.Tensor | None = None,
                config: ShrinkConfig | None = None, plan: dict | None = None) -> torch.Tensor:
    """Same contract as ops.reference.lora_shrink: `[len(modules), T, max_rank]` in x's dtype.

    With seg_start/seg_adapter the segment form runs (segments must cover all T positions; token_order,
    if given, maps sorted positions to tokens, as from group_tokens_by_adapter). max_seg_len (a host int,
    optional) lets long prefill segments be spread over 64-token programs; pass the longest run the host
    knows of (an upper bound such as T is correct but launches programs that find no tokens), and leave
    it out for decode steps. live_segments (a host int, optional): how many segments to plan the launch for
    when seg_adapter is only a bound (a CUDA graph's one segment per token; see choose_shrink_config); it
    never changes results. segment_programs (see choose_shrink_config) with num_live (int32 [1] on the device:
    how many segments, from the first, hold tokens; optional) lets fewer programs than segments cover them.
    chunk_items (lora_groups.ChunkItems, optional) lists the (segment, chunk) pairs that hold tokens: a launch
    cutting long segments into chunks of its size then runs one program per pair (segment_launch).
    `out` may be given to write into
    (for example a buffer reused across CUDA graph replays). `plan` (a dict, one per step) keeps the launch
    worked out for the first layer, checks and launch shape included, so the step's other layers, whose
    tensors have the same shapes, only launch."""
    key = None
    if plan is not None:
        # Everything the checks and the launch shape read, bar the step's own tensors (fixed with the plan).
        key = ("shrink", tuple(modules), max_rank, tuple(x.shape), x.stride(), x.dtype, x.device,
               tuple(k_buf.shape), k_buf.stride(), k_buf.dtype,
               None if out is None else (tuple(out.shape), out.stride(), out.dtype),
               id(token_adapter), id(tables), config)
        launch = plan.get(key)
        if launch is not None:
            return launch(x, k_buf, out)
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    device = x.device
    check_pool_buffer("k_buf", k_buf, device)
    check_tensor("token_adapter", token_adapter, ndim=1, dtypes=(torch.int32,), device=device, contiguous=True)
    check_tables(tables, device)
    modules = check_modules(modules)
    num_tokens, fan_in = x.shape
    if token_adapter.shape[0] != num_tokens:
        raise ValueError(f"token_adapter has {token_adapter.shape[0]} entries but x has {num_tokens} tokens")
    if not (isinstance(max_rank, int) and max_rank >= 0):
        raise ValueError(f"max_rank must be a non-negative int, got {max_rank!r}")
    num_groups = len(modules)
    if out is None:
        out = torch.empty(num_groups, num_tokens, max_rank, dtype=x.dtype, device=device)
    else:
        check_tensor("out", out, ndim=3, dtypes=(x.dtype,), device=device)
        if tuple(out.shape) != (num_groups, num_tokens, max_rank):
            raise ValueError(f"out must be [{num_groups}, {num_tokens}, {max_rank}], got {tuple(out.shape)}")
    segmented = seg_start is not None
    if segmented:
        check_segments(num_tokens, device, seg_start, seg_adapter, token_order)
    if num_tokens == 0 or max_rank == 0:
        out.zero_()
        return out
    width = k_buf.shape[1]
    n_chunks = cdiv(fan_in, width)
    num_segments = seg_adapter.shape[0] if segmented else None
    cfg = config or choose_shrink_config(num_tokens, num_groups, fan_in, width, max_rank, device, segmented,
                                         max_seg_len, num_segments, live_segments, segment_programs,
                                         chunk_items.count if chunk_items is not None else None)
    aligned = width % cfg.block_k == 0 and cfg.block_k >= 16
    k_per_split = cdiv(cdiv(fan_in, cfg.n_split), cfg.block_k) * cfg.block_k
    n_split = cdiv(fan_in, k_per_split)
    even = fan_in % cfg.block_k == 0
    r_tiles = cdiv(max_rank, cfg.block_r)
    rows_p = r_tiles * cfg.block_r
    split = n_split > 1
    m0, m1, m2 = pad3(modules)
    common = dict(NUM_GROUPS=num_groups, BLOCK_R=cfg.block_r, BLOCK_K=cfg.block_k, ALIGNED=aligned, EVEN=even,
                  SPLIT=split, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.max_registers:
        common["maxnreg"] = cfg.max_registers
    finalize_block = min(next_pow2(rows_p), 256)
    if segmented:
        seg = segment_form(cfg, num_tokens, max_seg_len, seg_start, seg_adapter, token_order, num_live, chunk_items,
                           x.dtype, device)
        common.update(seg.constexprs)
        # Per-segment tile heights only where programs walk segments they share out (a few-adapter graph's).
        common["BLOCK_M_LONG"] = cfg.block_m_long if seg.constexprs["SHARED"] else 0
        common.update(deal_constexprs(cfg, seg, live_segments, num_segments))
        main_fn, main_grid = _shrink_segment_kernel, (seg.axis, seg.chunks, num_groups * r_tiles * n_split)
    else:
        main_fn, main_grid = _shrink_token_kernel, (num_tokens, num_groups, r_tiles * n_split)
    finalize_grid = (num_tokens, num_groups, cdiv(rows_p, finalize_block))
    # A planned launch serves every layer of the step: its later layers may skip Triton's binding.
    main = CompiledLaunch(main_fn)[main_grid] if plan is not None else main_fn[main_grid]
    finalize = None
    if split:
        finalize = (CompiledLaunch(_shrink_finalize_kernel)[finalize_grid] if plan is not None
                    else _shrink_finalize_kernel[finalize_grid])

    def launch(x: torch.Tensor, k_buf: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """The kernels alone, for this shape: the tensors that change from layer to layer come in."""
        if out is None:
            out = torch.empty(num_groups, num_tokens, max_rank, dtype=x.dtype, device=device)
        dst = torch.empty(n_split, num_groups, num_tokens, rows_p, dtype=torch.float32, device=device) if split else out
        if not segmented:
            main(
                x, x.stride(0), k_buf, k_buf.stride(0), token_adapter,
                tables.slots, tables.slots.stride(0), tables.ranks, tables.a_off,
                dst, out.stride(0), out.stride(1),
                num_tokens, fan_in, width, n_chunks, max_rank, k_per_split, n_split, rows_p,
                m0, m1, m2, **common)
        else:
            main(
                x, x.stride(0), k_buf, k_buf.stride(0), *seg.args,
                tables.slots, tables.slots.stride(0), tables.ranks, tables.a_off,
                dst, out.stride(0), out.stride(1),
                num_tokens, fan_in, width, n_chunks, max_rank, k_per_split, n_split, rows_p, seg.chunk, r_tiles,
                num_segments, seg.programs, cfg.long_from, m0, m1, m2, **common)
        if split:
            finalize(
                dst, out, out.stride(0), out.stride(1), token_adapter, tables.ranks,
                num_tokens, max_rank, n_split, rows_p, m0, m1, m2,
                NUM_GROUPS=num_groups, BLOCK_R=finalize_block, num_warps=1 if finalize_block <= 64 else 4)
        return out

    if plan is not None:
        plan[key] = launch
    return launch(x, k_buf, out)
