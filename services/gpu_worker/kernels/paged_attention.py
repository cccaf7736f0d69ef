"""Causal attention of a step's new tokens over their paged context (slot table, one token per page).

One kernel serves decode and prefill/extend. A program takes one sequence, one KV head and a block of
BLOCK_Q new tokens; its rows are those tokens times the KV head's group of query heads (GQA), so each K/V
row is loaded once for the whole group. The context is streamed in BLOCK_N tokens gathered through the
slot table, with an online softmax in base 2.

Decode (one new token per sequence) has far fewer rows than a tile, and B x KV heads programs may not fill
the GPU, so the context is split (flash-decoding): each split writes an unnormalised partial (acc, max,
sum) and a second launch combines them, weighting each by 2^(max_s - max), which is exact and stable.
The same split applies to short extends over long contexts. K/V of the new tokens are already in the pool
(write_kv runs first), so prefill reads the prompt from the pool like any context.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..ops.meta import AttnMeta
from .checks import FLOAT_DTYPES, cdiv, check_tensor, next_pow2, num_sms, require
from .compiled_launch import CompiledLaunch
from .launch_shapes import launch_shapes

_LOG2E = 1.4426950408889634


# A mixed step's batches are slices of its metadata (split_decode below) at any sequence: specialized, the
# alignment of q_start and ctx_lens and the first token's index made new variants of the same launch shape as
# traffic moved the split (built under load on an H100, docs/benchmarks.md 2026-12-06 18:58). Each is a scalar
# read once a program, so the hints bought nothing. The slot table's are kept: its rows are read as vectors.
@triton.jit(do_not_specialize=["q_start_ptr", "ctx_lens_ptr", "first_token"])
def _attention_kernel(
    q_ptr, stride_qt, stride_qh, k_ptr, stride_k, v_ptr, stride_v,
    q_start_ptr, ctx_lens_ptr, slot_table_ptr, stride_st,
    out_ptr, stride_ot, stride_oh, part_ptr, ml_ptr,
    qk_scale, num_heads, head_dim, n_split, split_len, first_token,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    if HEADS_FIRST:
        kvh, b = tl.program_id(0), tl.program_id(1)
    else:
        b, kvh = tl.program_id(0), tl.program_id(1)
    q_block = tl.program_id(2) // n_split
    split = tl.program_id(2) % n_split
    q_lo = tl.load(q_start_ptr + b)
    q_len = tl.load(q_start_ptr + b + 1) - q_lo
    if q_block * BLOCK_Q >= q_len:
        return
    ctx = tl.load(ctx_lens_ptr + b)

    r = tl.arange(0, BLOCK_M)
    qi = q_block * BLOCK_Q + r // GROUP_P
    hh = r % GROUP_P
    row_valid = (qi < q_len) & (hh < GROUP)
    head = kvh * GROUP + hh
    q_pos = ctx - q_len + qi
    tok = (q_lo + qi).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    # With head_dim == BLOCK_D the masks are per row only, which keeps the loads 16 bytes wide.
    if EVEN_D:
        store_mask = row_valid[:, None]
    else:
        store_mask = row_valid[:, None] & (d < head_dim)[None, :]
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=store_mask, other=0.0)

    # Keys this program may need: up to the last new token of its block (causal), within its split.
    kv_hi = ctx - q_len + tl.minimum(q_len, (q_block + 1) * BLOCK_Q)
    lo = split * split_len
    hi = tl.minimum(kv_hi, lo + split_len)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = slot_table_ptr + b.to(tl.int64) * stride_st
    head_col = kvh * head_dim
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        k_valid = pos < hi
        slot = tl.load(table + pos, mask=k_valid, other=0).to(tl.int64)
        if EVEN_D:
            kv_mask = k_valid[:, None]
        else:
            kv_mask = k_valid[:, None] & (d < head_dim)[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_k + head_col + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
        s = tl.where(k_valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + slot[:, None] * stride_v + head_col + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        m_i = m_new

    if SPLIT:
        # Partials [T, Hq, n_split, head_dim] and (max, sum) pairs [T, Hq, n_split, 2], all fp32, for the
        # launch's tokens from first_token on.
        row = ((tok - first_token) * num_heads + head) * n_split + split
        tl.store(part_ptr + row[:, None] * head_dim + d[None, :], acc, mask=store_mask)
        tl.store(ml_ptr + row * 2, m_i, mask=row_valid)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=row_valid)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _combine_kernel(part_ptr, ml_ptr, out_ptr, stride_ot, stride_oh, num_heads, head_dim, n_split, first_token,
                    SPLIT_P: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLIT_P)
    sp_mask = sp < n_split
    row = (t.to(tl.int64) * num_heads + h) * n_split + sp
    t = t + first_token
    m = tl.load(ml_ptr + row * 2, mask=sp_mask, other=float("-inf"))
    l = tl.load(ml_ptr + row * 2 + 1, mask=sp_mask, other=0.0)
    w = tl.math.exp2(m - tl.max(m, axis=0))
    denom = tl.sum(w * l, axis=0)
    d = tl.arange(0, BLOCK_D)
    acc = tl.load(part_ptr + row[:, None] * head_dim + d[None, :], mask=sp_mask[:, None] & (d < head_dim)[None, :],
                  other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / denom
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < head_dim)


_ATTENTION = CompiledLaunch(_attention_kernel)
_COMBINE = CompiledLaunch(_combine_kernel)


@dataclass(frozen=True)
class AttentionConfig:
    block_q: int  # new tokens per program (rows = block_q x padded group)
    block_n: int  # context tokens per iteration
    n_split: int  # context splits (combined by a second launch when > 1)
    # Programs launched KV head first: those running side by side then read all heads of the same slots
    # (whole pool rows) rather than one head's 256 bytes from the slots of many sequences.
    heads_first: bool = False
    num_warps: int = 4
    num_stages: int = 2


def choose_attention_config(meta: AttnMeta, num_kv_heads: int, group: int, head_dim: int,
                            device: torch.device) -> AttentionConfig:
    """Splits of at most 1024 context tokens, and at least ~4 programs per multiprocessor: enough programs
    that no multiprocessor idles behind a few long ones, few enough that partials and the combine stay
    cheap (the split counts measured best on the H200, docs/benchmarks.md)."""
    group_p = next_pow2(group)
    rows = 16 if meta.decode_only else 64
    block_q = max(1, rows // group_p)
    n_q_blocks = cdiv(max(meta.max_q_len, 1), block_q)
    units = meta.num_seqs * num_kv_heads * n_q_blocks
    ctx = max(meta.max_ctx_len, 1)
    n_split = 1
    if meta.decode_only or meta.max_q_len <= 16:
        n_split = max(cdiv(4 * num_sms(device), max(units, 1)), cdiv(ctx, 1024))
        n_split = max(1, min(n_split, cdiv(ctx, 128)))
    shapes = launch_shapes()
    heads_first = shapes.heads_first and meta.num_seqs <= 65535  # sequences on the grid's second axis
    if meta.decode_only:
        block_n = shapes.attention_block_n or (128 if head_dim <= 128 else 32)
        return AttentionConfig(block_q=block_q, block_n=block_n, n_split=n_split, heads_first=heads_first,
                               num_warps=shapes.attention_warps or 4, num_stages=shapes.attention_stages or 3)
    return AttentionConfig(block_q=block_q, block_n=64 if head_dim <= 128 else 32, n_split=n_split,
                           heads_first=heads_first)


def attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, meta: AttnMeta, scale: float, *,
              out: torch.Tensor | None = None, config: AttentionConfig | None = None,
              split_decode: bool | None = None) -> torch.Tensor:
    """Same contract as ops.reference.attention: q `[T, Hq, hd]` -> `[T, Hq, hd]` in q's dtype.
    split_decode: launch a mixed step's leading decode sequences (meta.decode_seqs) apart from the rest, each
    with the launch shape chosen for it (None: the worker's kernel_shapes say, `split_mixed`, on by default,
    unless a config is given: on the H200 a mixed step's attention took 0.55-0.64 of one launch's time,
    gpu_proof's attention_mixed section)."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    device = q.device
    check_tensor("k_buf", k_buf, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    check_tensor("v_buf", v_buf, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    num_tokens, num_heads, head_dim = q.shape
    width = k_buf.shape[1]
    if v_buf.shape != k_buf.shape:
        raise ValueError(f"k_buf {tuple(k_buf.shape)} and v_buf {tuple(v_buf.shape)} differ")
    if not (head_dim > 0 and width % head_dim == 0):
        raise ValueError(f"pool width {width} is not a multiple of head_dim {head_dim}")
    num_kv_heads = width // head_dim
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads do not split evenly over {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    check_tensor("meta.q_start", meta.q_start, ndim=1, dtypes=(torch.int32,), device=device, contiguous=True)
    check_tensor("meta.ctx_lens", meta.ctx_lens, ndim=1, dtypes=(torch.int32,), device=device, contiguous=True)
    check_tensor("meta.slot_table", meta.slot_table, ndim=2, dtypes=(torch.int32,), device=device)
    num_seqs = meta.num_seqs
    if meta.q_start.shape[0] != num_seqs + 1:
        raise ValueError(f"meta.q_start must have {num_seqs + 1} entries (B + 1), got {meta.q_start.shape[0]}")
    if not (meta.slot_table.shape[0] == num_seqs and meta.slot_table.shape[1] >= meta.max_ctx_len):
        raise ValueError(f"meta.slot_table must be [{num_seqs}, >= max_ctx_len={meta.max_ctx_len}], got "
                         f"{tuple(meta.slot_table.shape)}")
    if meta.decode_only:
        if num_tokens != num_seqs:
            raise ValueError(f"decode_only batch must have one token per sequence: {num_tokens} tokens, "
                             f"{num_seqs} sequences")
    if out is None:
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=device)
    else:
        check_tensor("out", out, ndim=3, dtypes=(q.dtype,), device=device)
        if out.shape != q.shape:
            raise ValueError(f"out must have q's shape {tuple(q.shape)}, got {tuple(out.shape)}")
    if num_tokens == 0 or num_seqs == 0:
        return out
    if split_decode is None:
        split_decode = launch_shapes().split_mixed and config is None
    if split_decode and not meta.decode_only and 0 < meta.decode_seqs < num_seqs:
        # The decode rows in decode-shaped tiles (16 rows, long blocks, split contexts), the prompts in prompt-
        # shaped ones: one launch would give each decode row a whole 64-row tile. Both write their own tokens.
        decode, rest = split_decode_rows(meta)
        for part_meta, first, count in ((decode, 0, meta.decode_seqs),
                                        (rest, meta.decode_seqs, num_tokens - meta.decode_seqs)):
            cfg = choose_attention_config(part_meta, num_kv_heads, group, head_dim, device)
            _launch(q, k_buf, v_buf, part_meta, scale, out, cfg, group, num_kv_heads, first, count)
        return out
    cfg = config or choose_attention_config(meta, num_kv_heads, group, head_dim, device)
    _launch(q, k_buf, v_buf, meta, scale, out, cfg, group, num_kv_heads, 0, num_tokens)
    return out


def split_decode_rows(meta: AttnMeta) -> tuple[AttnMeta, AttnMeta]:
    """A mixed step's leading decode sequences and the rest, as two batches over the same tokens: q_start holds
    offsets into the whole step's tokens, so slices of it serve as they are."""
    k = meta.decode_seqs
    decode = AttnMeta(q_start=meta.q_start[: k + 1], ctx_lens=meta.ctx_lens[:k], slot_table=meta.slot_table[:k],
                      max_q_len=1, max_ctx_len=max(meta.decode_max_ctx, 1), decode_only=True)
    rest = AttnMeta(q_start=meta.q_start[k:], ctx_lens=meta.ctx_lens[k:], slot_table=meta.slot_table[k:],
                    max_q_len=meta.max_q_len, max_ctx_len=meta.max_ctx_len, decode_only=False)
    return decode, rest


def _launch(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, meta: AttnMeta, scale: float,
            out: torch.Tensor, cfg: AttentionConfig, group: int, num_kv_heads: int, first_token: int,
            num_tokens: int) -> None:
    """One attention launch (and its combine) over `meta`'s sequences, whose new tokens are q's rows
    first_token .. first_token + num_tokens - 1."""
    num_seqs = meta.num_seqs
    _, num_heads, head_dim = q.shape
    device = q.device
    group_p = next_pow2(group)
    block_d = max(16, next_pow2(head_dim))
    require(cfg.block_q * group_p >= 16, "config.block_q x padded group must be at least 16 rows (tl.dot tile)")
    n_q_blocks = cdiv(max(meta.max_q_len, 1), cfg.block_q)
    split_len = cdiv(cdiv(max(meta.max_ctx_len, 1), cfg.n_split), cfg.block_n) * cfg.block_n
    n_split = cdiv(max(meta.max_ctx_len, 1), split_len)
    if n_q_blocks * n_split > 65535:
        raise ValueError(f"{n_q_blocks} query blocks x {n_split} splits exceed the grid limit")
    split = n_split > 1
    if split:
        part = torch.empty(num_tokens, num_heads, n_split, head_dim, dtype=torch.float32, device=device)
        ml = torch.empty(num_tokens, num_heads, n_split, 2, dtype=torch.float32, device=device)
    else:
        part = ml = out
    if cfg.heads_first:
        require(num_seqs <= 65535, f"heads_first: {num_seqs} sequences exceed the grid's second axis")
        grid = (num_kv_heads, num_seqs, n_q_blocks * n_split)
    else:
        grid = (num_seqs, num_kv_heads, n_q_blocks * n_split)
    _ATTENTION[grid](
        q, q.stride(0), q.stride(1), k_buf, k_buf.stride(0), v_buf, v_buf.stride(0),
        meta.q_start, meta.ctx_lens, meta.slot_table, meta.slot_table.stride(0),
        out, out.stride(0), out.stride(1), part, ml,
        float(scale) * _LOG2E, num_heads, head_dim, n_split, split_len, first_token,
        GROUP=group, GROUP_P=group_p, BLOCK_Q=cfg.block_q, BLOCK_N=cfg.block_n, BLOCK_D=block_d,
        EVEN_D=block_d == head_dim, SPLIT=split, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        HEADS_FIRST=cfg.heads_first, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split:
        _COMBINE[(num_tokens, num_heads)](
            part, ml, out, out.stride(0), out.stride(1), num_heads, head_dim, n_split, first_token,
            SPLIT_P=max(2, next_pow2(n_split)), BLOCK_D=block_d, num_warps=1 if block_d <= 64 else 4)
