"""RMSNorm, optionally fused with the residual add before it: one pass over the hidden state instead of
the eight small kernels the torch expression launches per norm.

Rounding follows the Hugging Face Llama module exactly: the residual sum is rounded to the model dtype,
the norm is computed in fp32 from that rounded value, cast back, then multiplied by the weight.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES, check_tensor, next_pow2
from .compiled_launch import CompiledLaunch


@triton.jit
def _rms_norm_kernel(x_ptr, stride_x, res_ptr, stride_r, w_ptr, out_ptr, stride_o, res_out_ptr, stride_ro,
                     hidden, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
    normed = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


_RMS_NORM = CompiledLaunch(_rms_norm_kernel)


def _launch(x, weight, eps, residual):
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=1, dtypes=(x.dtype,), device=x.device, contiguous=True)
    tokens, hidden = x.shape
    if weight.shape[0] != hidden:
        raise ValueError(f"weight has {weight.shape[0]} entries, x has {hidden} columns")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res_out = out
    if residual is not None:
        check_tensor("residual", residual, ndim=2, dtypes=(x.dtype,), device=x.device)
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} and x {tuple(x.shape)} differ")
        res_out = torch.empty_like(out)
    if tokens:
        block = next_pow2(hidden)
        _RMS_NORM[(tokens,)](x, x.stride(0), residual if residual is not None else x,
                                    residual.stride(0) if residual is not None else 0, weight, out, out.stride(0),
                                    res_out, res_out.stride(0), hidden, float(eps),
                                    HAS_RESIDUAL=residual is not None, BLOCK=block,
                                    num_warps=min(16, max(1, block // 256)))
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * norm(x)`, `[T, H]`."""
    return _launch(x, weight, eps, None)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, weight * norm(x + residual)): the new residual stream and the next layer's input."""
    out, summed = _launch(x, weight, eps, residual)
    return summed, out
