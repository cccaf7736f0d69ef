"""Rotary position embedding applied in place to q and k in one launch (they are column ranges of the
fused qkv output, so no copy is made). Non-interleaved halves, the Hugging Face Llama convention."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES, check_tensor, next_pow2, require
from .compiled_launch import CompiledLaunch


@triton.jit
def _rotary_kernel(q_ptr, stride_qt, stride_qh, k_ptr, stride_kt, stride_kh, pos_ptr, cos_ptr, sin_ptr,
                   stride_c, num_q_heads, num_kv_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)
    cos1 = tl.load(cos_ptr + pos * stride_c + d).to(tl.float32)
    cos2 = tl.load(cos_ptr + pos * stride_c + HALF + d).to(tl.float32)
    sin1 = tl.load(sin_ptr + pos * stride_c + d).to(tl.float32)
    sin2 = tl.load(sin_ptr + pos * stride_c + HALF + d).to(tl.float32)
    h = tl.arange(0, BLOCK_H)
    for which in tl.static_range(2):
        if which == 0:
            base, stride_t, stride_h, heads = q_ptr, stride_qt, stride_qh, num_q_heads
        else:
            base, stride_t, stride_h, heads = k_ptr, stride_kt, stride_kh, num_kv_heads
        ptr = base + t.to(tl.int64) * stride_t + h[:, None] * stride_h + d[None, :]
        mask = (h < heads)[:, None]
        x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptr + HALF, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptr, (x1 * cos1[None, :] - x2 * sin1[None, :]).to(base.dtype.element_ty), mask=mask)
        tl.store(ptr + HALF, (x2 * cos2[None, :] + x1 * sin2[None, :]).to(base.dtype.element_ty), mask=mask)


_ROTARY = CompiledLaunch(_rotary_kernel)


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q `[T, Hq, hd]` and k `[T, Hkv, hd]` in place by the cos/sin rows `[max_pos, hd]` of each
    token's position; returns (q, k)."""
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor("k", k, ndim=3, dtypes=(q.dtype,), device=q.device)
    check_tensor("positions", positions, ndim=1, dtypes=(torch.int32, torch.int64), device=q.device, contiguous=True)
    check_tensor("cos", cos, ndim=2, dtypes=FLOAT_DTYPES, device=q.device, contiguous=True)
    check_tensor("sin", sin, ndim=2, dtypes=(cos.dtype,), device=q.device, contiguous=True)
    tokens, num_q_heads, head_dim = q.shape
    if not (k.shape[0] == tokens and k.shape[2] == head_dim):
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    if not (head_dim % 2 == 0 and next_pow2(head_dim // 2) == head_dim // 2):
        raise ValueError(f"head_dim must be twice a power of two, got {head_dim}")
    require(cos.shape[1] == head_dim and sin.shape == cos.shape, "cos/sin must be [max_positions, head_dim]")
    if tokens:
        _ROTARY[(tokens,)](q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), positions, cos, sin,
                                  cos.stride(0), num_q_heads, k.shape[1], HALF=head_dim // 2,
                                  BLOCK_H=next_pow2(max(num_q_heads, k.shape[1])), num_warps=4)
    return q, k
