"""The matmul rate a GPU holds: the roofline's product (bench/roofline.py) run back to back long enough for the
board's power limit to bring the SM clock down, in timed windows.

Why: the roofline's matmul ceiling is a burst of 20 products, timed at the clock the GPU reaches before its
power draw catches up. Steps bound by their FLOPs for tens of ms at a time (an admission step's GEMMs) run at
the clock the power limit leaves: an H100 at 700 W held 0.85 of its burst rate (docs/benchmarks.md, 2026-12-07).
"""
from __future__ import annotations

import statistics
import time


def run_windows(n: int, seconds: float, window_s: float, device: str, burst: int = 20) -> list[dict]:
    """Back-to-back n × n products (bf16 on CUDA, fp32 on a CPU) in windows of about `window_s`. The first window
    is `burst` products, the roofline's count; it sets the count of the rest. Each window: its start (seconds
    since the epoch), its seconds, the products in it and their TFLOP/s."""
    import torch

    on_cuda = device.startswith("cuda")
    dtype = torch.bfloat16 if on_cuda else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)

    def sync():
        if on_cuda:
            torch.cuda.synchronize(device)

    torch.mm(a, b, out=c)  # the library's first call picks its algorithm: not timed
    sync()
    per_window, windows, began = burst, [], time.perf_counter()
    while time.perf_counter() - began < seconds:
        start = time.perf_counter()
        for _ in range(per_window):
            torch.mm(a, b, out=c)
        sync()
        end = time.perf_counter()
        windows.append({"start": time.time() - (end - start), "seconds": end - start, "products": per_window,
                        "tflops": 2 * n ** 3 * per_window / (end - start) / 1e12})
        # About window_s of work queued at a time, so a window times the GPU, not the host between windows.
        per_window = max(1, round(per_window * window_s / max(end - start, 1e-6)))
    return windows


def held_tflops(windows: list[dict]) -> float:
    """The median rate over the second half of the windows (the first is the burst, before the clock falls)."""
    if len(windows) < 2:
        raise ValueError("a held rate needs two windows or more: run for longer than the burst")
    return statistics.median(w["tflops"] for w in windows[len(windows) // 2:])


def measure_held_tflops(device: str, n: int, seconds: float, window_s: float) -> float:
    return held_tflops(run_windows(n, seconds, window_s, device))
