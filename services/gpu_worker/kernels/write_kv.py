"""Store a step's new K/V rows into the pool at their slots (one token per slot, all KV heads in a row).

One program copies one tile of one token's K and V rows; slots are arbitrary (the free list hands out
ids in any order), so each row is a scatter but every row is a contiguous, vectorised copy.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES, check_tensor, pow2_divisor
from .compiled_launch import CompiledLaunch


@triton.jit
def _write_kv_kernel(k_ptr, stride_kt, v_ptr, stride_vt, slots_ptr, k_buf_ptr, stride_kb, v_buf_ptr, stride_vb,
                     width, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    src = t.to(tl.int64)
    if EVEN:
        k = tl.load(k_ptr + src * stride_kt + cols)
        v = tl.load(v_ptr + src * stride_vt + cols)
        tl.store(k_buf_ptr + slot * stride_kb + cols, k.to(k_buf_ptr.dtype.element_ty))
        tl.store(v_buf_ptr + slot * stride_vb + cols, v.to(v_buf_ptr.dtype.element_ty))
    else:
        mask = cols < width
        k = tl.load(k_ptr + src * stride_kt + cols, mask=mask)
        v = tl.load(v_ptr + src * stride_vt + cols, mask=mask)
        tl.store(k_buf_ptr + slot * stride_kb + cols, k.to(k_buf_ptr.dtype.element_ty), mask=mask)
        tl.store(v_buf_ptr + slot * stride_vb + cols, v.to(v_buf_ptr.dtype.element_ty), mask=mask)


_WRITE_KV = CompiledLaunch(_write_kv_kernel)


def write_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Same contract as ops.reference.write_kv: rows `[T, W]` of k and v go to row slots[t] of the buffers.
    Slots must be distinct and in range (the allocator guarantees both; checking would need a host sync)."""
    check_tensor("k_buf", k_buf, ndim=2, dtypes=FLOAT_DTYPES)
    device = k_buf.device
    check_tensor("v_buf", v_buf, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    check_tensor("slots", slots, ndim=1, dtypes=(torch.int32,), device=device, contiguous=True)
    check_tensor("k", k, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    check_tensor("v", v, ndim=2, dtypes=FLOAT_DTYPES, device=device)
    width = k_buf.shape[1]
    if v_buf.shape != k_buf.shape:
        raise ValueError(f"k_buf {tuple(k_buf.shape)} and v_buf {tuple(v_buf.shape)} differ")
    if not (k.shape == v.shape == (slots.shape[0], width)):
        raise ValueError(f"k and v must be [{slots.shape[0]}, {width}] (one row per slot), got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")
    num_tokens = slots.shape[0]
    if num_tokens == 0:
        return
    block = pow2_divisor(width, 1024)
    if block < 64:
        block = 128
    even = width % block == 0
    _WRITE_KV[(num_tokens, triton.cdiv(width, block))](
        k, k.stride(0), v, v.stride(0), slots, k_buf, k_buf.stride(0), v_buf, v_buf.stride(0), width,
        BLOCK=block, EVEN=even, num_warps=4 if block >= 512 else 1)
