"""A Triton kernel launched again, for the next layer of a step, without Triton's per-call binding.

`kernel[grid](*args)` binds every argument by name, works out each one's specialization (a tensor's dtype and
16-byte alignment, an int's "is 1" and "divisible by 16"), hashes those into the compile cache's key and looks
it up, and only then launches: 75-130 µs of host time a call on the H200 for the norm, rotary, attention
and activation kernels, ~100 of a LoRA shrink call's ~150 (benchmarks/lora_launch_cost.py,
docs/results/profile_prefill_running376_r10_host.txt). A prefill step makes ~320 such calls, which must all
be launched within the ~30 ms of the decode step running ahead of it or the GPU waits.

A step's layers call each kernel with the same ints and constexprs and only other tensors of the same
dtypes and alignment, so the kernel the first layer's call compiled (or found) is the one every later call
would find again. `CompiledLaunch` keeps it and, once it has checked exactly that, launches it straight
away through Triton's `CompiledKernel[grid]` runner; anything else goes through `kernel[grid]`. Off unless
`set_enabled(True)` (worker.direct_launch): a launch path is proven on the GPU before it is the default.
Under TRITON_INTERPRET there is no compiled kernel and every call takes the ordinary path.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

_enabled = False
_direct_calls = 0  # launches that skipped Triton's binding, in this process (tests and benchmarks read it)


def set_enabled(on: bool) -> None:
    global _enabled
    _enabled = bool(on)


def direct_calls() -> int:
    return _direct_calls


def _compiled_kernel_type():
    try:
        from triton.compiler import CompiledKernel
    except ImportError:  # a Triton without it: the ordinary path only
        return None
    return CompiledKernel


def _fingerprint(args: tuple) -> tuple:
    """What Triton's specialization reads of the positional arguments, or more: tensors by dtype, device and
    whether their address is 16-byte aligned (never by address: that changes every layer), anything else by
    type and value (True == 1 == 1.0 in Python, but not to Triton)."""
    return tuple((a.dtype, a.device, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else (a.__class__, a)
                 for a in args)


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


@dataclass
class _Capture:
    """One compiled kernel and the arguments that, given again, make Triton pick it again."""

    runner_of: object  # the CompiledKernel: runner_of[grid] launches it
    fingerprint: tuple
    kwargs: dict
    tail: tuple  # the constexprs' values, in parameter order, after the positional arguments


class CompiledLaunch:
    """`CompiledLaunch(kernel)[grid](*args, **kwargs)` launches what `kernel[grid](*args, **kwargs)` launches.
    `args` are every non-constexpr parameter, in order; `kwargs` the constexprs and launch options
    (num_warps, num_stages). The last few kernels a call compiled or found are kept (a launcher calls one
    kernel in a few variants: a norm with and without the residual, shrink for q,k,v and for o)."""

    KEEP = 4

    def __init__(self, fn):
        self.fn = fn
        self.captures: list[_Capture] = []
        if fn not in _layouts:
            _layouts[fn] = _layout(fn)
        self.layout = _layouts[fn]

    def __getitem__(self, grid):
        if not _enabled:
            return self.fn[grid]  # off (the default): Triton's own launch, nothing added to it
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _launch(self, grid, args: tuple, kwargs: dict) -> None:
        global _direct_calls
        if self.captures:
            fingerprint = _fingerprint(args)
            for c in self.captures:
                if c.fingerprint == fingerprint and c.kwargs == kwargs:
                    c.runner_of[tuple(grid) + (1,) * (3 - len(grid))](*args, *c.tail)
                    _direct_calls += 1
                    return
        kernel = self.fn[grid](*args, **kwargs)
        if self.layout is None:
            return
        compiled = _compiled_kernel_type()
        if compiled is None or not isinstance(kernel, compiled):
            return
        n_args, names, defaults = self.layout
        if len(args) != n_args or any(n not in kwargs and n not in defaults for n in names):
            return
        tail = tuple(kwargs[n] if n in kwargs else defaults[n] for n in names)
        self.captures.insert(0, _Capture(kernel, _fingerprint(args), dict(kwargs), tail))
        del self.captures[self.KEEP:]
