"""Argument checks shared by the kernel launchers, and the few launch-shape helpers they all use.

A kernel reads raw pointers: a wrong dtype, a transposed view or a tensor on another device would give
silently wrong numbers or a fault far from the cause. Every launcher checks its arguments here first and
names the argument and the problem.
"""
from __future__ import annotations

import functools

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def require(cond: bool, message: str) -> None:
    """For checks off the per-launch path; a launcher's own checks test first and format a message only
    when they fail (an f-string per check per launch costs more than the launch's other host work)."""
    if not cond:
        raise ValueError(message)


def check_tensor(name: str, t, *, ndim: int, dtypes: tuple[torch.dtype, ...], device: torch.device | None = None,
                 unit_last_stride: bool = True, contiguous: bool = False) -> None:
    """Type, rank, dtype, device and layout of one kernel argument."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other inputs are on {device}")
    if contiguous:
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (got strides {t.stride()} for shape {tuple(t.shape)})")
    elif unit_last_stride and t.numel() > 0 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dimension (got strides {t.stride()})")


def check_modules(modules) -> tuple[int, ...]:
    """A fused module group: 1 to 3 distinct module indices (q,k,v is the largest group)."""
    modules = tuple(int(m) for m in modules)
    if not 1 <= len(modules) <= 3:
        raise ValueError(f"modules must name 1 to 3 modules of one fused group, got {modules}")
    if not all(0 <= m < 7 for m in modules):
        raise ValueError(f"module indices must be in 0..6 (MODULES order), got {modules}")
    if len(set(modules)) != len(modules):
        raise ValueError(f"modules must be distinct, got {modules}")
    return modules


def pad3(values: tuple[int, ...], fill: int = 0) -> tuple[int, int, int]:
    """Per-module scalars of a group, padded to the kernels' three slots."""
    return tuple(values) + (fill,) * (3 - len(values))  # type: ignore[return-value]


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pow2_divisor(n: int, cap: int) -> int:
    """Largest power of two <= cap that divides n."""
    b = cap
    while b > 1 and n % b:
        b //= 2
    return b


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessors to fill; on the CPU interpreter a small constant keeps grids tiny."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4
