"""LoRA expand on the unified pool: out[t, cols of module g] += y[g, t, :r] @ (scaled B_g)ᵀ, in place, for
every module of a fused group (q,k,v or gate,up: `out_dims` column groups of one output) in one launch.

Programs own disjoint output tiles, so the in-place add needs no atomics. Forms as in lora_shrink.py:
per token (decode, MBGMV; a GEMV over the rank on CUDA cores) and segment (tokens sharing an adapter as
tl.dot tiles, each Bᵀ tile read from memory once per segment). Base-only tokens and rank-0 modules return
before reading anything, so a base-only batch costs one near-empty launch.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ..ops.meta import LoraTables
from .checks import (
    FLOAT_DTYPES, cdiv, check_modules, check_tensor, next_pow2, num_sms, pad3, pow2_divisor, require,
)
from .compiled_launch import CompiledLaunch
from .launch_shapes import launch_shapes
from .lora_groups import PREFILL_CHUNK_TOKENS, full_on_average
from .lora_rows import (
    busy_segments, check_pool_buffer, check_segments, check_tables, deal_constexprs, dealt_tile, few_adapter_graph,
    load_adapter_tile, module_slot, planned_segments, segment_chunk, segment_form, segment_work,
)


# The batch's rank, chunk length and y's stride between modules (tokens x rank) vary from step to step:
# not specialised on, so a new value costs no compile (as in lora_shrink.py).
@triton.jit(do_not_specialize=["stride_yg", "y_rank"])
def _expand_token_kernel(
    y_ptr, stride_yg, stride_yt, buf_ptr, stride_buf, token_adapter_ptr,
    slots_ptr, stride_slots, ranks_ptr, b_off_ptr,
    out_ptr, stride_ot, W, y_rank, tiles_per_prog,
    M0, M1, M2, D0, D1, D2, C0, C1, C2,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, ALIGNED: tl.constexpr, EVEN: tl.constexpr,
    COLS_FIRST: tl.constexpr,
):
    if COLS_FIRST:
        col_pid, g, t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    else:
        t, g, col_pid = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    out_dim = module_slot(g, D0, D1, D2)
    n_lo = col_pid * tiles_per_prog * BLOCK_N
    a = tl.load(token_adapter_ptr + t)
    if (a < 0) | (n_lo >= out_dim):
        return
    m = module_slot(g, M0, M1, M2)
    rank = tl.minimum(tl.load(ranks_ptr + a * 7 + m), y_rank)
    if rank == 0:
        return
    first = tl.load(b_off_ptr + a * 7 + m)
    list_ptr = slots_ptr + a.to(tl.int64) * stride_slots
    n_chunks = (out_dim + W - 1) // W
    y_row = y_ptr + g.to(tl.int64) * stride_yg + t.to(tl.int64) * stride_yt
    o_row = out_ptr + t.to(tl.int64) * stride_ot + module_slot(g, C0, C1, C2)
    n_hi = tl.minimum(out_dim, n_lo + tiles_per_prog * BLOCK_N)
    # A program may walk several column tiles (tiles_per_prog); each tile's output is loaded before its
    # weights so both are in flight together.
    for n0 in range(n_lo, n_hi, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        if EVEN:
            o = tl.load(o_row + cols)
        else:
            o = tl.load(o_row + cols, mask=cols < out_dim, other=0.0)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            rows = r0 + tl.arange(0, BLOCK_R)
            row_mask = rows < rank
            yv = tl.load(y_row + rows, mask=row_mask, other=0.0).to(tl.float32)
            w = load_adapter_tile(buf_ptr, stride_buf, list_ptr, first, rows, row_mask, n0, out_dim, W, n_chunks,
                                  BLOCK_N, ALIGNED, EVEN)
            acc += tl.sum(w.to(tl.float32) * yv[:, None], axis=0)
        if EVEN:
            tl.store(o_row + cols, (o.to(tl.float32) + acc).to(out_ptr.dtype.element_ty))
        else:
            tl.store(o_row + cols, (o.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=cols < out_dim)


# stride_items is the chunk-item count of the step (the items table is [2, count]): specialized, its being 1 or a
# multiple of 16 made two or three variants of each launch shape, built under load as steps met them.
@triton.jit(do_not_specialize=["stride_yg", "y_rank", "chunk_tokens", "num_segments", "seg_programs", "stride_items"])
def _expand_segment_kernel(
    y_ptr, stride_yg, stride_yt, buf_ptr, stride_buf, seg_start_ptr, seg_adapter_ptr, order_ptr, live_ptr,
    items_ptr, stride_items, slots_ptr, stride_slots, ranks_ptr, b_off_ptr,
    out_ptr, stride_ot, W, y_rank, chunk_tokens, n_col_groups, tiles_per_prog, num_segments, seg_programs,
    M0, M1, M2, D0, D1, D2, C0, C1, C2,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    ALIGNED: tl.constexpr, EVEN: tl.constexpr, HAS_ORDER: tl.constexpr, HAS_LIVE: tl.constexpr,
    SHARED: tl.constexpr, HAS_ITEMS: tl.constexpr, PRECISION: tl.constexpr, COLS_FIRST: tl.constexpr,
    RANK_WHOLE: tl.constexpr, DEAL: tl.constexpr, SEG_BLOCK: tl.constexpr,
):
    if COLS_FIRST:
        col_pid, seg_pid = tl.program_id(0), tl.program_id(2)
    else:
        seg_pid, col_pid = tl.program_id(0), tl.program_id(2)
    g = col_pid // n_col_groups
    out_dim = module_slot(g, D0, D1, D2)
    n_lo = (col_pid % n_col_groups) * tiles_per_prog * BLOCK_N
    if n_lo >= out_dim:
        return
    m = module_slot(g, M0, M1, M2)
    n_hi = tl.minimum(out_dim, n_lo + tiles_per_prog * BLOCK_N)
    if SHARED:
        # As in the shrink kernel: up to the segments in use. Constexpr first (a launch without dealing compiles
        # the walk alone), then the count on the device: more busy segments than the dealing's vectors hold fall
        # back to the walk, so no segment is left out.
        n_seg = num_segments
        if HAS_LIVE:
            n_seg = tl.load(live_ptr)
        walk = True
        if DEAL:
            walk = n_seg > SEG_BLOCK
            if not walk:
                _expand_dealt(y_ptr, stride_yg, stride_yt, buf_ptr, stride_buf, seg_start_ptr, seg_adapter_ptr,
                              order_ptr, slots_ptr, stride_slots, ranks_ptr, b_off_ptr, out_ptr, stride_ot, W, y_rank,
                              n_seg, seg_pid, seg_programs, m, g, n_lo, n_hi, out_dim, C0, C1, C2, BLOCK_M, BLOCK_R,
                              BLOCK_N, ALIGNED, EVEN, HAS_ORDER, PRECISION, RANK_WHOLE, SEG_BLOCK)
        if walk:
            _expand_walked(y_ptr, stride_yg, stride_yt, buf_ptr, stride_buf, seg_start_ptr, seg_adapter_ptr,
                           order_ptr, slots_ptr, stride_slots, ranks_ptr, b_off_ptr, out_ptr, stride_ot, W,
                           y_rank, chunk_tokens, n_seg, seg_pid, seg_programs, m, g, n_lo, n_hi, out_dim,
                           C0, C1, C2, BLOCK_M, BLOCK_R, BLOCK_N, ALIGNED, EVEN, HAS_ORDER, PRECISION, RANK_WHOLE)
    else:
        s, chunk = segment_chunk(items_ptr, stride_items, seg_pid, tl.program_id(1), HAS_ITEMS)
        a, rank, p_lo, p_hi = segment_work(seg_start_ptr, seg_adapter_ptr, ranks_ptr, s, chunk, m, y_rank,
                                            chunk_tokens)
        if (rank == 0) | (p_lo >= p_hi):
            return
        _expand_segment(y_ptr, stride_yg, stride_yt, buf_ptr, stride_buf, order_ptr, slots_ptr, stride_slots,
                        b_off_ptr, out_ptr, stride_ot, W, a, m, g, rank, p_lo, p_hi, n_lo, n_hi, out_dim,
                        C0, C1, C2, BLOCK_M, BLOCK_R, BLOCK_N, ALIGNED, EVEN, HAS_ORDER, PRECISION, RANK_WHOLE)


@triton.jit
def _expand_walked(
    y_ptr, stride_yg, stride_yt, buf_ptr, stride_buf, seg_start_ptr, seg_adapter_ptr, order_ptr, slots_ptr,
    stride_slots, ranks_ptr, b_off_ptr, out_ptr, stride_ot, W, y_rank, chunk_tokens, n_seg, seg_pid, seg_programs,
    m, g, n_lo, n_hi, out_dim, C0, C1, C2,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, ALIGNED: tl.constexpr, EVEN: tl.constexpr,
    HAS_ORDER: tl.constexpr, PRECISION: tl.constexpr, RANK_WHOLE: tl.constexpr,
):
    """Program seg_pid of seg_programs walks segments seg_pid, seg_pid + seg_programs, ... whole (their chunk
    on the grid's second axis)."""
    for s in range(seg_pid, n_seg, seg_programs):
        a, rank, p_lo, p_hi = segment_work(seg_start_ptr, seg_adapter_ptr, ranks_ptr, s, tl.program_id(1), m,
                                            y_rank, chunk_tokens)
        if (rank > 0) & (p_lo < p_hi):
            _expand_segment(y_ptr, stride_yg, stride_yt, buf_ptr, stride_buf, order_ptr, slots_ptr,
                            stride_slots, b_off_ptr, out_ptr, stride_ot, W, a, m, g, rank, p_lo, p_hi, n_lo,
                            n_hi, out_dim, C0, C1, C2, BLOCK_M, BLOCK_R, BLOCK_N, ALIGNED, EVEN, HAS_ORDER,
                            PRECISION, RANK_WHOLE)


@triton.jit
def _expand_dealt(
    y_ptr, stride_yg, stride_yt, buf_ptr, stride_buf, seg_start_ptr, seg_adapter_ptr, order_ptr, slots_ptr,
    stride_slots, ranks_ptr, b_off_ptr, out_ptr, stride_ot, W, y_rank, n_seg, seg_pid, seg_programs,
    m, g, n_lo, n_hi, out_dim, C0, C1, C2,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, ALIGNED: tl.constexpr, EVEN: tl.constexpr,
    HAS_ORDER: tl.constexpr, PRECISION: tl.constexpr, RANK_WHOLE: tl.constexpr, SEG_BLOCK: tl.constexpr,
):
    """The busy segments' BLOCK_M-row token tiles dealt out in turn (dealt_tile). Walking whole segments, a
    graph's step over 5 adapters at batch 512 kept 5 of its 32 programs a column tile busy, each with ~7 tiles
    in a row; dealt, all 32 take one or two. Segments of rank 0 (base-only, or an adapter without this module)
    get no tiles."""
    idx, lo, hi, adapter, rank = busy_segments(seg_start_ptr, seg_adapter_ptr, ranks_ptr, n_seg, m, y_rank,
                                               SEG_BLOCK)
    tiles = tl.where(rank > 0, (hi - lo + BLOCK_M - 1) // BLOCK_M, 0)
    height = tl.full([SEG_BLOCK], BLOCK_M, tl.int32)
    ends = tl.cumsum(tiles, axis=0)
    for t in range(seg_pid, tl.sum(tiles, axis=0), seg_programs):
        pick, p_lo, p_hi, _ = dealt_tile(idx, lo, hi, height, tiles, ends, t)
        _expand_segment(y_ptr, stride_yg, stride_yt, buf_ptr, stride_buf, order_ptr, slots_ptr, stride_slots,
                        b_off_ptr, out_ptr, stride_ot, W, tl.sum(tl.where(pick, adapter, 0), axis=0), m, g,
                        tl.sum(tl.where(pick, rank, 0), axis=0), p_lo, p_hi, n_lo, n_hi, out_dim, C0, C1, C2,
                        BLOCK_M, BLOCK_R, BLOCK_N, ALIGNED, EVEN, HAS_ORDER, PRECISION, RANK_WHOLE)


@triton.jit
def _expand_segment(
    y_ptr, stride_yg, stride_yt, buf_ptr, stride_buf, order_ptr, slots_ptr, stride_slots, b_off_ptr,
    out_ptr, stride_ot, W, a, m, g, rank, p_lo, p_hi, n_lo, n_hi, out_dim, C0, C1, C2,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    ALIGNED: tl.constexpr, EVEN: tl.constexpr, HAS_ORDER: tl.constexpr, PRECISION: tl.constexpr,
    RANK_WHOLE: tl.constexpr,
):
    """Positions p_lo .. p_hi - 1 of one adapter's segment, one program's column tiles of module g."""
    first = tl.load(b_off_ptr + a * 7 + m)
    list_ptr = slots_ptr + a.to(tl.int64) * stride_slots
    n_chunks = (out_dim + W - 1) // W
    y_base = y_ptr + g.to(tl.int64) * stride_yg
    col0 = module_slot(g, C0, C1, C2)
    for p0 in range(p_lo, p_hi, BLOCK_M):
        pos = p0 + tl.arange(0, BLOCK_M)
        p_mask = pos < p_hi
        if HAS_ORDER:
            tok = tl.load(order_ptr + pos, mask=p_mask, other=0)
        else:
            tok = pos
        o_rows = out_ptr + tok.to(tl.int64)[:, None] * stride_ot + col0
        y_rows = y_base + tok.to(tl.int64)[:, None] * stride_yt
        if RANK_WHOLE:
            # Every rank fits one BLOCK_R step: the token tile's y rows are read once, and the column tiles are
            # the program's innermost loop, so the next tile's Bᵀ rows and outputs can be loaded while this
            # one's are summed (a decode segment's rank loop has only one to four steps to overlap).
            whole = tl.arange(0, BLOCK_R)
            y_whole = tl.load(y_rows + whole[None, :], mask=p_mask[:, None] & (whole < rank)[None, :], other=0.0)
        # Each Bᵀ tile is read once for all of the segment's tokens in this token tile.
        for n0 in range(n_lo, n_hi, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            if EVEN:
                mask = p_mask[:, None]
            else:
                mask = p_mask[:, None] & (cols < out_dim)[None, :]
            o = tl.load(o_rows + cols[None, :], mask=mask, other=0.0)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            if RANK_WHOLE:
                w = load_adapter_tile(buf_ptr, stride_buf, list_ptr, first, whole, whole < rank, n0, out_dim, W,
                                      n_chunks, BLOCK_N, ALIGNED, EVEN)
                acc = tl.dot(y_whole, w.to(y_whole.dtype), acc, input_precision=PRECISION)
            else:
                for r0 in range(0, rank, BLOCK_R):
                    rows = r0 + tl.arange(0, BLOCK_R)
                    row_mask = rows < rank
                    yt = tl.load(y_rows + rows[None, :], mask=p_mask[:, None] & row_mask[None, :], other=0.0)
                    w = load_adapter_tile(buf_ptr, stride_buf, list_ptr, first, rows, row_mask, n0, out_dim, W,
                                          n_chunks, BLOCK_N, ALIGNED, EVEN)
                    acc = tl.dot(yt, w.to(yt.dtype), acc, input_precision=PRECISION)
            tl.store(o_rows + cols[None, :], (o.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=mask)


# A graph's launch walks two column tiles a program from this many tokens (see choose_expand_config).
GRAPH_TILES_MIN_TOKENS = 256
# ... and four where its group spans this many column tiles (its modules' tiles together): q,k,v and gate,up,
# not o or down. On the H200 (docs/benchmarks.md, 2026-12-04 16:33) Llama-3-8B's gate,up expand at batch 512
# over 100 adapters took 94.3 against 106.0 µs a layer and q,k,v 30.7 against 31.7; at batch 256 Llama-2-7B's
# q,k,v 45.5 against 48.9, while its o (32 tiles) lost, 21.2 against 19.6.
GRAPH_WIDE_TILES = 64


@dataclass(frozen=True)
class ExpandConfig:
    block_r: int
    block_n: int
    tiles_per_prog: int = 1  # column tiles one program walks
    block_m: int = 16  # segment form only
    chunk_tokens: int = 0  # segment form: tokens per program (0 = whole segment)
    segment_programs: int = 0  # segment form: programs that share the segments out (0 = one per segment)
    # Programs launched in order of column tile (then module, then segment or token) rather than segment
    # first: programs running side by side then read neighbouring 256-byte pieces of the same adapter rows
    # instead of one piece from each of many adapters' rows.
    cols_first: bool = False
    # Segment form: a program's whole rank in one BLOCK_R step (block_r must cover the batch's max rank), its
    # column tiles the loop the loads pipeline over.
    rank_whole: bool = False
    # Segment form, shared out (segment_programs): the busy segments' token tiles dealt to the programs in turn
    # rather than whole segments (_expand_dealt); whole segments only (chunk_tokens 0).
    deal_tiles: bool = False
    num_warps: int = 4
    num_stages: int = 2
    # Registers a thread at most (ptxas's maxnreg); 0: the compiler's choice. A decode graph's segment launch
    # compiles to 72, which holds 7 programs a multiprocessor: on the H100 its many-adapter q,k,v expand
    # (batch 384 over 300 adapters) then had under one warp of 16 ready to issue a cycle, waiting on its loads,
    # and read HBM at 64% of the peak while shrink, beside it, read at 80%. Chosen from
    # LaunchShapes.expand_registers (choose_expand_config).
    max_registers: int = 0


def choose_expand_config(num_tokens: int, num_groups: int, out_dims: tuple[int, ...], width: int, max_rank: int,
                         device: torch.device, segmented: bool, max_seg_len: int | None = None,
                         num_segments: int | None = None, live_segments: int | None = None,
                         segment_programs: int = 0) -> ExpandConfig:
    """128-column tiles (256-byte row reads), narrower only when few tokens would leave multiprocessors
    idle. One column tile per program, except in a CUDA graph's launch (segment form with max_seg_len unknown:
    a segment per token, most of them empty): there a program walks two (four in groups spanning
    GRAPH_WIDE_TILES column tiles or more), so half as many programs find their
    segment empty. On the H200 at batch 256 (docs/benchmarks.md) that took S2's q,k,v expand from 71 to 48 µs
    a layer at 100 adapters and 37 to 29 at 5. The launch-shape sweep at batch 64 (benchmarks/kernels/
    bench_lora.py) found several tiles a program slower, and an eager decode step's exact segments gained at
    100 adapters but lost at 5 (o: 18 against 22 µs, 12 against 9): those keep one tile.
    An eager prefill launch (64-token chunks) walks two as well while that still leaves 8 programs a
    multiprocessor: each program then reads its chunk's y rows once for two tiles. On the H200 an S2
    admission step's expand (8687 tokens over 100 adapters, benchmarks/kernels/admission_shapes.py) went
    from 365 to 293 µs a layer for q,k,v, 124 to 101 for o, 647 to 519 for gate,up and 126 to 103 for
    down, bit for bit the same output; one of S2 n = 2000 (2926 tokens over 278 adapters, 10 tokens a
    segment) from 169 to 148 for q,k,v and 295 to 252 for gate,up, o and down 2-3% faster. Its chunks are
    walked in 16-row tiles with 16-row rank steps unless its segments are full on average
    (lora_groups.full_on_average).
    live_segments, segment_programs: as in choose_shrink_config (a graph that shares its segments out among
    segment_programs programs has no empty ones, and keeps one tile a program; so do graphs of batches under
    GRAPH_TILES_MIN_TOKENS, where fewer of the segments are empty)."""
    target = 8 * num_sms(device)
    shapes = launch_shapes()

    def n_tiles_of(bn: int) -> int:
        return cdiv(max(out_dims), bn)

    units = num_segments if segmented and num_segments is not None else num_tokens
    block_m, chunk, short_prefill, deal = 16, 0, False, False
    if segmented:
        units = planned_segments(units, live_segments, segment_programs)
        if max_seg_len is not None and max_seg_len > PREFILL_CHUNK_TOKENS:
            # As in choose_shrink_config: 64-token chunks; unlike shrink, 64-row tiles only when segments are
            # full on average, 16-row tiles and rank steps otherwise. On the H200 an S2 admission step (8687
            # tokens, benchmarks/kernels/admission_shapes.py) over 100 adapters (87 tokens a segment, many chunks
            # holding a decode token or two, ranks 8 to 64) took 231 against 291 µs a layer for q,k,v and 401
            # against 514 for gate,up in 16-row tiles, and 16-row rank steps took those to 201 and 348 (o 85 to
            # 78, down 85 to 79): a rank-8 or -16 adapter no longer pays for 32 rows. Over 5 adapters (1737 a
            # segment, full chunks) 64-row tiles and 32-row rank steps were 1-7% faster.
            chunk = PREFILL_CHUNK_TOKENS
            short_prefill = not full_on_average(num_tokens, num_segments)
            block_m = 16 if short_prefill else 64
            if not segment_programs:
                # A program per 64-token chunk, so a prefill of few long segments still has thousands of
                # programs: counting segments narrowed 5 adapters' tiles to 32 columns.
                units = max(units, cdiv(num_tokens, chunk))
        elif few_adapter_graph(max_seg_len, live_segments, segment_programs):
            # A few-adapter graph's programs walk their segments whole unless kernel_shapes' graph_few_chunk
            # gives each program one chunk of them (a long segment then spreads over as many programs), or
            # graph_few_expand_deal deals the segments' token tiles out to the programs in turn.
            deal = shapes.graph_few_expand_deal
            chunk = 0 if deal else shapes.graph_few_chunk
    block_n = pow2_divisor(width, 128)
    if block_n < 16:
        block_n = 64
    while block_n > 32 and units * num_groups * n_tiles_of(block_n) < target:
        block_n //= 2
    if segmented:
        # Measured at batch 256 only; the launch-shape sweep at batch 64 found several tiles a program slower.
        graph_bound = max_seg_len is None and not segment_programs
        # `units` bounds a chunked launch's programs a column tile from below (a segment has a chunk at least,
        # a chunk at most `chunk` tokens): two tiles a program while that still fills the GPU.
        prefill_wide = (chunk > 0 and not segment_programs
                        and units * num_groups * cdiv(n_tiles_of(block_n), 2) >= target)
        graph_wide = graph_bound and num_tokens >= GRAPH_TILES_MIN_TOKENS
        if graph_wide:
            tiles = shapes.graph_expand_tiles or (4 if num_groups * n_tiles_of(block_n) >= GRAPH_WIDE_TILES else 2)
        else:
            tiles = 2 if prefill_wide else 1
        tiles = min(tiles, n_tiles_of(block_n))
        # 16-row rank steps where many adapters' mixed ranks share a launch: a chunked prefill of short
        # segments (above) and a graph planned for every segment (one replayed by steps of more than
        # cuda_graph_few_adapters adapters). On the H200 at batch 256 over 100 adapters (S2, ranks 8-64) the
        # latter's q,k,v expand took 43.8 against 48.9 µs with two tiles a program and 54.0 against 71.5 with
        # one (docs/results/graph_live_segments_expand_tiles.json); over 5 adapters, which replay the
        # few-adapter graphs, two tiles lost 5-14% with them.
        # kernel_shapes' expand_rank_whole: the graph's whole rank in one step (rank buckets reach 64).
        whole = graph_wide and shapes.expand_rank_whole and max_rank <= 64
        if whole:
            block_r = max(16, next_pow2(max_rank))
        else:
            block_r = 16 if max_rank <= 16 or short_prefill or graph_bound else 32
        # Launches of many short programs in 16-row tiles over many adapters' rows wait on their loads; fewer
        # registers a thread fit more programs on a multiprocessor (LaunchShapes.expand_registers). A few-adapter
        # graph's programs, walking or dealt many tiles each, keep the compiler's choice (they lost with the cap on
        # the H200), and so do 64-row tiles, whose accumulator alone needs 64 registers a thread.
        many_programs = (graph_bound or short_prefill) and not segment_programs
        return ExpandConfig(block_r=block_r, block_n=block_n, tiles_per_prog=tiles, block_m=block_m,
                            chunk_tokens=chunk, segment_programs=segment_programs,
                            cols_first=shapes.expand_cols_first, rank_whole=whole, deal_tiles=deal,
                            max_registers=shapes.expand_registers if many_programs else 0)
    return ExpandConfig(block_r=min(max(16, next_pow2(max_rank)), 64), block_n=block_n,
                        cols_first=shapes.expand_cols_first)


def lora_expand(y: torch.Tensor, v_buf: torch.Tensor, token_adapter: torch.Tensor, tables: LoraTables,
                modules: tuple[int, ...], out: torch.Tensor, out_dims: tuple[int, ...], *,
                seg_start: torch.Tensor | None = None, seg_adapter: torch.Tensor | None = None,
                token_order: torch.Tensor | None = None, max_seg_len: int | None = None,
                live_segments: int | None = None, num_live: torch.Tensor | None = None,
                segment_programs: int = 0, chunk_items=None, config: ExpandConfig | None = None,
                plan: dict | None = None) -> None:
    """Same contract as ops.reference.lora_expand (in place on `out`); segment arguments and `plan` as
    lora_shrink."""
    key = None
    if plan is not None:
        key = ("expand", tuple(modules), tuple(out_dims), tuple(y.shape), y.stride(), y.dtype, y.device,
               tuple(v_buf.shape), v_buf.stride(), v_buf.dtype, tuple(out.shape), out.stride(), out.dtype,
               id(token_adapter), id(tables), config)
        launch = plan.get(key)
        if launch is not None:
            launch(y, v_buf, out)
            return
    check_tensor("y", y, ndim=3, dtypes=FLOAT_DTYPES)
    device = y.device
    check_pool_buffer("v_buf", v_buf, device)
    check_tensor("token_adapter", token_adapter, ndim=1, dtypes=(torch.int32,), device=device, contiguous=True)
    check_tables(tables, device)
    modules = check_modules(modules)
    check_tensor("out", out, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    out_dims = tuple(int(d) for d in out_dims)
    num_groups = len(modules)
    num_tokens = out.shape[0]
    if len(out_dims) != num_groups:
        raise ValueError(f"out_dims {out_dims} must give one width per module of {modules}")
    if not all(d > 0 for d in out_dims):
        raise ValueError(f"out_dims must be positive, got {out_dims}")
    if sum(out_dims) != out.shape[1]:
        raise ValueError(f"out has {out.shape[1]} columns but out_dims sum to {sum(out_dims)}")
    if y.shape[0] != num_groups or y.shape[1] != num_tokens:
        raise ValueError(f"y must be [{num_groups}, {num_tokens}, max_rank], got {tuple(y.shape)}")
    if token_adapter.shape[0] != num_tokens:
        raise ValueError(f"token_adapter has {token_adapter.shape[0]} entries but out has {num_tokens} rows")
    segmented = seg_start is not None
    if segmented:
        check_segments(num_tokens, device, seg_start, seg_adapter, token_order)
    y_rank = y.shape[2]
    if num_tokens == 0 or y_rank == 0:
        return
    width = v_buf.shape[1]
    num_segments = seg_adapter.shape[0] if segmented else None
    cfg = config or choose_expand_config(num_tokens, num_groups, out_dims, width, y_rank, device, segmented,
                                         max_seg_len, num_segments, live_segments, segment_programs)
    aligned = width % cfg.block_n == 0 and cfg.block_n >= 16
    even = all(d % cfg.block_n == 0 for d in out_dims)
    n_col_groups = cdiv(cdiv(max(out_dims), cfg.block_n), cfg.tiles_per_prog)
    m0, m1, m2 = pad3(modules)
    d0, d1, d2 = pad3(out_dims)
    col_start = [sum(out_dims[:g]) for g in range(num_groups)]
    c0, c1, c2 = pad3(tuple(col_start))
    common = dict(BLOCK_R=cfg.block_r, BLOCK_N=cfg.block_n, ALIGNED=aligned, EVEN=even,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.max_registers:
        common["maxnreg"] = cfg.max_registers
    if segmented:
        seg = segment_form(cfg, num_tokens, max_seg_len, seg_start, seg_adapter, token_order, num_live, chunk_items,
                           y.dtype, device)
        common.update(seg.constexprs)
        if cfg.rank_whole and cfg.block_r < y_rank:
            raise ValueError(f"rank_whole: block_r {cfg.block_r} is below the batch's max rank {y_rank}")
        common["RANK_WHOLE"] = cfg.rank_whole
        common.update(deal_constexprs(cfg, seg, live_segments, num_segments))
        grid = (seg.axis, seg.chunks, num_groups * n_col_groups)
        kernel_fn = _expand_segment_kernel
    else:
        grid = (num_tokens, num_groups, n_col_groups)
        kernel_fn = _expand_token_kernel
    if cfg.cols_first and grid[0] > 65535 and config is None:
        cfg = replace(cfg, cols_first=False)  # a chosen shape, not one asked for: keep the order that fits
    if cfg.cols_first:
        # The grid's last axis holds at most 65535 programs: segments or tokens go there only as far as that.
        require(grid[0] <= 65535, f"cols_first: {grid[0]} segments or tokens exceed the grid's last axis")
        grid = (grid[2], grid[1], grid[0])
    common["COLS_FIRST"] = cfg.cols_first
    # A planned launch serves every layer of the step: its later layers may skip Triton's binding.
    kernel = CompiledLaunch(kernel_fn)[grid] if plan is not None else kernel_fn[grid]

    def launch(y: torch.Tensor, v_buf: torch.Tensor, out: torch.Tensor) -> None:
        """The kernel alone, for this shape: the tensors that change from layer to layer come in."""
        if not segmented:
            kernel(
                y, y.stride(0), y.stride(1), v_buf, v_buf.stride(0), token_adapter,
                tables.slots, tables.slots.stride(0), tables.ranks, tables.b_off,
                out, out.stride(0), width, y_rank, cfg.tiles_per_prog,
                m0, m1, m2, d0, d1, d2, c0, c1, c2, **common)
            return
        kernel(
            y, y.stride(0), y.stride(1), v_buf, v_buf.stride(0), *seg.args,
            tables.slots, tables.slots.stride(0), tables.ranks, tables.b_off,
            out, out.stride(0), width, y_rank, seg.chunk, n_col_groups, cfg.tiles_per_prog, num_segments, seg.programs,
            m0, m1, m2, d0, d1, d2, c0, c1, c2, **common)

    if plan is not None:
        plan[key] = launch
    launch(y, v_buf, out)
