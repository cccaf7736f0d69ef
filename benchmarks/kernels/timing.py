"""Device timing: CUDA-graph replays timed with events, median of many (launch gaps as in a captured
decode step; host overhead of the Python launchers excluded, as it is under graph replay)."""
from __future__ import annotations

import statistics

import torch


def time_graph(fn, iters: int = 30, warmup: int = 2) -> float:
    """Median milliseconds of one replay of a graph capturing `fn()`. Without a GPU (smoke runs of the
    scripts) it runs `fn` once and returns NaN."""
    fn()
    if not torch.cuda.is_available():
        return float("nan")  # compile and autotune outside the capture
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times)


def time_eager(fn, iters: int = 20) -> float:
    """Median milliseconds of `fn()` without a graph (for work too large or too dynamic to capture)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
