"""The S-LoRA workload: Gamma arrivals, power-law adapter popularity, uniform prompt and output lengths.

Arrivals are a Gamma renewal process of rate R and burstiness cv (inter-arrival shape 1/cv², scale cv²/R,
so mean 1/R and coefficient of variation cv); the adapter of each request is floor(power(alpha) * n)
(alpha = 1 uniform, small alpha concentrates requests on the low indices); prompt and output lengths are
independent uniform integers in [lo, hi).

Each quantity is drawn from its own stream of one seed (common random numbers): changing n or alpha keeps
the arrival times and lengths, changing R only rescales time (the same standard Gamma draws divided by R),
so the points of a sweep differ in the one parameter swept and not in sampling noise.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TraceRequest:
    index: int
    arrival_s: float  # seconds after the run's start
    adapter: int | None  # index into the run's adapters; None = the base model
    prompt_len: int
    output_len: int


def _check_range(name: str, rng: tuple[int, int]) -> tuple[int, int]:
    try:
        lo, hi = (int(v) for v in rng)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a pair of integers (lo, hi), got {rng!r}") from None
    if lo < 1 or hi <= lo:
        raise ValueError(f"{name} must satisfy 1 <= lo < hi (lengths are drawn from [lo, hi)), got {rng!r}")
    return lo, hi


def _check(n_adapters: int, alpha: float, req_rate: float, cv: float, duration_s: float) -> None:
    if isinstance(n_adapters, bool) or not isinstance(n_adapters, (int, np.integer)) or n_adapters < 0:
        raise ValueError(f"n_adapters must be an integer >= 0 (0 = base model only), got {n_adapters!r}")
    for name, value in (("req_rate", req_rate), ("cv", cv), ("duration_s", duration_s)):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if n_adapters and not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha must be a finite number > 0 (1 = uniform popularity), got {alpha!r}")


def _arrivals(rng: np.random.Generator, req_rate: float, cv: float, duration_s: float) -> np.ndarray:
    """Arrival times in (0, duration_s): cumulative Gamma gaps, drawn in blocks until past the end."""
    shape = 1.0 / (cv * cv)
    expected = req_rate * duration_s
    block = int(expected + 6 * cv * math.sqrt(expected) + 16)  # one block almost always suffices
    gaps: list[np.ndarray] = []
    total = 0.0
    while total < duration_s:
        # Standard Gamma divided by R: the same draws at every rate (scale cv²/R = (1/shape) / R).
        g = rng.standard_gamma(shape, block) * (cv * cv / req_rate)
        gaps.append(g)
        total += float(g.sum())
    times = np.cumsum(np.concatenate(gaps))
    return times[times < duration_s]


def make_trace(n_adapters: int, alpha: float, req_rate: float, cv: float, duration_s: float, seed: int,
               prompt_range: tuple[int, int] = (8, 512), output_range: tuple[int, int] = (8, 512)) -> list[TraceRequest]:
    """The requests arriving in [0, duration_s), in arrival order, reproducible from `seed`."""
    _check(n_adapters, alpha, req_rate, cv, duration_s)
    p_lo, p_hi = _check_range("prompt_range", prompt_range)
    o_lo, o_hi = _check_range("output_range", output_range)
    arrival_rng, adapter_rng, prompt_rng, output_rng = (np.random.default_rng(s)
                                                        for s in np.random.SeedSequence(seed).spawn(4))
    times = _arrivals(arrival_rng, float(req_rate), float(cv), float(duration_s))
    n = len(times)
    if n_adapters:
        # power() can round up to exactly 1.0; that draw belongs to the last adapter, not one past it.
        adapters = np.minimum(np.floor(adapter_rng.power(alpha, n) * n_adapters).astype(np.int64), n_adapters - 1).tolist()
    else:
        adapters = [None] * n
    prompts = prompt_rng.integers(p_lo, p_hi, n).tolist()
    outputs = output_rng.integers(o_lo, o_hi, n).tolist()
    return [TraceRequest(i, t, a, p, o) for i, (t, a, p, o) in enumerate(zip(times.tolist(), adapters, prompts, outputs))]
