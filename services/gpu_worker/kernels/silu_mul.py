"""SwiGLU activation: silu(gate) * up from the fused gate/up output, in one pass (rounding as torch's
`F.silu(gate) * up` in the model dtype)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .checks import FLOAT_DTYPES, check_tensor
from .compiled_launch import CompiledLaunch


@triton.jit
def _silu_mul_kernel(gu_ptr, stride_g, out_ptr, stride_o, inter, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gu_ptr + t * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + t * stride_g + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


_SILU_MUL = CompiledLaunch(_silu_mul_kernel)


def silu_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """`[T, 2I]` (gate columns then up columns) -> `[T, I]`."""
    check_tensor("gate_up", gate_up, ndim=2, dtypes=FLOAT_DTYPES)
    tokens = gate_up.shape[0]
    if gate_up.shape[1] != 2 * intermediate:
        raise ValueError(f"gate_up has {gate_up.shape[1]} columns, expected 2 x {intermediate}")
    out = torch.empty(tokens, intermediate, dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        block = 1024
        _SILU_MUL[(tokens, triton.cdiv(intermediate, block))](gate_up, gate_up.stride(0), out, out.stride(0),
                                                                    intermediate, BLOCK=block, num_warps=4)
    return out
