"""A launch shape that fails to compile or launch becomes a row naming its error; the others still run."""
from __future__ import annotations

import math

import torch

from benchmarks.kernels.bench_lora import _timed_variant


def test_a_failing_variant_is_a_row_with_its_error():
    def too_big():
        raise RuntimeError("out of resource: shared memory, Required: 262144, Hardware limit: 232448")

    row = _timed_variant(too_big, 8, 1000, {"variant": "block_n 512 warps 8", "op": "expand"})
    assert row["us"] is None and row["gbs"] is None and row["variant"] == "block_n 512 warps 8"
    assert row["error"].startswith("RuntimeError: out of resource: shared memory")


def test_a_working_variant_is_timed():
    calls = []
    row = _timed_variant(lambda: calls.append(1), 8, 1000, {"variant": "default"})
    assert calls and "error" not in row and row["variant"] == "default"
    if torch.cuda.is_available():
        assert row["us"] > 0 and row["gbs"] > 0
    else:
        assert math.isnan(row["us"])  # no GPU: the shape runs once and is not timed
