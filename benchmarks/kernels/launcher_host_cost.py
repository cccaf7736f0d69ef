"""Host time of the LoRA launchers before their kernels run: argument checks, launch shape, grid, on the
kernels' real Python path with the Triton launch itself left out (each kernel object is swapped for one
that records its grid and returns). Needs no GPU: an eager step calls each launcher once per fused group
and layer (S-GQA: 4 groups x 32 layers x shrink and expand), so this time is paid ~256 times per eager step
on top of Triton's own launch cost.

    python -m benchmarks.kernels.launcher_host_cost --calls 2000
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from contextlib import contextmanager

import torch

from services.gpu_worker.ops.meta import LoraTables

# The modules, not the launchers the package exports under the same names.
shrink_mod = importlib.import_module("services.gpu_worker.kernels.lora_shrink")
expand_mod = importlib.import_module("services.gpu_worker.kernels.lora_expand")

KERNELS = ((shrink_mod, ("_shrink_token_kernel", "_shrink_segment_kernel", "_shrink_finalize_kernel")),
           (expand_mod, ("_expand_token_kernel", "_expand_segment_kernel")))


class _RecordedLaunch:
    """Stands in for a Triton kernel: `kernel[grid](...)` records the grid and launches nothing."""

    def __init__(self):
        self.grids: list[tuple] = []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return lambda *args, **kwargs: None


@contextmanager
def launches_recorded():
    saved = {(m, name): getattr(m, name) for m, names in KERNELS for name in names}
    stand_ins = {key: _RecordedLaunch() for key in saved}
    try:
        for (m, name), stand_in in stand_ins.items():
            setattr(m, name, stand_in)
        yield {name: stand_in for (_, name), stand_in in stand_ins.items()}
    finally:
        for (m, name), kernel in saved.items():
            setattr(m, name, kernel)


def prefill_arguments(tokens: int, width: int, max_rank: int, segments: int) -> dict:
    """An eager step's q,k,v call at Llama-3-8B widths: tokens grouped into `segments` adapters."""
    rows = 4096
    tables = LoraTables(slots=torch.zeros(rows, 4096, dtype=torch.int32), ranks=torch.zeros(rows, 7, dtype=torch.int32),
                        a_off=torch.zeros(rows, 7, dtype=torch.int32), b_off=torch.zeros(rows, 7, dtype=torch.int32))
    groups = dict(seg_start=torch.zeros(segments + 1, dtype=torch.int32),
                  seg_adapter=torch.zeros(segments, dtype=torch.int32),
                  token_order=torch.zeros(tokens, dtype=torch.int32), max_seg_len=tokens // segments)
    return dict(x=torch.zeros(tokens, 4096), buf=torch.zeros(64, width), token_adapter=torch.zeros(tokens, dtype=torch.int32),
                tables=tables, y=torch.zeros(3, tokens, max_rank), out=torch.zeros(tokens, 4096 + 2 * 1024),
                max_rank=max_rank, groups=groups)


def measure(calls: int, tokens: int = 8192, segments: int = 32) -> dict:
    a = prefill_arguments(tokens, width=1024, max_rank=64, segments=segments)
    modules, out_dims = (0, 1, 2), (4096, 1024, 1024)
    ops = {
        "lora_shrink": lambda: shrink_mod.lora_shrink(a["x"], a["buf"], a["token_adapter"], a["tables"], modules,
                                                      a["max_rank"], out=a["y"], **a["groups"]),
        "lora_expand": lambda: expand_mod.lora_expand(a["y"], a["buf"], a["token_adapter"], a["tables"], modules,
                                                      a["out"], out_dims, **a["groups"]),
    }
    result = {"calls": calls, "tokens": tokens, "segments": segments}
    with launches_recorded() as recorded:
        for name, op in ops.items():
            for _ in range(max(1, calls // 10)):
                op()  # warm-up
            t0 = time.perf_counter()
            for _ in range(calls):
                op()
            result[f"{name}_us"] = (time.perf_counter() - t0) / calls * 1e6
        result["launches"] = {name: len(r.grids) for name, r in recorded.items() if r.grids}
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--tokens", type=int, default=8192, help="tokens of the step (an admission round's prefill)")
    p.add_argument("--segments", type=int, default=32, help="distinct adapters among them")
    args = p.parse_args(argv)
    result = measure(args.calls, args.tokens, args.segments)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
