"""A Triton kernel launched again, for another layer of the same step, without Triton's per-call binding.

`kernel[grid](*args)` binds every argument by name, works out each one's specialization (a tensor's dtype and
16-byte alignment, an int's "is 1" and "divisible by 16"), hashes those into the compile cache's key and looks
it up, and only then launches. For the LoRA kernels' ~40 arguments that is most of a call's ~100-150 µs of
host time on the H200 (benchmarks/lora_launch_cost.py), and a prefill step makes 128 such calls, which must
all be launched within the ~30 ms of the decode step running ahead of it or the GPU waits.

A step's layers call each kernel with the same grid, the same ints and constexprs and only other tensors of
the same dtypes and alignment, so the kernel the first layer's call compiled (or found) is the one every
later call would find again. `CompiledLaunch` keeps it and launches it straight away through Triton's
`CompiledKernel[grid]` runner once it has checked exactly that; anything else goes through `kernel[grid]`.
Off unless `set_enabled(True)` (worker.direct_launch): a launch path is proven on the GPU before it is the
default. Under TRITON_INTERPRET there is no compiled kernel and every call takes the ordinary path.
"""
from __future__ import annotations

import inspect

import torch

_enabled = False
_direct_calls = 0  # launches that skipped Triton's binding, in this process (tests and benchmarks read it)


def set_enabled(on: bool) -> None:
    global _enabled
    _enabled = bool(on)


def enabled() -> bool:
    return _enabled


def direct_calls() -> int:
    return _direct_calls


def _compiled_kernel_type():
    try:
        from triton.compiler import CompiledKernel
    except ImportError:  # a Triton without it: the ordinary path only
        return None
    return CompiledKernel


def _fingerprint(args: tuple) -> tuple:
    """What Triton's specialization reads of the positional arguments: ints by value, tensors by dtype,
    device and whether their address is 16-byte aligned (never by address: that changes every layer)."""
    return tuple((a.dtype, a.device, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else a for a in args)


def _layout(fn) -> tuple[int, tuple[str, ...], dict] | None:
    """(number of non-constexpr parameters, constexpr names, their defaults) when every constexpr comes after
    every other parameter, which is how the runner takes them; None otherwise (never launched direct)."""
    params = getattr(fn, "params", None)
    if not params:
        return None
    flags = [p.is_constexpr for p in params]
    n_args = flags.index(True) if True in flags else len(flags)
    if any(not f for f in flags[n_args:]):
        return None
    defaults = {p.name: p.default for p in params[n_args:] if p.default is not inspect.Parameter.empty}
    return n_args, tuple(p.name for p in params[n_args:]), defaults


_layouts: dict = {}  # kernel -> _layout(kernel)


class CompiledLaunch:
    """`launch(*args, **kwargs)` does what `fn[grid](*args, **kwargs)` does. `args` are every non-constexpr
    parameter, in order; `kwargs` the constexprs and launch options (num_warps, num_stages)."""

    def __init__(self, fn, grid: tuple[int, ...]):
        self.fn = fn
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.runner = None  # the compiled kernel's launcher for this grid, once a first call has compiled it
        self.fingerprint: tuple | None = None
        self.kwargs: dict | None = None
        self.tail: tuple = ()  # the constexprs' values, in parameter order, after the positional arguments
        if fn not in _layouts:
            _layouts[fn] = _layout(fn)
        self.layout = _layouts[fn]

    def __call__(self, *args, **kwargs) -> None:
        global _direct_calls
        if self.runner is not None and _enabled and kwargs == self.kwargs and _fingerprint(args) == self.fingerprint:
            self.runner(*args, *self.tail)
            _direct_calls += 1
            return
        kernel = self.fn[self.grid](*args, **kwargs)
        compiled = _compiled_kernel_type()
        # The first call's kernel is kept: a layer whose tensor happens to sit off alignment keeps the others'.
        if not (_enabled and self.runner is None and self.layout is not None and compiled is not None
                and isinstance(kernel, compiled)):
            return
        n_args, names, defaults = self.layout
        if len(args) != n_args or any(n not in kwargs and n not in defaults for n in names):
            return
        self.tail = tuple(kwargs[n] if n in kwargs else defaults[n] for n in names)
        self.kwargs = dict(kwargs)
        self.fingerprint = _fingerprint(args)
        self.runner = kernel[self.grid]
