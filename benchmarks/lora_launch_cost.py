"""Host time of one LoRA shrink or expand call in an admission step, split into our launcher's own work and
Triton's launch path, beside plain Triton kernels of 3 and of 40 arguments, and with the step's launch plan
(the first layer's launch reused by the others), and with that plan's later calls launched direct, skipping
Triton's argument binding (kernels/compiled_launch.py).

An admission step over 100 adapters beside 376 decoding requests launches in ~58 ms against ~31 ms base-only,
and the 128 shrink and expand calls take 183 and 155 µs each on the host (docs/benchmarks.md, S2 at 384 with
steps launched ahead). This says how much of that a launch plan bound once per step could save (the
launcher's checks and launch-shape choice), and how much is Triton's per-call argument handling, which grows
with the argument count.

    python benchmarks/lora_launch_cost.py --out launch_cost.txt          # Llama-2-7B shapes on a GPU
    TRITON_INTERPRET=1 python benchmarks/lora_launch_cost.py --tiny      # the script itself, on a CPU
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

from services.gpu_worker.kernels import lora_expand as _expand_fn  # noqa: F401 (loads the modules)
from services.gpu_worker.kernels.compiled_launch import direct_calls
from services.gpu_worker.kernels.compiled_launch import set_enabled as set_direct
from services.gpu_worker.kernels.lora_groups import chunk_count, group_tokens_by_adapter
from services.gpu_worker.ops.meta import LoraTables

SHRINK = sys.modules["services.gpu_worker.kernels.lora_shrink"]
EXPAND = sys.modules["services.gpu_worker.kernels.lora_expand"]


@triton.jit
def _three_args(out_ptr, n, value, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.full([BLOCK], value, tl.int32), mask=offs < n)


@triton.jit
def _forty_args(out_ptr, p1, p2, p3, p4, p5, p6, p7, p8, p9,
                n, i1, i2, i3, i4, i5, i6, i7, i8, i9, i10, i11, i12, i13, i14, i15, i16, i17, i18, i19,
                i20, i21, i22, i23, i24, i25, i26, i27, i28, i29, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.full([BLOCK], i29, tl.int32), mask=offs < n)


class _NoLaunch:
    """Stands in for a Triton kernel: `kernel[grid](...)` does nothing, so only the launcher's work is timed."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def per_call_us(fn, calls: int, device: torch.device) -> float:
    """Median host µs of one call over `calls` calls, in batches of 16 launched back to back."""
    samples = []
    for _ in range(max(1, calls // 16)):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(16):
            fn()
        samples.append((time.perf_counter() - t0) * 1e6 / 16)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tiny", action="store_true", help="small shapes (a CPU under TRITON_INTERPRET=1)")
    p.add_argument("--tokens", type=int, default=3500, help="tokens in the step (an admission step at batch 384)")
    p.add_argument("--adapters", type=int, default=100)
    p.add_argument("--calls", type=int, default=256)
    p.add_argument("--out", default="launch_cost.txt")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hidden, tokens, adapters, calls = (64, 24, 3, 16) if args.tiny else (4096, args.tokens, args.adapters, args.calls)
    slots_per_adapter = 2 * 4 * 64  # A and Bᵀ rows of q,k,v,o at rank 64, one slot each (width = hidden)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    buf = (torch.randn(adapters * slots_per_adapter, hidden, generator=g) * 0.01).to(device, dtype)
    token_adapter = torch.randint(0, adapters, (tokens,), generator=g, dtype=torch.int32)
    lengths = tuple(int(c) for c in torch.bincount(token_adapter.long(), minlength=adapters) if c > 0)
    slots = torch.arange(adapters * slots_per_adapter, dtype=torch.int32).view(adapters, slots_per_adapter)
    ranks = torch.zeros(adapters, 7, dtype=torch.int32)
    ranks[:, :4] = 64
    offsets = torch.zeros(adapters, 7, dtype=torch.int32)
    offsets[:, :4] = torch.arange(4, dtype=torch.int32) * 64
    tables = LoraTables(slots.to(device), ranks.to(device), offsets.to(device), (offsets + 256).to(device))
    token_adapter = token_adapter.to(device)
    groups = group_tokens_by_adapter(token_adapter, adapters, len(lengths), num_chunks=chunk_count(lengths))
    hints = {**groups.kwargs(), "max_seg_len": max(lengths), "live_segments": None, "segment_programs": 0}
    out = torch.zeros(tokens, 3 * hidden, device=device, dtype=dtype)
    modules, dims = (0, 1, 2), (hidden, hidden, hidden)

    def shrink():
        return SHRINK.lora_shrink(x, buf, token_adapter, tables, modules, 64, **hints)

    y = shrink()

    def expand():
        EXPAND.lora_expand(y, buf, token_adapter, tables, modules, out, dims, **hints)

    expand()  # compiled before timing
    small = torch.zeros(64, dtype=torch.int32, device=device)
    ptrs = [torch.zeros(16, dtype=torch.int32, device=device) for _ in range(9)]

    def three():
        _three_args[(1,)](small, 64, 7, BLOCK=64)

    def forty():
        _forty_args[(1,)](small, *ptrs, 64, *range(1, 30), BLOCK=64)

    plan: dict = {}  # the step's launch plan (ops/triton_backend.prepare_lora), primed by a first layer

    def shrink_planned():
        return SHRINK.lora_shrink(x, buf, token_adapter, tables, modules, 64, plan=plan, **hints)

    def expand_planned():
        EXPAND.lora_expand(y, buf, token_adapter, tables, modules, out, dims, plan=plan, **hints)

    direct_plan: dict = {}  # the same, its later layers launched direct (worker.direct_launch)

    def shrink_direct():
        return SHRINK.lora_shrink(x, buf, token_adapter, tables, modules, 64, plan=direct_plan, **hints)

    def expand_direct():
        EXPAND.lora_expand(y, buf, token_adapter, tables, modules, out, dims, plan=direct_plan, **hints)

    three(), forty(), shrink_planned(), expand_planned()
    rows = {"lora_shrink (q,k,v), without a plan": per_call_us(shrink, calls, device),
            "lora_expand (q,k,v), without a plan": per_call_us(expand, calls, device),
            "lora_shrink (q,k,v), the step's plan reused": per_call_us(shrink_planned, calls, device),
            "lora_expand (q,k,v), the step's plan reused": per_call_us(expand_planned, calls, device),
            "Triton kernel of 3 arguments": per_call_us(three, calls, device),
            "Triton kernel of 40 arguments": per_call_us(forty, calls, device)}
    set_direct(True)
    try:
        before = direct_calls()
        shrink_direct(), expand_direct()
        rows["lora_shrink (q,k,v), plan reused, launched direct"] = per_call_us(shrink_direct, calls, device)
        rows["lora_expand (q,k,v), plan reused, launched direct"] = per_call_us(expand_direct, calls, device)
        if device.type == "cuda" and direct_calls() == before:
            raise RuntimeError("no launch went direct: the rows above timed Triton's ordinary path")
    finally:
        set_direct(False)
    kernels = {m: {n: getattr(m, n) for n in dir(m) if n.startswith("_") and n.endswith("_kernel")}
               for m in (SHRINK, EXPAND)}
    try:
        for m, named in kernels.items():
            for n in named:
                setattr(m, n, _NoLaunch())
        rows["lora_shrink, launcher only (kernels stubbed)"] = per_call_us(shrink, calls, device)
        rows["lora_expand, launcher only (kernels stubbed)"] = per_call_us(expand, calls, device)
    finally:
        for m, named in kernels.items():
            for n, kernel in named.items():
                setattr(m, n, kernel)
    if device.type == "cuda":
        torch.cuda.synchronize()
    lines = [f"host µs per call, median of batches of 16 ({device.type}, {tokens} tokens over {len(lengths)} "
             f"adapters, width {hidden}; torch {torch.__version__}, triton {triton.__version__})"]
    lines += [f"  {name:<48} {us:>8.1f}" for name, us in rows.items()]
    text = "\n".join(lines)
    with open(args.out, "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
